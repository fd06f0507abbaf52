"""CPU stand-ins for the CUDA varlen kernels, written from their documented contracts.

No GPU here: these let the flash-attn and torch-varlen code paths (argument mapping, causal
alignment, GQA, gradients) run on CPU tensors. Each one checks its inputs as the documented API
requires and computes with a dense masked softmax over the whole packed tensors, independent of the
package's own CPU backend:

- ``flash_attn_varlen_func`` (flash-attn >= 2.1): packed ``[tokens, heads, dim]``, int32
  ``cu_seqlens_q/k``, ``max_seqlen_q/k`` at least the longest segment, ``causal=True`` aligned to the
  bottom-right corner when a segment has fewer queries than keys, native GQA (query head ``h`` reads
  KV head ``h // (Hq / Hkv)``), ``softmax_scale``; a query row that sees no key returns zeros.
- torch 2.13's ``torch.nn.attention.varlen.varlen_attn``: the same layout, causal as
  ``window_size=(-1, 0)`` (the flash kernel's window, bottom-right), ``scale``, and GQA only with
  ``enable_gqa=True``.

``calls`` counts the stand-in calls, so a test can tell that they (not the CPU backend) ran.
"""

from __future__ import annotations

import torch

calls = {"flash": 0, "torch_varlen": 0}


def _check(q, k, v, cu_q, cu_k, max_q, max_k, gqa_allowed: bool) -> None:
    assert q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape, (q.shape, k.shape)
    assert q.dtype == k.dtype == v.dtype and q.device == k.device == v.device == cu_q.device
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "last dim must be contiguous"
    assert q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape)
    assert gqa_allowed or q.shape[1] == k.shape[1], "fewer KV heads need enable_gqa=True"
    for cu, total, longest in ((cu_q, q.shape[0], max_q), (cu_k, k.shape[0], max_k)):
        assert cu.dtype == torch.int32 and cu.dim() == 1, (cu.dtype, cu.shape)
        assert int(cu[0]) == 0 and int(cu[-1]) == total, (cu.tolist(), total)
        lens = cu[1:] - cu[:-1]
        assert bool((lens >= 0).all()), cu.tolist()
        assert isinstance(longest, int) and longest >= int(lens.max()), (longest, lens.tolist())
    assert cu_q.numel() == cu_k.numel(), (cu_q.numel(), cu_k.numel())


def _dense(q, k, v, cu_q, cu_k, scale: float) -> torch.Tensor:
    """Masked softmax over all (query, key) pairs: a pair is allowed if both are in segment ``i``
    and the key's offset is <= ``l_k - l_q`` + the query's offset (bottom-right causal)."""
    n_seg = cu_q.numel() - 1
    seg_q = torch.repeat_interleave(torch.arange(n_seg), (cu_q[1:] - cu_q[:-1]).long())
    seg_k = torch.repeat_interleave(torch.arange(n_seg), (cu_k[1:] - cu_k[:-1]).long())
    off_q = torch.arange(q.shape[0]) - cu_q.long()[seg_q]
    off_k = torch.arange(k.shape[0]) - cu_k.long()[seg_k]
    shift = (cu_k[1:] - cu_k[:-1] - cu_q[1:] + cu_q[:-1]).long()[seg_q]  # l_k - l_q per query
    allowed = (seg_q[:, None] == seg_k[None, :]) & (off_k[None, :] <= (off_q + shift)[:, None])
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    probs = probs.masked_fill(~allowed.any(-1)[:, None], 0.0)  # rows with no key: zeros
    return torch.einsum("hqk,khd->qhd", probs, vv)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
):
    """flash-attn's ``flash_attn_varlen_func`` (only what training with causal masking uses)."""
    calls["flash"] += 1
    assert causal and dropout_p == 0.0 and tuple(window_size) == (-1, -1)
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, gqa_allowed=True)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return _dense(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)


def varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
):
    """torch 2.13's ``varlen_attn`` (causal through ``window_size=(-1, 0)``)."""
    calls["torch_varlen"] += 1
    assert return_aux is None and tuple(window_size) == (-1, 0), window_size
    _check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, gqa_allowed=enable_gqa)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _dense(query, key, value, cu_seq_q, cu_seq_k, scale)


def install(monkeypatch) -> None:
    """Put the stand-ins in place of the CUDA kernels and let ``"flash"`` / ``"torch_varlen"``
    resolve on CPU tensors (the production device check itself is left as it is: it is asked
    about a CUDA device instead)."""
    import torchtitan_wlb.attention.cuda as cuda_mod
    import torchtitan_wlb.attention.varlen as varlen_mod

    real = varlen_mod.resolve_backend

    def resolve_on_cpu(backend: str, device: torch.device) -> str:
        if backend in ("flash", "torch_varlen") and device.type == "cpu":
            return real(backend, torch.device("cuda"))
        return real(backend, device)

    monkeypatch.setattr(cuda_mod, "_flash_fn", lambda: flash_attn_varlen_func)
    monkeypatch.setattr(cuda_mod, "_torch_varlen_fn", lambda: varlen_attn)
    cuda_mod._varlen_params.cache_clear()
    monkeypatch.setattr(varlen_mod, "resolve_backend", resolve_on_cpu)
