"""The 4D step simulator: packed micro-batches -> CP shards -> per-layer times -> pipeline timeline.

A step ends when its slowest DP replica's pipeline finishes, plus FSDP's exposed traffic. Speedups
compare time per token (modes that delay documents train slightly different token counts a step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_wlb.sim.config import ModeSpec, SimConfig
from torchtitan_wlb.sim.integration import cp_shards, pack_steps, shard_costs
from torchtitan_wlb.sim.timeline import Schedule, build_schedule, simulate_pipeline
from torchtitan_wlb.sim.timing import dp_exposed_seconds, layers_per_vstage, stage_times

# (mode, lengths, cfg, n_steps) -> (per step: its N micro-batches' document lengths, packer stats)
PackFn = Callable[[ModeSpec, np.ndarray, SimConfig, int], tuple[list[list[np.ndarray]], dict]]


@dataclass
class ModeResult:
    """What one mode's simulation produced, per timed step: step time, tokens, max / mean
    micro-batch latency, idle share of the slowest replica's pipeline; ``rank_compute_s`` [steps,
    dp, pp, cp] each GPU's compute, ``mb_rank_compute_s`` [steps, N, cp] each micro-batch's on each
    CP rank (the paper's Figure 4 heat map); ``gantt`` the first step's slowest timeline."""

    mode: ModeSpec
    step_time_s: np.ndarray
    tokens: np.ndarray
    imbalance: np.ndarray
    bubble_fraction: np.ndarray
    rank_compute_s: np.ndarray
    mb_rank_compute_s: np.ndarray
    gantt: tuple[Schedule, np.ndarray, np.ndarray]
    per_document_share: float
    pack_stats: dict
    hybrid_share: float = 0.0

    @property
    def seconds_per_token(self) -> float:
        return float(self.step_time_s.sum() / self.tokens.sum())

    def summary(self) -> dict:
        # Slowest GPU's compute over the mean GPU's, per step (the paper's 1.44 on its 8K-GPU job).
        per_step = self.rank_compute_s.reshape(self.rank_compute_s.shape[0], -1)
        gpu_imbalance = per_step.max(axis=1) / per_step.mean(axis=1)
        return {
            "step_time_s": float(self.step_time_s.mean()), "imbalance": float(self.imbalance.mean()),
            "bubble_fraction": float(self.bubble_fraction.mean()),
            "tokens_per_step": float(self.tokens.mean()),
            "tokens_per_s": float(1.0 / self.seconds_per_token),
            "gpu_latency_max_over_mean": float(gpu_imbalance.mean()), "packer": self.mode.packer,
            "cp_strategy": self.mode.cp_strategy, "per_document_share": self.per_document_share,
            "hybrid_share": self.hybrid_share,
        }  # fmt: skip


def simulate_mode(mode: ModeSpec, lengths, cfg: SimConfig, pack: PackFn = pack_steps) -> ModeResult:
    """Simulate ``cfg.steps`` timed steps of one mode; ``pack`` packs the stream into steps (a
    diagnostic may rearrange the mode's packer's output)."""
    steps, stats = pack(mode, lengths, cfg, cfg.warmup_steps + cfg.steps)
    steps = steps[cfg.warmup_steps : cfg.warmup_steps + cfg.steps]
    n_steps, n = len(steps), cfg.n_global
    if n_steps == 0 or any(len(s) != n for s in steps):
        raise ValueError(
            f"packer {mode.packer!r} produced {[len(s) for s in steps]} micro-batches per step, "
            f"expected {n} for {cfg.steps} steps (is the document stream long enough?)"
        )
    flat = [np.asarray(mb, dtype=np.int64) for s in steps for mb in s]
    shards = cp_shards(flat, cfg, mode.cp_strategy, mode.cp_candidates)
    costs = shard_costs(shards, cfg)
    fwd, bwd, p2p = stage_times(cfg.model, cfg.layout, cfg.hardware, cfg.chunks, costs)
    dp, m, n_v = cfg.layout.dp, cfg.m, fwd.shape[1]
    # [steps * N, V] -> [steps, dp, m, V] -> [steps * dp, V, m]
    f, b = (x.reshape(n_steps, dp, m, n_v).transpose(0, 1, 3, 2).reshape(-1, n_v, m) for x in (fwd, bwd))  # fmt: skip
    schedule = build_schedule(cfg.layout.pp, m, cfg.chunks)
    res = simulate_pipeline(schedule, f, b, p2p.reshape(n_steps * dp, m))
    makespan = res.makespan.reshape(n_steps, dp)
    slowest = makespan.argmax(axis=1)
    step_time = makespan.max(axis=1) + dp_exposed_seconds(cfg.model, cfg.layout, cfg.hardware)
    bubble = res.bubble_fraction.reshape(n_steps, dp)[np.arange(n_steps), slowest]

    mb_latency = (fwd + bwd).sum(axis=1).reshape(n_steps, n)
    imbalance = mb_latency.max(axis=1) / mb_latency.mean(axis=1)

    # Per-GPU compute (no waiting): [steps, dp, pp, cp].
    layers = layers_per_vstage(cfg.model.n_layers, n_v)
    stage_of_v = np.arange(n_v) % cfg.layout.pp
    layers_phys = np.bincount(stage_of_v, weights=layers, minlength=cfg.layout.pp)
    per_layer = (costs.compute_fwd + costs.compute_bwd).reshape(n_steps, dp, m, cfg.layout.cp)
    rank_compute = per_layer.sum(axis=2)[:, :, None, :] * layers_phys[None, None, :, None]

    tokens = np.array([sum(int(mb.sum()) for mb in s) for s in steps], dtype=np.float64)
    first = int(slowest[0])
    gantt = (schedule, res.start[first].copy(), res.end[first].copy())
    chose = (shards.chose_per_document, shards.chose_hybrid)
    doc_share, hybrid_share = (float(np.mean(x)) if flat else 0.0 for x in chose)
    return ModeResult(mode, step_time, tokens, imbalance, bubble, rank_compute,
                      per_layer.reshape(n_steps, n, cfg.layout.cp) * cfg.model.n_layers, gantt,
                      doc_share, stats, hybrid_share)  # fmt: skip


def speedup(baseline: ModeResult, other: ModeResult) -> float:
    """Throughput ratio other / baseline (time per token)."""
    return baseline.seconds_per_token / other.seconds_per_token
