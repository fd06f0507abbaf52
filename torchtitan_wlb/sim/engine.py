"""The 4D step simulator: packed micro-batches -> CP shards -> per-layer times -> pipeline timeline.

``simulate_mode`` runs one mode over many optimizer steps, as docs/simulator.md draws it: the
mode's packer, its CP plan per micro-batch (``integration``), one layer's time per micro-batch
(``timing``), then 1F1B / interleaved 1F1B for every (step, DP replica) pipeline at once
(``timeline``); a step ends when its slowest replica finishes, plus FSDP's exposed traffic.
Speedups compare time per token (modes that delay documents train slightly different token
counts per step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_wlb.sim.config import SimConfig
from torchtitan_wlb.sim.integration import cp_shards, pack_steps, shard_costs
from torchtitan_wlb.sim.modes import ModeSpec
from torchtitan_wlb.sim.timeline import Schedule, build_schedule, simulate_pipeline
from torchtitan_wlb.sim.timing import dp_exposed_seconds, layers_per_vstage, stage_times

# (mode, lengths, cfg, n_steps) -> (per step: its N micro-batches' document lengths, packer stats)
PackFn = Callable[[ModeSpec, np.ndarray, SimConfig, int], tuple[list[list[np.ndarray]], dict]]


@dataclass
class ModeResult:
    """What one mode's simulation produced.

    Attributes:
        mode: The mode.
        step_time_s: [steps] simulated step times.
        tokens: [steps] tokens trained per step.
        imbalance: [steps] max / mean predicted micro-batch latency in the global batch.
        bubble_fraction: [steps] idle share of pipeline stage-time (slowest replica).
        rank_compute_s: [steps, dp, pp, cp] compute time of each GPU (TP ranks are identical),
            waiting excluded.
        mb_rank_compute_s: [steps, N, cp] compute time (all layers, forward + backward) of each
            micro-batch on each CP rank: the latency heat map (paper Figure 4).
        gantt: timeline of the first timed step's slowest replica: (schedule, start [n_ops],
            end [n_ops]).
        per_document_share: share of micro-batches whose CP plan is per-document.
        pack_stats: packer statistics (whatever the packer reports, averaged).
        hybrid_share: share of micro-batches whose CP plan is hybrid.
    """

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
        """This mode's object in the JSON output of ``wlb-sim``."""
        # Slowest GPU's compute over the mean GPU's, per step (the paper's 1.44 on its 8K-GPU job).
        per_step = self.rank_compute_s.reshape(self.rank_compute_s.shape[0], -1)
        gpu_imbalance = per_step.max(axis=1) / per_step.mean(axis=1)
        return {
            "step_time_s": float(self.step_time_s.mean()),
            "imbalance": float(self.imbalance.mean()),
            "bubble_fraction": float(self.bubble_fraction.mean()),
            "tokens_per_step": float(self.tokens.mean()),
            "tokens_per_s": float(1.0 / self.seconds_per_token),
            "gpu_latency_max_over_mean": float(gpu_imbalance.mean()),
            "packer": self.mode.packer,
            "cp_strategy": self.mode.cp_strategy,
            "per_document_share": self.per_document_share,
            "hybrid_share": self.hybrid_share,
        }


def simulate_mode(
    mode: ModeSpec, lengths: np.ndarray, cfg: SimConfig, pack: PackFn = pack_steps
) -> ModeResult:
    """Simulate ``cfg.steps`` timed steps of one mode on a document-length stream.

    ``pack`` packs the stream into steps (default: the mode's packer; a diagnostic may rearrange
    its output).
    """
    total_steps = cfg.warmup_steps + cfg.steps
    steps, stats = pack(mode, lengths, cfg, total_steps)
    steps = steps[cfg.warmup_steps : cfg.warmup_steps + cfg.steps]
    n_steps = len(steps)
    n = cfg.n_global
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
    return ModeResult(
        mode=mode,
        step_time_s=step_time,
        tokens=tokens,
        imbalance=imbalance,
        bubble_fraction=bubble,
        rank_compute_s=rank_compute,
        mb_rank_compute_s=per_layer.reshape(n_steps, n, cfg.layout.cp) * cfg.model.n_layers,
        gantt=gantt,
        per_document_share=float(np.mean(shards.chose_per_document)) if flat else 0.0,
        pack_stats=stats,
        hybrid_share=float(np.mean(shards.chose_hybrid)) if flat else 0.0,
    )


def speedup(baseline: ModeResult, other: ModeResult) -> float:
    """Throughput ratio other / baseline (time per token)."""
    return baseline.seconds_per_token / other.seconds_per_token
