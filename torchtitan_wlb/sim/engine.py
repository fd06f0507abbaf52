"""The 4D step simulator: packed micro-batches -> CP shards -> per-layer times -> pipeline timeline.

One call simulates one mode over many optimizer steps:

1. the mode's packer (torchtitan_wlb.packing) turns the document stream into, per step, N = m x DP
   micro-batches (m per pipeline); DP replica r runs micro-batches [r m, (r+1) m);
2. the mode's CP plan (torchtitan_wlb.cp.plan) gives each CP rank its attention segments;
3. ``timing.layer_costs`` turns those into one layer's forward/backward time per micro-batch (the
   slowest CP rank + exposed TP/CP communication), a virtual stage's time is its layer count times that;
4. ``timeline.simulate_pipeline`` plays 1F1B / interleaved 1F1B for all (step, DP replica) pipelines at
   once; a step ends when its slowest replica finishes, plus FSDP's exposed gradient traffic.

Speedups compare time per token (modes that delay documents process slightly different token counts
per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from torchtitan_wlb.models.catalogue import ModelSpec
from torchtitan_wlb.sim.hardware import HardwareProfile
from torchtitan_wlb.sim.modes import ModeSpec
from torchtitan_wlb.sim.presets import Layout
from torchtitan_wlb.sim.timeline import SCHEDULES, Schedule, build_schedule, simulate_pipeline
from torchtitan_wlb.sim.timing import (
    AttentionTimeFn,
    LayerCosts,
    dp_exposed_seconds,
    layer_costs,
    layers_per_vstage,
    output_layer_seconds,
    p2p_seconds,
)


@dataclass(frozen=True)
class SimConfig:
    """What is simulated.

    Attributes:
        model: Model dimensions.
        layout: (TP, CP, PP, DP).
        context_len: Context window (tokens per fixed-length micro-batch); divisible by 2 x CP.
        hardware: Achieved throughputs and bandwidths.
        schedule: "1f1b" or "interleaved_1f1b".
        v: Model chunks per pipeline stage for interleaved 1F1B (ignored for 1F1B).
        steps: Optimizer steps simulated (after ``warmup_steps``).
        warmup_steps: Steps packed but not timed, so that WLB's outlier queues reach steady state.
        micro_batches: Micro-batches per pipeline per step (m); None = PP (the paper's global batch of
            PP x DP micro-batches).
        smax_factor: S_max / context length for variable-length packing (S_max comes from memory).
        queue_thresholds: Outlier queue thresholds for "wlb" packers; None = the packer's auto-tuning.
        max_delay_steps: Longest wait of an outlier document (steps).
        seed: Shuffles the document stream when it has to be repeated.
        cost_model: The packers' W(d): "profiled" (coefficients fitted to this simulator's own
            per-micro-batch times, as the paper fits its predictors to offline GPU profiles) or
            "analytic" (CostModel.from_model_dims FLOPs).
        cp_profile: Path of a measured CP attention-throughput profile (torchtitan_wlb.tools.cp_profile,
            the table adaptive CP selection reads). When given, it times attention and drives the
            adaptive choice; None = the hardware profile's kernel model.
    """

    model: ModelSpec
    layout: Layout
    context_len: int
    hardware: HardwareProfile = field(default_factory=HardwareProfile)
    schedule: str = "interleaved_1f1b"
    v: int = 2
    steps: int = 20
    warmup_steps: int = 4
    micro_batches: int | None = None
    smax_factor: float = 1.25
    queue_thresholds: tuple[int, ...] | None = None
    max_delay_steps: int = 4
    seed: int = 0
    cost_model: str = "profiled"
    cp_profile: str | None = None

    def __post_init__(self) -> None:
        cp = self.layout.cp
        if self.context_len < 1 or self.context_len % (2 * cp):
            raise ValueError(
                f"context length {self.context_len} is not divisible by 2 x CP = {2 * cp}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {self.schedule!r}; accepted: {', '.join(SCHEDULES)}"
            )
        if self.v < 1:
            raise ValueError(f"virtual stages per rank v={self.v} must be >= 1")
        if self.steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"steps={self.steps} must be >= 1 and warmup_steps >= 0")
        if self.cost_model not in ("profiled", "analytic"):
            raise ValueError(
                f"unknown cost model {self.cost_model!r}; accepted: profiled, analytic"
            )
        if self.smax_factor < 1.0:
            raise ValueError(f"smax_factor={self.smax_factor} must be >= 1 (S_max >= context)")
        layers_per_vstage(self.model.n_layers, self.layout.pp * self.chunks)
        build_schedule(self.layout.pp, self.m, self.chunks)

    @property
    def chunks(self) -> int:
        """Model chunks per physical stage (v for interleaved, 1 otherwise)."""
        return self.v if self.schedule == "interleaved_1f1b" else 1

    @property
    def m(self) -> int:
        """Micro-batches per pipeline per step."""
        return self.micro_batches if self.micro_batches is not None else self.layout.pp

    @property
    def n_global(self) -> int:
        """N: micro-batches per optimizer step over all DP replicas."""
        return self.m * self.layout.dp

    @property
    def smax(self) -> int:
        """S_max in tokens, rounded down to a multiple of 2 x CP."""
        unit = 2 * self.layout.cp
        return max(self.context_len, int(self.context_len * self.smax_factor) // unit * unit)


def epoch_steps(total_tokens: int, n_global: int, context_len: int, warmup_steps: int = 0) -> int:
    """Timed steps that cover a document stream about once: ``total / (N x context) - warmup``.

    A step trains about N x context tokens under every mode (variable-length packing moves tokens
    between micro-batches, not out of the step), so this many steps after the warm-up read the
    stream once. Results over a whole pass do not depend on which window of the data is simulated;
    a 100-step window of a skewed workload moves the speedup by a few hundredths.
    """
    per_step = n_global * context_len
    if total_tokens < per_step * (warmup_steps + 1):
        raise ValueError(
            f"the document stream holds {total_tokens} tokens, less than {warmup_steps + 1} steps of "
            f"{n_global} x {context_len}; give --steps explicitly (the stream is then repeated)"
        )
    return int(total_tokens // per_step) - warmup_steps


@dataclass
class CPShards:
    """Attention segments of a batch of micro-batches under one CP strategy (flat arrays).

    Attributes:
        seg_mb: [n_seg] micro-batch index of each segment.
        seg_rank: [n_seg] CP rank.
        seg_q: [n_seg] query tokens of the segment.
        seg_kv: [n_seg] keys it attends (its document's prefix up to the chunk's end).
        local_tokens: [n_mb, cp] tokens held by each CP rank.
        chose_per_document: [n_mb] for adaptive plans, whether per-document sharding was chosen.
    """

    seg_mb: np.ndarray
    seg_rank: np.ndarray
    seg_q: np.ndarray
    seg_kv: np.ndarray
    local_tokens: np.ndarray
    chose_per_document: np.ndarray


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

    @property
    def seconds_per_token(self) -> float:
        return float(self.step_time_s.sum() / self.tokens.sum())

    def summary(self) -> dict:
        """The JSON object of issue 6 for this mode (plus a few extras)."""
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
        }


class Integration:
    """How the simulator reaches the project's packers and CP planner (replaceable in tests)."""

    def pack(self, mode: ModeSpec, lengths: np.ndarray, cfg: SimConfig, n_steps: int):
        """-> (list over steps of list of N doc_lens arrays, stats dict)."""
        from torchtitan_wlb.sim import integration

        return integration.pack_steps(mode, lengths, cfg, n_steps)

    def shard(self, micro_batches: list[np.ndarray], cfg: SimConfig, strategy: str) -> CPShards:
        from torchtitan_wlb.sim import integration

        return integration.cp_shards(micro_batches, cfg, strategy)

    def attention_time(self, cfg: SimConfig) -> AttentionTimeFn | None:
        from torchtitan_wlb.sim import integration

        return integration.attention_time_fn(cfg)


def stage_times(
    cfg: SimConfig, costs: LayerCosts, shards_local: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[n_mb, V] forward / backward time per virtual stage, and [n_mb] p2p time."""
    n_v = cfg.layout.pp * cfg.chunks
    layers = layers_per_vstage(cfg.model.n_layers, n_v)
    fwd = costs.layer_fwd[:, None] * layers[None, :]
    bwd = costs.layer_bwd[:, None] * layers[None, :]
    out_f, out_b = output_layer_seconds(cfg.model, cfg.layout, cfg.hardware, shards_local)
    fwd[:, -1] += out_f
    bwd[:, -1] += out_b
    p2p = p2p_seconds(cfg.model, cfg.layout, cfg.hardware, shards_local)
    return fwd, bwd, p2p


def simulate_mode(
    mode: ModeSpec,
    lengths: np.ndarray,
    cfg: SimConfig,
    integration: Integration | None = None,
) -> ModeResult:
    """Simulate ``cfg.steps`` timed steps of one mode on a document-length stream."""
    integ = integration or Integration()
    total_steps = cfg.warmup_steps + cfg.steps
    steps, stats = integ.pack(mode, lengths, cfg, total_steps)
    steps = steps[cfg.warmup_steps : cfg.warmup_steps + cfg.steps]
    n_steps = len(steps)
    n = cfg.n_global
    if n_steps == 0 or any(len(s) != n for s in steps):
        raise ValueError(
            f"packer {mode.packer!r} produced {[len(s) for s in steps]} micro-batches per step, "
            f"expected {n} for {cfg.steps} steps (is the document stream long enough?)"
        )
    flat = [np.asarray(mb, dtype=np.int64) for s in steps for mb in s]
    shards = integ.shard(flat, cfg, mode.cp_strategy)
    costs = layer_costs(
        cfg.model,
        cfg.layout,
        cfg.hardware,
        shards.seg_mb,
        shards.seg_rank,
        shards.seg_q,
        shards.seg_kv,
        shards.local_tokens,
        attention_time=integ.attention_time(cfg),
    )
    fwd, bwd, p2p = stage_times(cfg, costs, shards.local_tokens)
    dp, m, n_v = cfg.layout.dp, cfg.m, fwd.shape[1]
    # [steps * N, V] -> [steps, dp, m, V] -> [steps * dp, V, m]
    f = fwd.reshape(n_steps, dp, m, n_v).transpose(0, 1, 3, 2).reshape(n_steps * dp, n_v, m)
    b = bwd.reshape(n_steps, dp, m, n_v).transpose(0, 1, 3, 2).reshape(n_steps * dp, n_v, m)
    p = p2p.reshape(n_steps * dp, m)
    schedule = build_schedule(cfg.layout.pp, m, cfg.chunks)
    res = simulate_pipeline(schedule, f, b, p)
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
    )


def speedup(baseline: ModeResult, other: ModeResult) -> float:
    """Throughput ratio other / baseline (time per token)."""
    return baseline.seconds_per_token / other.seconds_per_token
