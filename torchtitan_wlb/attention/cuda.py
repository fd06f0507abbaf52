"""CUDA varlen backends: flash-attn's ``flash_attn_varlen_func`` and ``torch.nn.attention.varlen``,
both :func:`document_attention`'s semantics natively. Imports are guarded (and probed once) so that
this module loads on CPU-only installs.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor


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


@functools.cache
def _varlen_params() -> frozenset[str]:
    return frozenset(inspect.signature(_torch_varlen_fn()).parameters)


_NEEDS = {
    "flash": "the flash-attn package (pip install flash-attn)",
    "torch_varlen": "torch >= 2.9 (torch.nn.attention.varlen)",
}


def _kernel(backend: str):
    return _flash_fn() if backend == "flash" else _torch_varlen_fn()


def cuda_available(backend: str) -> bool:
    """``backend``'s kernel is importable and a CUDA device exists (neither has a CPU kernel)."""
    return torch.cuda.is_available() and _kernel(backend) is not None


def cuda_attention(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> Tensor:
    """``backend`` ``"flash"`` or ``"torch_varlen"`` on :func:`document_attention`'s arguments.
    torch 2.13's ``varlen_attn`` takes ``window_size=(-1, 0)`` and ``enable_gqa``; 2.9-2.11's
    took ``is_causal`` and had no GQA flag (KV heads are repeated there)."""
    fn = _kernel(backend)
    if fn is None:
        raise ValueError(f"backend={backend!r} needs {_NEEDS[backend]}")
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    if backend == "flash":
        return fn(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=True
        )
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
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
