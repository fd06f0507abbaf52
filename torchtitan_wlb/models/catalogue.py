"""The model shapes of the package, by name: one table for the model registration, the benchmarks
and the simulator.

A "7B" figure from ``pack_bench``, a simulated "7B" step time and a ``paper_7B`` training run are
about the same model because all three read its dimensions here. Pure Python (no torch), so the
NumPy-only tools import it for free.

**The paper's models.** WLB-LLM (OSDI '25, Table 1) evaluates "Llama-like" 550M, 7B, 30B and 70B
models without publishing their dimensions. These follow the Llama 3 recipe (grouped-query
attention, the 128,256-token vocabulary) at the public Llama widths closest to those sizes, under
the constraints of Table 1's layouts as TorchTitan runs them: the TP degree divides the query heads
and the KV heads (TorchTitan shards K/V heads over TP; it does not replicate them), and the layers
split evenly into PP 4 x 2 interleaved stages.

- ``550M``: dim 1024, 24 layers, 16 heads, 8 KV heads, FFN 4096 (509M parameters with tied
  embeddings, 640M untied).
- ``7B``: Llama-2 7B widths (dim 4096, 32 layers, FFN 11008) with 8 KV heads.
- ``30B``: 56 heads of 128 (TP8 must divide the heads; LLaMA-30B's 52 would not), 56 layers,
  FFN 18432.
- ``70B``: Llama 3 70B widths with 16 KV heads. Table 1 runs it at TP16, where a shard of 8 KV
  heads would be half a head; at TP16 each GPU holds one K/V head, the work of 8 heads replicated
  twice.

**Llama 3.** ``llama3_8B`` and ``llama3_70B`` are TorchTitan's ``llama3_args["8B"]`` and
``["70B"]`` (a test checks that they stay equal). **CPU models.** ``debugmodel`` and ``tiny`` run
on a CPU with the built-in byte tokenizer (vocabulary 264).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DIM_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "vocab_size")
"""The shape fields of :class:`ModelSpec`, in order (the keyword arguments of
``CostModel.from_model_dims`` and the simulator's custom-model flags)."""


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of a decoder-only Llama-style transformer.

    Attributes:
        name: Catalogue name, or a caller's label for custom dimensions.
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
        return {k: v for k, v in asdict(self).items() if k in DIM_FIELDS}


LLAMA3_VOCAB = 128256

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("550M", dim=1024, n_layers=24, n_heads=16, n_kv_heads=8,
                  ffn_hidden_dim=4096, vocab_size=LLAMA3_VOCAB),
        ModelSpec("7B", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                  ffn_hidden_dim=11008, vocab_size=LLAMA3_VOCAB),
        ModelSpec("30B", dim=7168, n_layers=56, n_heads=56, n_kv_heads=8,
                  ffn_hidden_dim=18432, vocab_size=LLAMA3_VOCAB),
        ModelSpec("70B", dim=8192, n_layers=80, n_heads=64, n_kv_heads=16,
                  ffn_hidden_dim=28672, vocab_size=LLAMA3_VOCAB),
        ModelSpec("llama3_8B", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                  ffn_hidden_dim=14336, vocab_size=LLAMA3_VOCAB),
        ModelSpec("llama3_70B", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                  ffn_hidden_dim=28672, vocab_size=LLAMA3_VOCAB),
        ModelSpec("debugmodel", dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                  ffn_hidden_dim=768, vocab_size=264),
        ModelSpec("tiny", dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_hidden_dim=384, vocab_size=264),
    )
}  # fmt: skip

PAPER_MODELS = ("550M", "7B", "30B", "70B")
"""The paper's Table 1 models, smallest first."""


def get_model(name: str) -> ModelSpec:
    """Look a model up by catalogue name (case-insensitive), with a clear error for unknown names."""
    key = name.strip().lower()
    for spec in MODELS.values():
        if spec.name.lower() == key:
            return spec
    raise ValueError(f"unknown model preset {name!r}; accepted: {', '.join(MODELS)}")
