"""Document attention as ``torch.library`` custom ops: the form ``torch.compile`` sees it in.

Every backend's kernel (the bucketed CPU implementation, flash-attn, torch's varlen attention) reads
document boundaries from ``cu_seqlens`` values, which a tracer cannot follow (the CPU backend even
groups documents by their lengths). As custom ops with fake kernels they are opaque nodes of the
compiled graph whose output shapes follow from q's and v's shapes alone: the packed length and the
number of documents stay symbolic, and no value of the metadata becomes a guard. The few integers
the kernels need (longest documents) travel as a host tensor for the same reason.

The backward op recomputes the forward under autograd and differentiates it: one extra attention
forward per backward, for any backend, and nothing kept from the forward but its inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from torchtitan_wlb.attention.varlen import document_attention

_AUTOGRAD_KEYS = (
    torch._C.DispatchKey.AutogradFunctionality,
    torch._C.DispatchKey.AutogradOther,
    torch._C.DispatchKey.AutogradNestedTensor,
    torch._C.DispatchKey.ADInplaceOrView,
)


@contextlib.contextmanager
def autograd_in_op_body() -> Iterator[None]:
    """Autograd enabled inside a custom op's body. The dispatcher runs an op's kernel with the
    autograd keys excluded (the op's registered formula is its gradient), which would leave the
    recomputed forward of a backward op without a graph; this lifts that exclusion for the block."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    include = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def vjp_by_recompute(fn, inputs: tuple[Tensor, ...], grad_out: Tensor) -> tuple[Tensor, ...]:
    """Gradients of ``fn(*inputs)`` against ``grad_out`` by running ``fn`` again under autograd
    (zeros for an input the output does not depend on)."""
    with autograd_in_op_body():
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        grads = torch.autograd.grad(
            out, leaves, grad_out, allow_unused=True, materialize_grads=True
        )
    return tuple(g.contiguous() for g in grads)  # the layout the fake kernels promise


def max_seqlens_tensor(max_seqlen_q: int, max_seqlen_k: int) -> Tensor:
    """The longest query and key documents as the host tensor the ops take."""
    return torch.tensor([max_seqlen_q, max_seqlen_k], dtype=torch.int64)


@torch.library.custom_op("torchtitan_wlb::document_attention", mutates_args=())
def document_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlens: Tensor,
    scale: float,
    backend: str,
) -> Tensor:
    """:func:`~torchtitan_wlb.attention.varlen.document_attention` (``max_seqlens``: the host
    tensor of :func:`max_seqlens_tensor`); arguments are checked here, where values are concrete."""
    max_q, max_k = max_seqlens.tolist()
    out = document_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale=scale, backend=backend
    )
    return out.contiguous()  # the layout the fake kernel promises, whatever the kernel returns


@document_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op("torchtitan_wlb::document_attention_backward", mutates_args=())
def document_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlens: Tensor,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`document_attention_op` for ``grad_out``."""
    max_q, max_k = max_seqlens.tolist()

    def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return document_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale=scale, backend=backend
        )

    dq, dk, dv = vjp_by_recompute(forward, (q, k, v), grad_out.contiguous())
    return dq, dk, dv


@document_attention_backward.register_fake
def _(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, *args) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:6])
    ctx.scale, ctx.backend = inputs[6:]


def _backward(ctx, grad_out: Tensor):
    dq, dk, dv = document_attention_backward(grad_out, *ctx.saved_tensors, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None, None, None


document_attention_op.register_autograd(_backward, setup_context=_setup_context)
