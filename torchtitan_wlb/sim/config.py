"""What one simulation runs: model, layout, hardware, schedule, packer settings, and the modes."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_wlb.config import MODE_PRESETS
from torchtitan_wlb.cp.adaptive import ADAPTIVE_CANDIDATES
from torchtitan_wlb.models.catalogue import ModelSpec
from torchtitan_wlb.sim.hardware import HardwareProfile, Layout
from torchtitan_wlb.sim.timeline import SCHEDULES, build_schedule
from torchtitan_wlb.sim.timing import layers_per_vstage


@dataclass(frozen=True)
class SimConfig:
    """What is simulated.

    Attributes:
        model: Model dimensions.
        layout: (TP, CP, PP, DP).
        context_len: Tokens per fixed-length micro-batch; divisible by 2 x CP.
        hardware: Achieved throughputs and bandwidths.
        schedule: "1f1b" or "interleaved_1f1b".
        v: Model chunks per pipeline stage for interleaved 1F1B (ignored for 1F1B).
        steps: Optimizer steps timed (after ``warmup_steps``).
        warmup_steps: Steps packed but not timed, so that WLB's outlier queues reach steady state.
        micro_batches: Micro-batches per pipeline per step; None = PP (the paper's global batch).
        smax_factor: S_max / context length for variable-length packing.
        queue_thresholds: Outlier queue thresholds of the "wlb" packers; None = auto.
        max_delay_steps: Longest wait of an outlier document (steps).
        seed: Shuffles the document stream when it has to be repeated.
        cost_model: The packers' W(d): "profiled" (fitted to simulated times) or "analytic" FLOPs.
        cp_profile: Measured CP throughput profile timing attention and adaptive CP; None = kernel.
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
        unit = 2 * self.layout.cp
        for ok, msg in (
            (
                self.context_len >= 1 and self.context_len % unit == 0,
                f"context length {self.context_len} is not divisible by 2 x CP = {unit}",
            ),
            (
                self.schedule in SCHEDULES,
                f"unknown schedule {self.schedule!r}; accepted: {', '.join(SCHEDULES)}",
            ),
            (self.v >= 1, f"virtual stages per rank v={self.v} must be >= 1"),
            (
                self.steps >= 1 and self.warmup_steps >= 0,
                f"steps={self.steps} must be >= 1 and warmup_steps >= 0",
            ),
            (
                self.cost_model in ("profiled", "analytic"),
                f"unknown cost model {self.cost_model!r}; accepted: profiled, analytic",
            ),
            (
                self.smax_factor >= 1.0,
                f"smax_factor={self.smax_factor} must be >= 1 (S_max >= context)",
            ),
        ):
            if not ok:
                raise ValueError(msg)
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
    """Timed steps that read a document stream about once, ``total / (N x context) - warmup``, so
    that results do not depend on which window of a skewed workload is simulated."""
    per_step = n_global * context_len
    if total_tokens < per_step * (warmup_steps + 1):
        raise ValueError(
            f"the document stream holds {total_tokens} tokens, less than {warmup_steps + 1} steps of "
            f"{n_global} x {context_len}; give --steps explicitly (the stream is then repeated)"
        )
    return int(total_tokens // per_step) - warmup_steps


@dataclass(frozen=True)
class ModeSpec:
    """One way to pack and shard a step.

    Attributes:
        name: Mode name on the command line and in the JSON output.
        packer: Packer name of torchtitan_wlb.packing.
        cp_strategy: CP sharding plan ("per_sequence", "per_document", "hybrid", "adaptive").
        outlier_delay: For the "wlb" packers: whether outlier documents wait in queues.
        variable_length: Whether micro-batches may exceed the context length up to S_max.
        description: One line for tables and plots.
        stream_cut: TorchTitan's loader: the stream cut every context length (else whole documents).
        cp_candidates: The strategies "adaptive" chooses among (the paper's two by default).
    """

    name: str
    packer: str
    cp_strategy: str
    outlier_delay: bool = True
    variable_length: bool = False
    description: str = ""
    stream_cut: bool = False
    cp_candidates: tuple[str, ...] = ("per_sequence", "per_document")


_P = MODE_PRESETS  # the paper's three systems, as the trainer's [wlb] mode presets define them
# The *_torchtitan modes are labelled alternatives, not the paper's Plain-4D: the paper keeps
# documents whole (its Table 2 imbalance of the original packing is whole-document next-fit's).
MODES: dict[str, ModeSpec] = {
    m.name: m
    for m in (
        ModeSpec(
            "plain_4d", *_P["plain_4d"], description="Plain-4D: original packing + per-sequence CP"
        ),
        ModeSpec(
            "fixed_4d",
            *_P["fixed_4d"],
            description="Fixed-4D: fixed-length greedy packing + fixed CP sharding",
        ),
        ModeSpec(
            "wlb",
            *_P["wlb"],
            variable_length=True,
            description="WLB-LLM: variable-length packing with outlier delay + adaptive CP",
        ),
        ModeSpec(
            "per_doc_cp",
            "original",
            "per_document",
            description="per-document CP only (original packing)",
        ),
        ModeSpec(
            "adaptive_cp", "original", "adaptive", description="adaptive CP only (original packing)"
        ),
        ModeSpec(
            "hybrid_cp",
            "original",
            "hybrid",
            description="hybrid CP only (original packing): short documents whole on one rank",
        ),
        ModeSpec(
            "wlb_hybrid",
            "wlb",
            "adaptive",
            variable_length=True,
            cp_candidates=ADAPTIVE_CANDIDATES,
            description="WLB-LLM with adaptive CP choosing among per-sequence, per-document, hybrid",
        ),
        ModeSpec(
            "varlen_packing",
            "wlb",
            "per_sequence",
            variable_length=True,
            description="variable-length packing with outlier delay only",
        ),
        ModeSpec(
            "varlen_no_delay",
            "wlb",
            "per_sequence",
            outlier_delay=False,
            variable_length=True,
            description="variable-length packing without outlier delay",
        ),
        ModeSpec(
            "wlb_no_delay",
            "wlb",
            "adaptive",
            outlier_delay=False,
            variable_length=True,
            description="WLB-LLM without outlier delay",
        ),
        ModeSpec(
            "wlb_paper",
            "wlb_paper",
            "adaptive",
            variable_length=True,
            description="WLB-LLM with the paper's Algorithm 1 as published",
        ),
        ModeSpec(
            "plain_4d_torchtitan",
            "original",
            "per_sequence",
            stream_cut=True,
            description="Plain-4D with TorchTitan's loader (stream cut at the context length)",
        ),
        ModeSpec(
            "per_doc_cp_torchtitan",
            "original",
            "per_document",
            stream_cut=True,
            description="per-document CP only, TorchTitan's loader",
        ),
        ModeSpec(
            "adaptive_cp_torchtitan",
            "original",
            "adaptive",
            stream_cut=True,
            description="adaptive CP only, TorchTitan's loader",
        ),
    )
}
REQUIRED_MODES = ("plain_4d", "fixed_4d", "wlb")
