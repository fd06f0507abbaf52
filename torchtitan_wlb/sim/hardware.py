"""Where a simulation runs: the GPUs' *achieved* throughputs and bandwidths (the simulator predicts
wall-clock time; ``sim.calibrate`` re-fits them from measured times) and the 4D layout."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class HardwareProfile:
    """Achieved throughputs and bandwidths of one accelerator type (H100 sources: reproduction.md).

    Attributes:
        name: Profile name.
        gemm_tflops: Achieved dense bf16 GEMM TFLOP/s per GPU.
        attn_tflops: Achieved forward flash-attention TFLOP/s on long, tile-aligned problems.
        attn_kv_half: Mean visible keys per query row at which attention reaches half of
            ``attn_tflops`` (throughput ~ kbar / (kbar + attn_kv_half)).
        hbm_gbps: HBM bandwidth (GB/s) for the memory-bound element-wise work.
        elementwise_bytes_per_token_dim: Bytes per token and hidden unit moved by one layer's
            forward element-wise ops.
        nvlink_gbps: Achieved per-GPU collective bandwidth inside a node (GB/s, one direction).
        net_gbps: Achieved per-GPU bandwidth across nodes (GB/s, one direction).
        gpus_per_node: GPUs sharing one NVLink domain.
        collective_latency_us: Start-up latency of one collective or point-to-point transfer (us).
        bwd_attn_factor: Backward / forward time of flash attention.
        bwd_gemm_factor: Backward / forward time of the GEMMs (input and weight gradients).
        tp_overlap: Share of tensor-parallel communication hidden behind compute.
        cp_overlap: Share of the CP all-gather / reduce-scatter of K, V hidden behind compute.
        dp_overlap: Share of FSDP's per-step traffic hidden behind compute.
    """

    name: str = "h100"
    gemm_tflops: float = 600.0
    attn_tflops: float = 500.0
    attn_kv_half: float = 600.0
    hbm_gbps: float = 3000.0
    elementwise_bytes_per_token_dim: float = 40.0
    nvlink_gbps: float = 360.0
    net_gbps: float = 40.0
    gpus_per_node: int = 8
    collective_latency_us: float = 15.0
    bwd_attn_factor: float = 3.0
    bwd_gemm_factor: float = 2.0
    tp_overlap: float = 0.0
    cp_overlap: float = 0.0
    dp_overlap: float = 0.9

    def __post_init__(self) -> None:
        for f in fields(self)[1:]:  # every field but the name
            value = getattr(self, f.name)
            if f.name.endswith("overlap") and not 0.0 <= value <= 1.0:
                raise ValueError(f"hardware {f.name}={value!r} must lie in [0, 1]")
            if not f.name.endswith("overlap") and not value > 0:
                raise ValueError(f"hardware {f.name}={value!r} must be positive")

    def link_gbps(self, group_span: int) -> float:
        """Bandwidth of a collective over ``group_span`` consecutive GPUs: NVLink inside a node."""
        return self.nvlink_gbps if group_span <= self.gpus_per_node else self.net_gbps

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


# H200: the H100's compute and NVLink, faster HBM.
HARDWARE_PROFILES = {"h100": HardwareProfile(), "h200": HardwareProfile("h200", hbm_gbps=4300.0)}


def get_hardware(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name, or a JSON file written by ``to_json`` (unknown keys are an
    error, missing ones default)."""
    if (key := name_or_path.strip().lower()) in HARDWARE_PROFILES:
        return HARDWARE_PROFILES[key]
    path = Path(name_or_path)
    if path.suffix != ".json" or not path.exists():
        raise ValueError(
            f"unknown hardware profile {name_or_path!r}; accepted: {', '.join(HARDWARE_PROFILES)} "
            "or a JSON file written by HardwareProfile.to_json"
        )
    data, known = json.loads(path.read_text()), {f.name for f in fields(HardwareProfile)}
    if unknown := sorted(set(data) - known):
        raise ValueError(
            f"hardware profile {path}: unknown keys {unknown}; accepted: {sorted(known)}"
        )
    return HardwareProfile(**data)


@dataclass(frozen=True)
class Layout:
    """A 4D parallel layout; rank order is TP innermost, then CP, PP, DP (the paper's).

    Attributes:
        tp: Tensor-parallel degree (with sequence parallelism).
        cp: Context-parallel degree (all-gather KV attention).
        pp: Pipeline-parallel degree (physical stages).
        dp: Data-parallel degree (FSDP replicas, each running its own pipeline).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name, value in zip(("tp", "cp", "pp", "dp"), self.as_tuple(), strict=True):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel degree {name}={value!r} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.tp, self.cp, self.pp, self.dp)

    @property
    def label(self) -> str:
        """``TP8 CP2 PP4 DP1``: the layout as tables and plots name it."""
        return f"TP{self.tp} CP{self.cp} PP{self.pp} DP{self.dp}"


def resolve_layout(tp: int, cp: int, pp: int, dp: int | None, gpus: int | None) -> Layout:
    """A layout, with DP inferred from the GPU count when not given (which it must then match)."""
    inner = tp * cp * pp
    if gpus is not None:
        if gpus < 1:
            raise ValueError(f"--gpus {gpus} must be a positive integer")
        label = f"parallel layout TP{tp} x CP{cp} x PP{pp}"
        if gpus % inner:
            raise ValueError(f"{label} = {inner} does not divide the GPU count {gpus}")
        if dp is None:
            dp = gpus // inner
        elif inner * dp != gpus:
            raise ValueError(f"{label} x DP{dp} = {inner * dp} does not match the GPU count {gpus}")
    return Layout(tp=tp, cp=cp, pp=pp, dp=1 if dp is None else dp)
