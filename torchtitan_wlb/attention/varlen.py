"""``document_attention``: one entry point for document-masked causal attention on packed tokens.

Every backend takes the flash-attn varlen layout (``[tokens, heads, dim]`` plus ``cu_seqlens``), so
the model and the context-parallel op do not care which kernel runs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchtitan_wlb.attention.cpu import cpu_document_attention
from torchtitan_wlb.attention.cuda import cuda_attention, cuda_available

BACKENDS = ("auto", "cpu", "flash", "torch_varlen")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``"auto"`` to a concrete backend for ``device`` (flash-attn on CUDA, then torch's varlen
    kernel, else the bucketed CPU implementation, which runs anywhere); check explicit choices."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    is_cuda = device.type == "cuda"
    if backend == "auto":
        return next((b for b in ("flash", "torch_varlen") if is_cuda and cuda_available(b)), "cpu")
    if backend in ("flash", "torch_varlen") and not is_cuda:
        raise ValueError(f"attention backend {backend!r} needs CUDA tensors, got device {device}")
    return backend


def document_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Causal attention of segment ``i`` of q ``[total_q, n_heads, head_dim]`` to segment ``i`` of
    k, v ``[total_k, n_kv_heads, head_dim]`` (flash-attn's varlen layout, GQA; int32 ``cu_seqlens``
    from 0 to the totals), aligned bottom-right: query ``j`` of ``l_q`` sees keys
    ``0 .. l_k - l_q + j`` (none: zeros). Returns q's shape; ``scale``: ``1/sqrt(head_dim)``."""
    check_qkv(q, k, v)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    chosen = resolve_backend(backend, q.device)
    if chosen == "cpu":
        return cpu_document_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    return cuda_attention(
        chosen, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale
    )


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp: bool = False) -> None:
    """``[tokens, heads, head_dim]`` q, k, v with GQA-compatible heads; ``cp``: a CP rank's local
    tensors, where q, k, v are the same tokens and k, v share one all-gather buffer."""
    shapes = f"q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got shapes {shapes}")
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"k and v must share [tokens, kv_heads] and q/k the head_dim; {shapes}")
    if cp and (k.shape != v.shape or q.shape[0] != k.shape[0]):
        raise ValueError(f"under CP, k and v must be equal and q the same tokens; {shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"n_heads={q.shape[1]} must be a multiple of n_kv_heads={k.shape[1]} (GQA)"
        )


def _check_cu_seqlens(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int) -> None:
    """Shapes always; values only for host tensors (no device sync)."""
    if cu_q.dim() != 1 or cu_k.dim() != 1 or cu_q.numel() != cu_k.numel() or cu_q.numel() < 1:
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must be 1-D with the same length >= 1; got shapes "
            f"{tuple(cu_q.shape)} and {tuple(cu_k.shape)}"
        )
    if cu_q.device.type != "cpu" or cu_k.device.type != "cpu":
        return
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        if int(cu[0]) != 0 or int(cu[-1]) != total:
            raise ValueError(
                f"{name} must start at 0 and end at {total} (the token count); "
                f"got {int(cu[0])} .. {int(cu[-1])}"
            )
        if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"{name} must be non-decreasing; got {cu.tolist()[:16]}...")
