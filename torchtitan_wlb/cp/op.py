"""All-gather-KV context-parallel document attention (Llama 3 style) as ``torch.library`` ops.

Forward and backward are custom ops with fake kernels, their collectives functional collectives on
the group named by ``group_name``, so ``torch.compile`` traces a block that calls them
(docs/compile.md). Backward re-gathers K/V, so that memory per layer stays at the local size,
recomputes the local attention under autograd and reduce-scatters the gathered rows' dK/dV
(docs/context_parallel.md).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication, register_sharding

from torchtitan_wlb.attention.ops import vjp_by_recompute
from torchtitan_wlb.attention.varlen import check_qkv, document_attention


@dataclass
class CPAttentionMetadata:
    """One rank's share of a CP plan as the op consumes it: what the collectives need, then its
    :class:`~torchtitan_wlb.cp.plan.LocalAttentionSpec` with the arrays as device tensors."""

    group_name: str  # the CP process group's ProcessGroup.group_name
    cp_rank: int  # this rank's index in the CP group
    cp_degree: int  # CP group size
    local_len: int  # tokens this rank holds (q.shape[0])
    max_gather_len: int  # all-gather buffer rows per rank (0: nothing split, no collective)
    kv_order: Tensor  # int64 all-gather buffer row of every gathered token, in packed order
    n_head_tokens: int
    n_gather_tokens: int
    cu_seqlens_q: tuple[Tensor, Tensor]
    cu_seqlens_k: tuple[Tensor, Tensor]
    max_seqlen_q: tuple[int, int]
    max_seqlen_k: tuple[int, int]
    cu_seqlens_whole: Tensor
    max_seqlen_whole: int
    key_window: tuple[tuple[int, int], tuple[int, int]]
    # The op's index tensors and sizes (:func:`op_arguments`; sizes as a host tensor), built
    # here, outside any compiled region: a compiled model specialises on none of the plan's values.
    # (arguments only for dataclasses.replace, which FSDP applies to forward inputs)
    op_cus: tuple[Tensor, ...] | None = field(default=None, repr=False)
    op_sizes: Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.op_cus is None or self.op_sizes is None:
            self.op_cus, sizes = op_arguments(self, self.max_gather_len)
            self.op_sizes = torch.tensor(sizes, dtype=torch.int64)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, backend: str = "auto") -> Tensor:
        """:func:`cp_attention` with this metadata."""
        return cp_attention(q, k, v, self, backend=backend)


def _all_gather_kv(
    k: Tensor, v: Tensor, kv_order: Tensor, sizes: list[int], group_name: str
) -> tuple[Tensor, Tensor]:
    """K and V of every rank's gathered tokens (its first ``n_gather_tokens``) in packed order,
    by one functional all-gather of a ``[max_gather_len, 2, ...]`` buffer per rank."""
    max_local_len, n_gather = sizes[5], sizes[6]
    k, v = k[:n_gather], v[:n_gather]
    if max_local_len == 0:
        return k[:0], v[:0]
    local = torch.zeros((max_local_len, 2) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device)
    local[: k.shape[0], 0] = k
    local[: k.shape[0], 1] = v
    gathered = _wait(funcol.all_gather_single(local, 0, group_name))
    kv = gathered.index_select(0, kv_order)
    return kv[:, 0], kv[:, 1]


def _wait(tensor: Tensor) -> Tensor:
    """A functional collective's result, waited for (eagerly it is an ``AsyncCollectiveTensor``)."""
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


PARTS = ("head", "tail", "whole")  # a rank's varlen calls, in local token order


def local_parts(
    q: Tensor,
    k_glob: Tensor,
    v_glob: Tensor,
    k_whole: Tensor,
    v_whole: Tensor,
    cus: tuple[Tensor, ...],
    sizes: list[int],
) -> tuple[tuple, tuple, tuple]:
    """The arguments ``(q, k, v, cu_q, cu_k, max_q, max_k)`` of a rank's three varlen calls
    (:data:`PARTS`): its halves against their key windows of the gathered keys, its whole
    documents against their own keys. A part may have no queries."""
    n_head, max_q_h, max_k_h, max_q_t, max_k_t, _, n_gather, max_whole = sizes[:8]
    head_a, head_b, tail_a, tail_b = sizes[8:12]  # each half's key window (LocalAttentionSpec)
    cu_q_head, cu_k_head, cu_q_tail, cu_k_tail, cu_whole = cus
    return (
        (q[:n_head], k_glob[head_a:head_b], v_glob[head_a:head_b], cu_q_head, cu_k_head)
        + (max_q_h, max_k_h),
        (q[n_head:n_gather], k_glob[tail_a:tail_b], v_glob[tail_a:tail_b], cu_q_tail, cu_k_tail)
        + (max_q_t, max_k_t),
        (q[n_gather:], k_whole, v_whole, cu_whole, cu_whole, max_whole, max_whole),
    )


def _local_attention(
    q: Tensor,
    k_glob: Tensor,
    v_glob: Tensor,
    k_whole: Tensor,
    v_whole: Tensor,
    cus: tuple[Tensor, ...],
    sizes: list[int],
    scale: float,
    backend: str,
) -> Tensor:
    """The rank's varlen calls (:func:`local_parts`); an empty part is skipped, not handed to a
    kernel as an empty batch."""
    parts = [
        document_attention(*part, scale=scale, backend=backend)
        for part in local_parts(q, k_glob, v_glob, k_whole, v_whole, cus, sizes)
        if part[0].shape[0] > 0
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


_INDEX_TENSORS = 6  # kv_order and the five cu_seqlens tensors (cu_q_head ... cu_whole)


def op_arguments(spec, max_gather_len: int) -> tuple[tuple, list[int]]:
    """A rank's five cu_seqlens (``cu_q_head ... cu_whole``) and ``sizes``, the op's argument
    layout, from its :class:`~torchtitan_wlb.cp.plan.LocalAttentionSpec` or metadata."""
    (cq_h, cq_t), (ck_h, ck_t) = spec.cu_seqlens_q, spec.cu_seqlens_k
    (mq_h, mq_t), (mk_h, mk_t) = spec.max_seqlen_q, spec.max_seqlen_k
    sizes = [spec.n_head_tokens, mq_h, mk_h, mq_t, mk_t, max_gather_len, spec.n_gather_tokens]
    sizes += [spec.max_seqlen_whole, *spec.key_window[0], *spec.key_window[1]]
    return (cq_h, ck_h, cq_t, ck_t, spec.cu_seqlens_whole), sizes


@torch.library.custom_op("torchtitan_wlb::cp_attention_fwd", mutates_args=())
def cp_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_order: Tensor,
    cu_q_head: Tensor,
    cu_k_head: Tensor,
    cu_q_tail: Tensor,
    cu_k_tail: Tensor,
    cu_whole: Tensor,
    sizes: Tensor,
    group_name: str,
    scale: float,
    backend: str,
) -> Tensor:
    """Forward of CP attention on local tensors (index tensors and ``sizes``, a host int64
    tensor: :func:`op_arguments`); q, k and v are checked here, where values are concrete."""
    check_qkv(q, k, v, cp=True)
    size_list = sizes.tolist()
    n_gather = size_list[6]
    k_glob, v_glob = _all_gather_kv(k, v, kv_order, size_list, group_name)
    cus = (cu_q_head, cu_k_head, cu_q_tail, cu_k_tail, cu_whole)
    out = _local_attention(
        q, k_glob, v_glob, k[n_gather:], v[n_gather:], cus, size_list, scale, backend
    )
    return out.contiguous()  # the layout the fake kernel promises, whatever the kernel returns


@cp_attention_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op("torchtitan_wlb::cp_attention_bwd", mutates_args=())
def cp_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_order: Tensor,
    cu_q_head: Tensor,
    cu_k_head: Tensor,
    cu_q_tail: Tensor,
    cu_k_tail: Tensor,
    cu_whole: Tensor,
    sizes: Tensor,
    group_name: str,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`cp_attention_fwd`: K/V re-gathered (memory per layer stays at the
    local size), the local attention recomputed under autograd, the gathered rows' dK/dV
    reduce-scattered back to the ranks that hold them."""
    size_list = sizes.tolist()
    max_gather, n_gather = size_list[5], size_list[6]
    cus = (cu_q_head, cu_k_head, cu_q_tail, cu_k_tail, cu_whole)
    k_glob, v_glob = _all_gather_kv(k, v, kv_order, size_list, group_name)

    def forward(*leaves: Tensor) -> Tensor:
        return _local_attention(*leaves, cus, size_list, scale, backend)

    # A part may be absent on this rank (no whole document, no split piece): zero gradients.
    dq, dk_glob, dv_glob, dk_whole, dv_whole = vjp_by_recompute(
        forward, (q, k_glob, v_glob, k[n_gather:], v[n_gather:]), grad_out.contiguous()
    )
    if max_gather == 0:
        return dq, dk_whole, dv_whole
    world = c10d._get_group_size_by_name(group_name)
    buffer = dk_glob.new_zeros((world * max_gather, 2) + dk_glob.shape[1:])
    buffer.index_copy_(0, kv_order, torch.stack([dk_glob, dv_glob], dim=1))
    mine = _wait(funcol.reduce_scatter_single(buffer, "sum", 0, group_name))
    return dq, torch.cat([mine[:n_gather, 0], dk_whole]), torch.cat([mine[:n_gather, 1], dv_whole])


@cp_attention_bwd.register_fake
def _(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, *args) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[: 4 + _INDEX_TENSORS])  # q, k, v, the index tensors, sizes
    ctx.extra = inputs[4 + _INDEX_TENSORS :]  # group_name, scale, backend


def _backward(ctx, grad_out):
    saved = ctx.saved_tensors
    # DTensor inputs (sharded on the CP mesh) are unwrapped here and their gradients re-wrapped
    # with the inputs' placements: the computation itself is per rank.
    local = [t.to_local() if isinstance(t, DTensor) else t for t in (grad_out, *saved)]
    grads = cp_attention_bwd(*local, *ctx.extra)
    wrapped = tuple(
        DTensor.from_local(
            g, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
        )
        if isinstance(x, DTensor)
        else g
        for g, x in zip(grads, saved[:3], strict=True)
    )
    return wrapped + (None,) * (_INDEX_TENSORS + 4)


cp_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


@register_sharding(torch.ops.torchtitan_wlb.cp_attention_fwd.default)
def _fwd_sharding(*args):
    """Token-sharded q/k/v on the CP mesh dimension in, token-sharded output out; the index
    tensors and sizes travel as replicated (each rank reads its own from the metadata)."""
    return [([Shard(0)], [Shard(0)] * 3 + [Replicate()] * (_INDEX_TENSORS + 1) + [None] * 3)]


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    meta: CPAttentionMetadata,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Document-masked causal attention of this rank's tokens under context parallelism.

    ``q: [local_len, n_heads, head_dim]``, ``k, v: [local_len, n_kv_heads, head_dim]`` in the plan's
    local layout (plain tensors, or DTensors sharded ``Shard(0)`` on a 1-D CP mesh). Returns
    ``[local_len, n_heads, head_dim]``. Differentiable with respect to q, k and v. Traceable by
    ``torch.compile``: what depends on the plan's values is checked inside the op.
    """
    if not torch.compiler.is_compiling():
        local_q, local_k, local_v = (
            t.to_local() if isinstance(t, DTensor) else t for t in (q, k, v)
        )
        check_qkv(local_q, local_k, local_v, cp=True)
        if local_q.shape[0] != meta.local_len:
            raise ValueError(
                f"this rank holds {meta.local_len} tokens in the CP plan, got q with "
                f"{local_q.shape[0]}"
            )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # DTensor q/k/v: the plain index tensors join as replicated
    with implicit_replication() if isinstance(q, DTensor) else contextlib.nullcontext():
        return cp_attention_fwd(
            q, k, v, meta.kv_order, *meta.op_cus, meta.op_sizes, meta.group_name, scale, backend
        )
