"""The model shapes of the package, by name: one table for the model registration, the benchmarks
and the simulator, so that a "7B" means the same model everywhere. Pure Python (no torch), so the
NumPy-only tools import it for free. The shapes and why they are these: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# The shape fields of ModelSpec, in order (CostModel.from_model_dims's keywords, wlb-sim's flags).
DIM_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "vocab_size")


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of a decoder-only Llama-style transformer."""

    name: str  # catalogue name, or a caller's label for custom dimensions
    dim: int  # hidden size (model width)
    n_layers: int  # transformer blocks
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention when fewer than n_heads)
    ffn_hidden_dim: int  # inner size of the SwiGLU MLP (three dim x ffn matrices)
    vocab_size: int  # rows of the embedding and of the output projection

    def __post_init__(self) -> None:
        for field_name in DIM_FIELDS:
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

    def dims(self) -> dict[str, int]:
        """The shape fields by name (``CostModel.from_model_dims(**spec.dims(), tp=, cp=)``)."""
        return {f: getattr(self, f) for f in DIM_FIELDS}


LLAMA3_VOCAB = 128256

MODELS: dict[str, ModelSpec] = {
    row[0]: ModelSpec(*row)
    for row in (
        # name,      dim, n_layers, n_heads, n_kv_heads, ffn_hidden_dim, vocab_size
        ("550M", 1024, 24, 16, 8, 4096, LLAMA3_VOCAB),
        ("7B", 4096, 32, 32, 8, 11008, LLAMA3_VOCAB),
        ("30B", 7168, 56, 56, 8, 18432, LLAMA3_VOCAB),
        ("70B", 8192, 80, 64, 16, 28672, LLAMA3_VOCAB),
        ("llama3_8B", 4096, 32, 32, 8, 14336, LLAMA3_VOCAB),
        ("llama3_70B", 8192, 80, 64, 8, 28672, LLAMA3_VOCAB),
        ("byte_1B", 2048, 16, 32, 8, 8192, 264),
        ("debugmodel", 256, 4, 8, 4, 768, 264),
        ("tiny", 128, 2, 4, 2, 384, 264),
    )
}
"""The catalogue by name; docs/models.md gives each shape and why."""

PAPER_MODELS = ("550M", "7B", "30B", "70B")
"""The paper's Table 1 models, smallest first."""


def get_model(name: str) -> ModelSpec:
    """Look a model up by catalogue name (case-insensitive); unknown names are an error."""
    key = name.strip().lower()
    for spec in MODELS.values():
        if spec.name.lower() == key:
            return spec
    raise ValueError(f"unknown model preset {name!r}; accepted: {', '.join(MODELS)}")
