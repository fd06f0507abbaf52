"""Hardware profiles: achieved throughputs and link bandwidths the timing model divides by.

Only *achieved* numbers belong here (what a real kernel or collective reaches, not the datasheet peak),
because the simulator predicts wall-clock time. The H100 defaults are public datasheet peaks scaled by
utilisations typical of large bf16 training jobs; `torchtitan_wlb.sim.calibrate` re-fits them from
measured per-micro-batch times.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class HardwareProfile:
    """Achieved compute throughput and interconnect bandwidth of one accelerator type.

    Attributes:
        name: Profile name.
        gemm_tflops: Achieved dense bf16 GEMM throughput per GPU (TFLOP/s) for the transformer's
            projections and MLP (H100 SXM: 989 peak, ~60 % achieved with TP-sharded shapes).
        attn_tflops: Achieved forward flash-attention throughput per GPU (TFLOP/s) on long,
            tile-aligned problems (the asymptote of the kernel's throughput curve).
        attn_kv_half: Mean visible keys per query row at which the attention kernel reaches half of
            ``attn_tflops``. A query tile's fixed prologue/epilogue is amortised over its key loop,
            so achieved throughput ~ kbar / (kbar + attn_kv_half); with 600 this follows the public
            FlashAttention-3 H100 causal curves (~200 TFLOP/s at 512 tokens, ~600 at 16K).
        hbm_gbps: HBM bandwidth (GB/s), for the memory-bound element-wise work (norms, RoPE, SwiGLU,
            residual adds) that the linear term also carries.
        elementwise_bytes_per_token_dim: Bytes moved per token and hidden unit by the element-wise ops of
            one layer, forward (backward counts twice): two RMSNorms (~8), two residual adds (~12),
            SwiGLU's activation over the 2.7x wider FFN (~16), RoPE on Q and K (~4), in bf16.
        nvlink_gbps: Achieved per-GPU collective bandwidth inside a node (GB/s, one direction).
        net_gbps: Achieved per-GPU bandwidth across nodes (RoCE / InfiniBand, GB/s, one direction).
        gpus_per_node: GPUs sharing one NVLink domain.
        collective_latency_us: Fixed start-up latency of one collective or point-to-point transfer (us).
        bwd_attn_factor: Backward / forward time ratio of flash attention (2.5x the FLOPs of the
            forward, at ~0.83 of its throughput: 3x).
        bwd_gemm_factor: Backward / forward time ratio of the GEMMs (input and weight gradients: 2x).
        tp_overlap: Fraction of tensor-parallel communication hidden behind compute (0 = exposed).
        cp_overlap: Fraction of the CP all-gather / reduce-scatter of K,V hidden behind compute.
        dp_overlap: Fraction of FSDP's per-step gradient reduce-scatter / parameter all-gather hidden.
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
        """Bandwidth of a collective whose ranks are spread over ``group_span`` consecutive GPUs.

        A group that fits in one node runs on NVLink; one that spans nodes is limited by the network.
        """
        return self.nvlink_gbps if group_span <= self.gpus_per_node else self.net_gbps

    def to_json(self, path: str | Path) -> None:
        """Write the profile as JSON (the format ``from_json`` and ``--hardware FILE`` read)."""
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> HardwareProfile:
        """Read a profile written by ``to_json`` (unknown keys are an error, missing ones default)."""
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"hardware profile {path}: unknown keys {unknown}; accepted: {sorted(known)}"
            )
        return cls(**data)


HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(),
    # H200: same compute as H100 SXM, faster HBM; same NVLink generation.
    "h200": HardwareProfile(name="h200", hbm_gbps=4300.0),
}


def get_hardware(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name, or a JSON profile file."""
    key = name_or_path.strip().lower()
    if key in HARDWARE_PROFILES:
        return HARDWARE_PROFILES[key]
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        return HardwareProfile.from_json(path)
    raise ValueError(
        f"unknown hardware profile {name_or_path!r}; accepted: {', '.join(HARDWARE_PROFILES)} "
        "or a JSON file written by HardwareProfile.to_json"
    )
