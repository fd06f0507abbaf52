"""What one simulation runs: model, layout, hardware, pipeline schedule and the packers' settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_wlb.models.catalogue import ModelSpec
from torchtitan_wlb.sim.hardware import HardwareProfile
from torchtitan_wlb.sim.presets import Layout
from torchtitan_wlb.sim.timeline import SCHEDULES, build_schedule
from torchtitan_wlb.sim.timing import layers_per_vstage


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
    stream once: results then do not depend on which window of a skewed workload is simulated.
    """
    per_step = n_global * context_len
    if total_tokens < per_step * (warmup_steps + 1):
        raise ValueError(
            f"the document stream holds {total_tokens} tokens, less than {warmup_steps + 1} steps of "
            f"{n_global} x {context_len}; give --steps explicitly (the stream is then repeated)"
        )
    return int(total_tokens // per_step) - warmup_steps


def layout_label(layout: Layout) -> str:
    """``TP8 CP2 PP4 DP1``: a layout as tables and plots name it."""
    return f"TP{layout.tp} CP{layout.cp} PP{layout.pp} DP{layout.dp}"
