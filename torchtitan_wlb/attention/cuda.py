"""CUDA varlen backends: flash-attn's ``flash_attn_varlen_func`` and ``torch.nn.attention.varlen``.

Both kernels implement exactly the semantics of :func:`document_attention`: packed ``[tokens, heads,
dim]`` inputs, ``int32`` cumulative sequence lengths, causal masking aligned to the bottom-right corner
when a segment has fewer queries than keys (flash-attn >= 2.1 convention), native GQA. Imports are
guarded so this module loads on CPU-only installs; availability is probed once.
"""

from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["flash_available", "torch_varlen_available", "flash_attention", "torch_varlen_attention"]


@functools.cache
def _flash_fn():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # flash-attn is an optional CUDA extra
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    return varlen_attn


def flash_available() -> bool:
    """flash-attn is importable and a CUDA device exists."""
    return torch.cuda.is_available() and _flash_fn() is not None


def torch_varlen_available() -> bool:
    """``torch.nn.attention.varlen`` exists and a CUDA device exists (it has no CPU kernel)."""
    return torch.cuda.is_available() and _torch_varlen_fn() is not None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
) -> torch.Tensor:
    """flash-attn varlen, causal (bottom-right); GQA is native (fewer KV heads accepted)."""
    fn = _flash_fn()
    if fn is None:
        raise ValueError("backend='flash' needs the flash-attn package (pip install flash-attn)")
    return fn(
        q,
        k,
        v,
        cu_seqlens_q.to(device=q.device, dtype=torch.int32),
        cu_seqlens_k.to(device=q.device, dtype=torch.int32),
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=True,
    )


def torch_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn``; adapts to the keyword set of the installed torch.

    torch 2.13 expresses causality as ``window_size=(-1, 0)`` and GQA as ``enable_gqa``; earlier
    releases (2.9-2.11) had ``is_causal`` and no GQA flag, in which case KV heads are repeated.
    """
    fn = _torch_varlen_fn()
    if fn is None:
        raise ValueError("backend='torch_varlen' needs torch >= 2.9 (torch.nn.attention.varlen)")
    params = _varlen_params()
    kwargs: dict = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
    return fn(
        q,
        k,
        v,
        cu_seqlens_q.to(device=q.device, dtype=torch.int32),
        cu_seqlens_k.to(device=q.device, dtype=torch.int32),
        max_seqlen_q,
        max_seqlen_k,
        **kwargs,
    )


@functools.cache
def _varlen_params() -> frozenset[str]:
    return frozenset(inspect.signature(_torch_varlen_fn()).parameters)
