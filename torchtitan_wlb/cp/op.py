"""All-gather-KV context-parallel document attention (Llama 3 style) as a ``torch.library`` op.

Each CP rank holds the tokens a :class:`~torchtitan_wlb.cp.plan.CPPlan` assigned to it (cut out, with
this op's metadata, by :mod:`torchtitan_wlb.cp.local`). Its local tokens are
``[head half][tail half][whole documents]``; the first two hold pieces of documents split over the
group, whose K/V are gathered, the last (hybrid sharding only; empty otherwise) documents the rank
holds entirely. Forward: all-gather K and V of the split pieces over the CP group (one collective
for both; none at all when no document is split), reorder them into the packed sequence's order,
and run up to three varlen attention calls: head half and tail half against the gathered keys (every
query segment attends to the causal prefix of its own document, bottom-right aligned), and the
whole documents against their own local keys. Backward: re-gather K and V (keeps memory per layer
at the local size instead of holding ``c`` times the local KV until backward), recompute the local
attention under autograd, reduce-scatter the gathered keys' dK/dV back to their owners; the whole
documents' dK/dV stay local.

Why not SDPA/flex CP from torch: ring SDPA cannot mask documents and flex attention has no CPU
backward (docs/context_parallel.md). The forward is a custom op with a DTensor sharding rule
(``register_sharding``), so it also accepts DTensors sharded on the CP mesh dimension; its registered
backward unwraps DTensors, works on local shards and re-wraps the gradients.

Cost note: the backward recomputes the local attention forward (one extra attention forward per layer,
the price of a single implementation for every backend; flash-attn's saved-LSE backward would avoid it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication, register_sharding

from torchtitan_wlb.attention.varlen import document_attention, resolve_backend

__all__ = ["CPAttentionMetadata", "cp_attention"]


@dataclass
class CPAttentionMetadata:
    """One rank's share of a CP plan, in the form the op consumes (tensors on the compute device).

    Attributes:
        group_name: name of the CP process group (``ProcessGroup.group_name``).
        cp_rank: this rank's index in the CP group.
        cp_degree: CP group size.
        local_len: tokens this rank holds (``q.shape[0]``).
        max_gather_len: all-gather buffer rows per rank (the most gathered tokens on one rank; 0:
            no document is split and no collective runs).
        kv_order: int64 ``[gathered tokens]``: all-gather buffer row of every gathered token, in
            the packed order (the whole micro-batch unless hybrid keeps documents whole).
        n_head_tokens: local tokens of the head half; the tail half follows.
        n_gather_tokens: local tokens of both halves (whose K/V are gathered); the rank's whole
            documents follow.
        cu_seqlens_q: int32 ``(head, tail)`` query boundaries within each half.
        cu_seqlens_k: int32 ``(head, tail)`` key boundaries in gathered order (gaps interleaved).
        max_seqlen_q: ``(head, tail)`` longest query segment.
        max_seqlen_k: ``(head, tail)`` longest key segment.
        cu_seqlens_whole: int32 boundaries of the whole documents (queries and keys alike),
            relative to local token ``n_gather_tokens``; ``[0]`` when there are none.
        max_seqlen_whole: longest whole document (0 when none).
    """

    group_name: str
    cp_rank: int
    cp_degree: int
    local_len: int
    max_gather_len: int
    kv_order: torch.Tensor
    n_head_tokens: int
    n_gather_tokens: int
    cu_seqlens_q: tuple[torch.Tensor, torch.Tensor]
    cu_seqlens_k: tuple[torch.Tensor, torch.Tensor]
    max_seqlen_q: tuple[int, int]
    max_seqlen_k: tuple[int, int]
    cu_seqlens_whole: torch.Tensor
    max_seqlen_whole: int

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "auto"
    ) -> torch.Tensor:
        """:func:`cp_attention` with this metadata: what ``attention_from_metadata`` calls when a
        ``DocumentAttentionMetadata`` carries CP metadata (the attention package never imports
        this one)."""
        return cp_attention(q, k, v, self, backend=backend)


# ----------------------------------------------------------------------------------- internals
def _all_gather_kv(
    k: torch.Tensor, v: torch.Tensor, kv_order: torch.Tensor, max_local_len: int, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the gathered tokens (the rows ``k``, ``v`` of every rank), in packed order
    (one collective for both). No collective when nothing is gathered (the same on every rank)."""
    if max_local_len == 0:
        return k[:0], v[:0]
    group = _resolve_process_group(group_name)
    world = dist.get_world_size(group)
    local = torch.zeros((max_local_len, 2) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device)
    local[: k.shape[0], 0] = k
    local[: k.shape[0], 1] = v
    gathered = local.new_empty((world * max_local_len,) + tuple(local.shape[1:]))
    _all_gather_single(gathered, local, group)
    kv = gathered.index_select(0, kv_order)
    return kv[:, 0], kv[:, 1]


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _local_attention(
    q: torch.Tensor,
    k_glob: torch.Tensor,
    v_glob: torch.Tensor,
    k_whole: torch.Tensor,
    v_whole: torch.Tensor,
    cu_q_head: torch.Tensor,
    cu_k_head: torch.Tensor,
    cu_q_tail: torch.Tensor,
    cu_k_tail: torch.Tensor,
    cu_whole: torch.Tensor,
    sizes: list[int],
    scale: float,
    backend: str,
) -> torch.Tensor:
    """The rank's varlen calls: head half and tail half of its split-document queries against the
    gathered keys, then its whole documents against their local keys (``k_whole``, ``v_whole``:
    local rows ``n_gather`` onwards). A part with no tokens (an empty half when the sequence has
    fewer than 2c tokens, no whole documents) is skipped rather than handed to a kernel as an
    empty batch."""
    n_head, max_q_h, max_k_h, max_q_t, max_k_t, _, n_gather, max_whole = sizes
    parts = []
    for q_part, keys, values, cu_q, cu_k, max_q, max_k in (
        (q[:n_head], k_glob, v_glob, cu_q_head, cu_k_head, max_q_h, max_k_h),
        (q[n_head:n_gather], k_glob, v_glob, cu_q_tail, cu_k_tail, max_q_t, max_k_t),
        (q[n_gather:], k_whole, v_whole, cu_whole, cu_whole, max_whole, max_whole),
    ):
        if q_part.shape[0] == 0:
            continue
        parts.append(
            document_attention(
                q_part, keys, values, cu_q, cu_k, max_q, max_k, scale=scale, backend=backend
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# ------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("torchtitan_wlb::cp_attention_fwd", mutates_args=())
def cp_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_order: torch.Tensor,
    cu_q_head: torch.Tensor,
    cu_k_head: torch.Tensor,
    cu_q_tail: torch.Tensor,
    cu_k_tail: torch.Tensor,
    cu_whole: torch.Tensor,
    sizes: list[int],
    group_name: str,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Forward of CP attention on local tensors. ``sizes = [n_head_tokens, max_seqlen_q_head,
    max_seqlen_k_head, max_seqlen_q_tail, max_seqlen_k_tail, max_gather_len, n_gather_tokens,
    max_seqlen_whole]``."""
    n_gather = sizes[6]
    k_glob, v_glob = _all_gather_kv(k[:n_gather], v[:n_gather], kv_order, sizes[5], group_name)
    return _local_attention(
        q, k_glob, v_glob, k[n_gather:], v[n_gather:],
        cu_q_head, cu_k_head, cu_q_tail, cu_k_tail, cu_whole, sizes, scale, backend,
    )  # fmt: skip


@cp_attention_fwd.register_fake
def _(q, k, v, kv_order, cu_q_head, cu_k_head, cu_q_tail, cu_k_tail, cu_whole, sizes, group_name, scale, backend):  # fmt: skip
    return torch.empty_like(q)


def _cp_attention_backward_local(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_order: torch.Tensor,
    cu_q_head: torch.Tensor,
    cu_k_head: torch.Tensor,
    cu_q_tail: torch.Tensor,
    cu_k_tail: torch.Tensor,
    cu_whole: torch.Tensor,
    sizes: list[int],
    group_name: str,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward on local tensors: re-gather the split pieces' KV, recompute the local attention
    under autograd, reduce-scatter their dK/dV to their owners (whole documents' dK/dV are local).
    Runs in the autograd engine's context (not inside a custom-op body, where autograd dispatch is
    off and the recompute could not be differentiated)."""
    max_gather, n_gather = sizes[5], sizes[6]
    with torch.no_grad():
        k_glob, v_glob = _all_gather_kv(
            k[:n_gather], v[:n_gather], kv_order, max_gather, group_name
        )
    with torch.enable_grad():
        leaves = [
            t.detach().requires_grad_(True) for t in (q, k_glob, v_glob, k[n_gather:], v[n_gather:])
        ]
        out = _local_attention(
            *leaves, cu_q_head, cu_k_head, cu_q_tail, cu_k_tail, cu_whole, sizes, scale, backend
        )
        # A part may be absent on this rank (no whole document, no split piece): zero gradients.
        dq, dk_glob, dv_glob, dk_whole, dv_whole = torch.autograd.grad(
            out, leaves, grad_out, allow_unused=True, materialize_grads=True
        )
    if max_gather == 0:
        return dq, dk_whole, dv_whole
    group = _resolve_process_group(group_name)
    world = dist.get_world_size(group)
    buffer = dk_glob.new_zeros((world * max_gather, 2) + tuple(dk_glob.shape[1:]))
    buffer.index_copy_(0, kv_order, torch.stack([dk_glob, dv_glob], dim=1))
    mine = buffer.new_empty((max_gather,) + tuple(buffer.shape[1:]))
    _reduce_scatter_single(mine, buffer, group)
    dk = torch.cat([mine[:n_gather, 0], dk_whole])
    dv = torch.cat([mine[:n_gather, 1], dv_whole])
    return dq, dk, dv


_META_ARGS = 6  # kv_order and the five cu_seqlens tensors


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, kv_order, cu_qh, cu_kh, cu_qt, cu_kt, cu_w, sizes, group_name, scale, backend = inputs
    ctx.save_for_backward(q, k, v, kv_order, cu_qh, cu_kh, cu_qt, cu_kt, cu_w)
    ctx.extra = (sizes, group_name, scale, backend)


def _backward(ctx, grad_out):
    saved = ctx.saved_tensors
    sizes, group_name, scale, backend = ctx.extra
    # DTensor inputs (sharded on the CP mesh) are unwrapped here and their gradients re-wrapped with
    # the inputs' placements: the computation itself is per rank.
    local = [t.to_local() if isinstance(t, DTensor) else t for t in (grad_out, *saved)]
    grads = _cp_attention_backward_local(
        local[0].contiguous(), *local[1:], sizes, group_name, scale, backend
    )
    wrapped = tuple(
        DTensor.from_local(
            g, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
        )
        if isinstance(x, DTensor)
        else g
        for g, x in zip(grads, saved[:3], strict=True)
    )
    return wrapped + (None,) * (_META_ARGS + 4)


cp_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


@register_sharding(torch.ops.torchtitan_wlb.cp_attention_fwd.default)
def _fwd_sharding(q, k, v, kv_order, cu_qh, cu_kh, cu_qt, cu_kt, cu_w, sizes, group_name, scale, backend):  # fmt: skip
    """Token-sharded q/k/v on the CP mesh dimension in, token-sharded output out; the index
    tensors travel as replicated (each rank reads its own from the metadata)."""
    inputs = [Shard(0)] * 3 + [Replicate()] * _META_ARGS + [None] * 4
    return [([Shard(0)], inputs)]


# ------------------------------------------------------------------------------ public entry
def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: CPAttentionMetadata,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Document-masked causal attention of this rank's tokens under context parallelism.

    ``q: [local_len, n_heads, head_dim]``, ``k, v: [local_len, n_kv_heads, head_dim]`` in the plan's
    local layout (plain tensors, or DTensors sharded ``Shard(0)`` on a 1-D CP mesh). Returns
    ``[local_len, n_heads, head_dim]``. Differentiable with respect to q, k and v.
    """
    local_q = q.to_local() if isinstance(q, DTensor) else q
    local_k = k.to_local() if isinstance(k, DTensor) else k
    local_v = v.to_local() if isinstance(v, DTensor) else v
    _check_shapes(local_q, local_k, local_v, meta)
    if scale is None:
        scale = 1.0 / math.sqrt(local_q.shape[-1])
    chosen = resolve_backend(backend, local_q.device)
    sizes = [
        meta.n_head_tokens,
        meta.max_seqlen_q[0],
        meta.max_seqlen_k[0],
        meta.max_seqlen_q[1],
        meta.max_seqlen_k[1],
        meta.max_gather_len,
        meta.n_gather_tokens,
        meta.max_seqlen_whole,
    ]
    args = (
        q,
        k,
        v,
        meta.kv_order,
        meta.cu_seqlens_q[0],
        meta.cu_seqlens_k[0],
        meta.cu_seqlens_q[1],
        meta.cu_seqlens_k[1],
        meta.cu_seqlens_whole,
        sizes,
        meta.group_name,
        float(scale),
        chosen,
    )
    if isinstance(q, DTensor):
        with implicit_replication():
            return cp_attention_fwd(*args)
    return cp_attention_fwd(*args)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            "q, k, v must be [local_tokens, heads, head_dim]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"q, k, v shapes do not match: q={tuple(q.shape)}, k={tuple(k.shape)}, "
            f"v={tuple(v.shape)} (k and v equal, same tokens and head_dim as q)"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"n_heads={q.shape[1]} must be a multiple of n_kv_heads={k.shape[1]}")
    if q.shape[0] != meta.local_len:
        raise ValueError(
            f"this rank holds {meta.local_len} tokens in the CP plan, got q with {q.shape[0]}"
        )
