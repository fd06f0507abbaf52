"""Model presets and parallel layouts the simulator knows by name.

The paper (WLB-LLM, OSDI '25, Table 1) evaluates "Llama-like" 550M, 7B, 30B and 70B models without
publishing their dimensions. The presets follow the Llama 3 recipe (grouped-query attention with 8 KV
heads, the 128,256-token vocabulary) at the public Llama widths closest to those sizes: Llama-2 7B and
70B widths, a 30B with 56 heads of 128 (TP8 must divide the heads; LLaMA-30B's 52 would not), and a
550M model (dim 1024, 24 layers; 509M parameters with tied embeddings, 640M untied). Every FLOP the
simulator counts comes from a concrete architecture rather than from a fitted constant.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of a decoder-only Llama-style transformer.

    Attributes:
        name: Preset name, or ``"custom"``.
        dim: Hidden size (model width).
        n_layers: Number of transformer blocks.
        n_heads: Number of query heads.
        n_kv_heads: Number of key/value heads (grouped-query attention when smaller than n_heads).
        ffn_hidden_dim: Inner size of the SwiGLU MLP (three dim x ffn matrices).
        vocab_size: Vocabulary size (embedding and output projection).
    """

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int

    def __post_init__(self) -> None:
        for field_name in (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_hidden_dim",
            "vocab_size",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {field_name}={value!r} must be a positive integer")
        if self.dim % self.n_heads:
            raise ValueError(f"model dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.dim // self.n_heads

    @property
    def params_per_layer(self) -> int:
        """Weights of one transformer block (attention projections + SwiGLU MLP; norms ignored)."""
        qo = 2 * self.dim * self.n_heads * self.head_dim
        kv = 2 * self.dim * self.n_kv_heads * self.head_dim
        mlp = 3 * self.dim * self.ffn_hidden_dim
        return qo + kv + mlp

    @property
    def n_params(self) -> int:
        """Total weights, with untied input embedding and output projection."""
        return self.n_layers * self.params_per_layer + 2 * self.vocab_size * self.dim


MODEL_PRESETS: dict[str, ModelSpec] = {
    "550M": ModelSpec("550M", dim=1024, n_layers=24, n_heads=16, n_kv_heads=8,
                      ffn_hidden_dim=4096, vocab_size=128256),
    "7B": ModelSpec("7B", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                    ffn_hidden_dim=11008, vocab_size=128256),
    "30B": ModelSpec("30B", dim=7168, n_layers=56, n_heads=56, n_kv_heads=8,
                     ffn_hidden_dim=18432, vocab_size=128256),
    "70B": ModelSpec("70B", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                     ffn_hidden_dim=28672, vocab_size=128256),
}  # fmt: skip


def get_model(name: str) -> ModelSpec:
    """Look a preset up by name (case-insensitive), with a clear error for unknown names."""
    for key, spec in MODEL_PRESETS.items():
        if key.lower() == name.strip().lower():
            return spec
    raise ValueError(
        f"unknown model preset {name!r}; accepted: {', '.join(MODEL_PRESETS)} "
        "(or give custom dims with --dim/--n-layers/--n-heads/...)"
    )


@dataclass(frozen=True)
class Layout:
    """A 4D parallel layout. Rank order is TP innermost, then CP, PP, DP (the paper's DP > PP > CP > TP).

    Attributes:
        tp: Tensor-parallel degree (with sequence parallelism).
        cp: Context-parallel degree (all-gather KV attention).
        pp: Pipeline-parallel degree (number of physical stages).
        dp: Data-parallel degree (FSDP replicas, each running its own pipeline).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for field_name in ("tp", "cp", "pp", "dp"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"parallel degree {field_name}={value!r} must be a positive integer"
                )

    @property
    def world_size(self) -> int:
        """Number of GPUs the layout uses."""
        return self.tp * self.cp * self.pp * self.dp

    def as_tuple(self) -> tuple[int, int, int, int]:
        """(TP, CP, PP, DP), the paper's notation."""
        return (self.tp, self.cp, self.pp, self.dp)


def resolve_layout(tp: int, cp: int, pp: int, dp: int | None, gpus: int | None) -> Layout:
    """Build a layout, inferring DP from the GPU count when DP is not given.

    Raises ValueError naming the GPU count when the layout's product does not divide it, or when an
    explicit DP makes the product differ from it.
    """
    inner = tp * cp * pp
    if gpus is not None:
        if gpus < 1:
            raise ValueError(f"--gpus {gpus} must be a positive integer")
        if gpus % inner:
            raise ValueError(
                f"parallel layout TP{tp} x CP{cp} x PP{pp} = {inner} does not divide the GPU count {gpus}"
            )
        if dp is None:
            dp = gpus // inner
        elif inner * dp != gpus:
            raise ValueError(
                f"parallel layout TP{tp} x CP{cp} x PP{pp} x DP{dp} = {inner * dp} does not match "
                f"the GPU count {gpus}"
            )
    return Layout(tp=tp, cp=cp, pp=pp, dp=1 if dp is None else dp)


@dataclass(frozen=True)
class PaperConfig:
    """One row of the paper's Table 1.

    Attributes:
        model: Model preset name.
        context_len: Context window in tokens.
        layout: (TP, CP, PP, DP) used in the paper.
    """

    model: str
    context_len: int
    layout: Layout


K = 1024
PAPER_TABLE1: tuple[PaperConfig, ...] = (
    PaperConfig("550M", 64 * K, Layout(2, 2, 4, 2)),
    PaperConfig("550M", 128 * K, Layout(2, 4, 4, 1)),
    PaperConfig("7B", 64 * K, Layout(4, 2, 4, 1)),
    PaperConfig("7B", 128 * K, Layout(8, 2, 4, 1)),
    PaperConfig("30B", 64 * K, Layout(8, 2, 4, 1)),
    PaperConfig("30B", 128 * K, Layout(8, 4, 4, 1)),
    PaperConfig("70B", 64 * K, Layout(16, 4, 4, 1)),
    PaperConfig("70B", 128 * K, Layout(16, 4, 4, 1)),
)
