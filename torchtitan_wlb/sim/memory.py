"""Peak memory of one rank, counted field by field from the model's dimensions, the layout and the
pipeline schedule (docs/simulator.md, "One rank"). Pure Python: no torch.

What a rank holds, as TorchTitan lays a Llama model out (TP with sequence parallelism, FSDP over
``dp_shard x cp``, the PP stages' layers):

- parameters, gradients and AdamW's two moments in fp32, sharded over TP and FSDP;
- under FSDP the compute-dtype copy of its stages' parameters, gathered for the whole step when
  PP is on (TorchTitan's default keeps them gathered between micro-batches), else of two blocks
  (the one computing and the one prefetched);
- under FSDP with PP the unsharded gradients, accumulated in fp32 over the step's micro-batches
  (the reduce-scatter runs after the last one);
- activations: with full activation checkpointing each layer of a micro-batch in flight keeps its
  input (the sequence-parallel shard, compute dtype), each stage of it its output; without, the
  layer's whole forward working set. In flight: the most (stage, micro-batch) pairs the schedule
  has run forward and not yet backward on this rank;
- one layer's working set during its backward (full AC: recomputed), counted twice: the forward's
  intermediates and their gradients;
- on the last stage the output layer's logits and the loss's fp32 copy and gradient.

Not counted: norms' weights, RoPE tables, the CUDA context and the allocator's fragmentation
(TorchTitan's ``memory`` figure is what the allocator reserved; ``peak_active_gib`` what tensors
held).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torchtitan_wlb.models.catalogue import ModelSpec

FP32_BYTES = 4
GIB = 2**30


@dataclass(frozen=True)
class RankShape:
    """What one rank holds and runs.

    Attributes:
        model: Model dimensions.
        tp: Tensor-parallel degree (sequence parallel: activations between blocks are 1/tp).
        cp: Context-parallel degree (each CP rank computes 1/cp of a micro-batch's tokens).
        fsdp: Ranks one parameter is sharded over (``dp_shard x cp``; 1: no FSDP).
        layers: Transformer blocks on this rank, all its pipeline stages together.
        has_embedding: Whether the rank holds the token embedding (first stage).
        has_output: Whether it holds the output layer and the loss (last stage).
        tokens: Tokens of the largest micro-batch, whole (before CP).
        held_layer_inputs: Most (layer, micro-batch) pairs in flight at once on this rank.
        held_stage_outputs: Most (stage, micro-batch) pairs in flight at once.
        pipelined: Whether PP is on (FSDP then keeps parameters gathered for the step).
        compute_bytes: Bytes of the compute dtype (2 for bf16 mixed precision, 4 for fp32).
        full_ac: Full activation checkpointing (else none: every intermediate is kept).
    """

    model: ModelSpec
    tp: int
    cp: int
    fsdp: int
    layers: int
    has_embedding: bool
    has_output: bool
    tokens: int
    held_layer_inputs: int
    held_stage_outputs: int
    pipelined: bool
    compute_bytes: int = 2
    full_ac: bool = True

    @property
    def params(self) -> int:
        """Weights of this rank's part of the model before TP and FSDP sharding."""
        m = self.model
        return self.layers * m.params_per_layer + (self.has_embedding + self.has_output) * (
            m.vocab_size * m.dim
        )


def layer_working_set(shape: RankShape) -> int:
    """Bytes of one block's forward intermediates on a CP rank's ``T = tokens / cp`` tokens:
    the attention's and the MLP's inputs all-gathered over TP (2 x T x dim), the projections'
    outputs before the reduce-scatter (2 x T x dim), Q, rotated Q and the attention output
    (3 x T x dim / tp), K, V and rotated K (3 x T x kv_dim / tp), the K and V the CP op gathers
    from the whole micro-batch (2 x tokens x kv_dim / tp), the MLP's four (T x ffn / tp) and the
    attention's fp32 log-sum-exp per head."""
    m, tp = shape.model, shape.tp
    t = shape.tokens / shape.cp
    kv_dim = max(m.n_kv_heads / tp, 1.0) * m.head_dim  # KV heads are replicated past tp = n_kv
    elements = (
        4.0 * t * m.dim
        + 3.0 * t * m.dim / tp
        + 3.0 * t * kv_dim
        + (2.0 * shape.tokens * kv_dim if shape.cp > 1 else 0.0)
        + 4.0 * t * m.ffn_hidden_dim / tp
    )
    lse = t * m.n_heads / tp * FP32_BYTES
    return int(elements * shape.compute_bytes + lse)


def rank_memory(shape: RankShape) -> dict[str, int]:
    """Bytes per field of :mod:`this module's <torchtitan_wlb.sim.memory>` list, and ``total``."""
    m, tp = shape.model, shape.tp
    per_tp = shape.params / tp
    shard = per_tp / shape.fsdp
    if shape.pipelined:
        gathered = per_tp
    else:  # the block computing and the one prefetched, or the larger embedding / output
        ends = (shape.has_embedding or shape.has_output) * m.vocab_size * m.dim
        gathered = min(per_tp, max(2 * m.params_per_layer, ends) / tp)
    sharded = shape.fsdp > 1
    token_dim = shape.tokens / shape.cp / tp * m.dim * shape.compute_bytes  # one SP activation
    working = layer_working_set(shape)
    if shape.full_ac:
        held = shape.held_layer_inputs * token_dim
    else:
        held = shape.held_layer_inputs * working
    t = shape.tokens / shape.cp
    out = 0.0
    if shape.has_output:  # logits, their fp32 copy and its gradient; the gathered input
        out = t * m.vocab_size / tp * (shape.compute_bytes + 2 * FP32_BYTES) + t * m.dim * (
            shape.compute_bytes
        )
    fields = {
        "params": FP32_BYTES * shard,
        "grads": FP32_BYTES * shard,
        "optimizer": 2 * FP32_BYTES * shard,
        "params_unsharded": shape.compute_bytes * gathered if sharded else 0.0,
        "grads_unsharded": FP32_BYTES * per_tp if sharded and shape.pipelined else 0.0,
        "activations": held,
        "stage_outputs": shape.held_stage_outputs * token_dim if shape.pipelined else 0.0,
        "layer_working_set": 2 * working,
        "output_and_loss": out,
    }
    result = {k: int(v) for k, v in fields.items()}
    result["total"] = sum(result.values())
    return result


def shape_dict(shape: RankShape) -> dict:
    """The shape as JSON-ready values (the model by name and dimensions)."""
    out = asdict(shape)
    out["model"] = {"name": shape.model.name, **shape.model.dims()}
    return out
