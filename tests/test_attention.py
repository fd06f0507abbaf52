"""document_attention (CPU backend) against a naive float64 per-segment reference."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_wlb.attention import (
    DocumentAttentionMetadata,
    attention_from_metadata,
    document_attention,
    metadata_from_doc_lens,
    resolve_backend,
)
from torchtitan_wlb.attention.cpu import bucket_length


def reference_attention(q, k, v, len_q, len_k, scale=None):
    """Per-segment masked softmax in float64, bottom-right causal; rows seeing no key are zero."""
    q, k, v = q.double(), k.double(), v.double()
    n_heads, n_kv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(n_heads // n_kv, dim=1)
    v = v.repeat_interleave(n_heads // n_kv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    outs = []
    sq = sk = 0
    for lq, lk in zip(len_q, len_k, strict=True):
        qs, ks, vs = q[sq : sq + lq], k[sk : sk + lk], v[sk : sk + lk]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        allowed = torch.arange(lk)[None, :] <= (lk - lq + torch.arange(lq))[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
        sq, sk = sq + lq, sk + lk
    return torch.cat(outs) if outs else q.new_zeros((0,) + tuple(q.shape[1:]))


def cu(lengths):
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out


def check_against_reference(len_q, len_k, n_heads=4, n_kv=4, dim=8, seed=0, scale=None):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(len_q), sum(len_k)
    q = torch.randn(tq, n_heads, dim, generator=gen, requires_grad=True)
    k = torch.randn(tk, n_kv, dim, generator=gen, requires_grad=True)
    v = torch.randn(tk, n_kv, dim, generator=gen, requires_grad=True)
    grad_out = torch.randn(tq, n_heads, dim, generator=gen)
    out = document_attention(
        q, k, v, cu(len_q), cu(len_k), max(len_q), max(len_k), scale=scale, backend="cpu"
    )
    (out * grad_out).sum().backward()

    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    v64 = v.detach().double().requires_grad_()
    ref = reference_attention(q64, k64, v64, len_q, len_k, scale)
    (ref * grad_out.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "lengths",
    [[1], [7], [40], [1, 1, 1], [5, 1, 33, 2, 17, 64, 1], [100, 3, 250]],
)
def test_self_attention_matches_reference(lengths):
    check_against_reference(lengths, lengths)


def test_many_random_documents():
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 90, (60,), generator=gen).tolist()
    check_against_reference(lengths, lengths, seed=1)


@pytest.mark.parametrize("n_heads,n_kv", [(4, 2), (6, 1), (8, 4)])
def test_gqa(n_heads, n_kv):
    check_against_reference([9, 1, 30, 4], [9, 1, 30, 4], n_heads=n_heads, n_kv=n_kv)


def test_bottom_right_alignment_fewer_queries():
    # Context-parallel chunks: a few queries against the causal prefix of their document.
    check_against_reference([3, 1, 10, 2], [12, 1, 40, 50], n_heads=4, n_kv=2)


def test_more_queries_than_keys_gives_zero_rows():
    check_against_reference([6, 4], [2, 4])
    q = torch.randn(5, 2, 4)
    k = torch.randn(2, 2, 4)
    out = document_attention(q, k, k.clone(), cu([5]), cu([2]), 5, 2, backend="cpu")
    assert torch.all(out[:3] == 0)
    assert torch.all(out[3:] != 0)


def test_empty_segments_are_skipped():
    # Zero-length query segments (gaps in the key stream) and zero-length key segments.
    check_against_reference([0, 4, 0, 3, 2], [5, 4, 7, 3, 0])


def test_custom_scale():
    check_against_reference([10, 5], [10, 5], scale=0.3)


def test_causality_future_keys_do_not_matter():
    lengths = [6, 9]
    q = torch.randn(15, 2, 4)
    k = torch.randn(15, 2, 4)
    v = torch.randn(15, 2, 4)
    base = document_attention(q, k, v, cu(lengths), cu(lengths), 9, 9, backend="cpu")
    k2, v2 = k.clone(), v.clone()
    k2[10:] += 5.0  # future tokens of document 2 for its rows 0..3
    v2[10:] -= 3.0
    out = document_attention(q, k2, v2, cu(lengths), cu(lengths), 9, 9, backend="cpu")
    torch.testing.assert_close(out[:10], base[:10])
    assert not torch.allclose(out[10:], base[10:])


def test_documents_do_not_leak():
    lengths = [5, 5]
    q, k, v = (torch.randn(10, 2, 4) for _ in range(3))
    base = document_attention(q, k, v, cu(lengths), cu(lengths), 5, 5, backend="cpu")
    v2 = v.clone()
    v2[:5] += 10.0  # change document 1 only
    out = document_attention(q, k, v2, cu(lengths), cu(lengths), 5, 5, backend="cpu")
    torch.testing.assert_close(out[5:], base[5:])


def test_large_batch_splits_into_several_calls(monkeypatch):
    import torchtitan_wlb.attention.cpu as cpu_mod

    monkeypatch.setattr(cpu_mod, "MAX_SCORE_ELEMENTS", 4 * 16 * 16 * 3)
    check_against_reference([10] * 11 + [3], [10] * 11 + [3])


def test_bfloat16_runs_close_to_reference():
    lengths = [17, 3, 40]
    q, k, v = (torch.randn(60, 2, 8) for _ in range(3))
    out = document_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), cu(lengths), cu(lengths), 40, 40, backend="cpu"
    )
    assert out.dtype == torch.bfloat16
    ref = reference_attention(q, k, v, lengths, lengths)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_bucket_length_grid():
    lengths = torch.tensor([1, 16, 17, 20, 21, 100, 1000, 4097])
    padded = bucket_length(lengths)
    assert torch.all(padded >= lengths)
    assert torch.all(padded >= 16)
    assert torch.all(padded[lengths >= 16] <= (lengths[lengths >= 16] * 1.25).ceil())


def test_metadata_path_matches_direct_call():
    lengths = [4, 11, 1]
    meta = metadata_from_doc_lens(lengths, backend="cpu")
    assert isinstance(meta, DocumentAttentionMetadata)
    assert meta.max_seqlen == 11 and meta.cu_seqlens.dtype == torch.int32
    q, k, v = (torch.randn(16, 2, 4) for _ in range(3))
    direct = document_attention(q, k, v, cu(lengths), cu(lengths), 11, 11, backend="cpu")
    torch.testing.assert_close(attention_from_metadata(q, k, v, meta), direct)


def test_auto_backend_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"q": torch.randn(4, 2)}, "tokens, heads, head_dim"),
        ({"k": torch.randn(4, 3, 4), "v": torch.randn(4, 3, 4)}, "multiple of n_kv_heads"),
        ({"v": torch.randn(3, 2, 4)}, "share"),
        ({"cu_q": torch.tensor([0, 5], dtype=torch.int32)}, "end at 4"),
        ({"cu_k": torch.tensor([0, 3, 2, 4], dtype=torch.int32)}, "same length"),
        ({"backend": "triton"}, "not one of"),
        ({"backend": "flash"}, "needs CUDA"),
    ],
)
def test_bad_inputs(kwargs, match):
    args = {
        "q": torch.randn(4, 4, 4),
        "k": torch.randn(4, 2, 4),
        "v": torch.randn(4, 2, 4),
        "cu_q": torch.tensor([0, 4], dtype=torch.int32),
        "cu_k": torch.tensor([0, 4], dtype=torch.int32),
        "backend": "cpu",
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        document_attention(
            args["q"],
            args["k"],
            args["v"],
            args["cu_q"],
            args["cu_k"],
            4,
            4,
            backend=args["backend"],
        )


def test_non_monotonic_cu_seqlens():
    q = torch.randn(4, 2, 4)
    bad = torch.tensor([0, 3, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
        document_attention(q, q, q, bad, bad, 4, 4, backend="cpu")


@pytest.mark.parametrize("block", [4, 7])
def test_query_blocking_matches_reference(monkeypatch, block):
    import torchtitan_wlb.attention.cpu as cpu_mod

    monkeypatch.setattr(cpu_mod, "QUERY_BLOCK", block)
    check_against_reference([30, 1, 9, 17], [30, 1, 9, 17], n_heads=4, n_kv=2)
    check_against_reference([13, 2, 10, 8], [40, 2, 10, 3])  # fewer queries and more queries


def test_segment_longer_than_default_block():
    check_against_reference([600, 5], [600, 5], n_heads=2, n_kv=1)


def _emulated_kernel_inputs():
    lengths_q, lengths_k = [3, 5, 1], [7, 5, 4]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(9, 4, 8, generator=gen)
    k = torch.randn(16, 2, 8, generator=gen)
    v = torch.randn(16, 2, 8, generator=gen)
    return q, k, v, cu(lengths_q), cu(lengths_k)


def test_flash_adapter_maps_arguments(monkeypatch):
    """No GPU here: check the flash-attn call against a CPU emulation of its documented API."""
    import torchtitan_wlb.attention.cuda as cuda_mod
    from torchtitan_wlb.attention.cpu import cpu_document_attention

    def fake_flash_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False
    ):
        assert causal and dropout_p == 0.0
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        assert (max_q, max_k) == (5, 7)
        return cpu_document_attention(q, k, v, cu_q, cu_k, softmax_scale)

    monkeypatch.setattr(cuda_mod, "_flash_fn", lambda: fake_flash_varlen)
    q, k, v, cu_q, cu_k = _emulated_kernel_inputs()
    out = cuda_mod.cuda_attention("flash", q, k, v, cu_q, cu_k, 5, 7, 0.25)
    want = document_attention(q, k, v, cu_q, cu_k, 5, 7, scale=0.25, backend="cpu")
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("new_api", [True, False])
def test_torch_varlen_adapter_maps_arguments(monkeypatch, new_api):
    """torch 2.13's varlen_attn (window_size, enable_gqa) and the older one (is_causal, no GQA)."""
    import torchtitan_wlb.attention.cuda as cuda_mod
    from torchtitan_wlb.attention.cpu import cpu_document_attention

    def new(
        q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        assert tuple(window_size) == (-1, 0) and enable_gqa
        return cpu_document_attention(q, k, v, cu_q, cu_k, scale)

    def old(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None):
        assert is_causal and q.shape[1] == k.shape[1]  # KV heads were repeated for GQA
        return cpu_document_attention(q, k, v, cu_q, cu_k, scale)

    monkeypatch.setattr(cuda_mod, "_torch_varlen_fn", lambda: new if new_api else old)
    cuda_mod._varlen_params.cache_clear()
    try:
        q, k, v, cu_q, cu_k = _emulated_kernel_inputs()
        out = cuda_mod.cuda_attention("torch_varlen", q, k, v, cu_q, cu_k, 5, 7, 0.25)
    finally:
        cuda_mod._varlen_params.cache_clear()
    want = document_attention(q, k, v, cu_q, cu_k, 5, 7, scale=0.25, backend="cpu")
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("backend", ["cpu", "flash", "torch_varlen"])
def test_attention_ops_pass_opcheck(monkeypatch, backend):
    """The custom ops torch.compile sees (schema, fake kernels, autograd registration, AOT
    dispatch with dynamic shapes), forward and backward; "flash" and "torch_varlen" through CPU
    stand-ins of their kernels (tests/varlen_kernels.py; tests/test_gpu.py runs the real ones)."""
    import varlen_kernels

    from torchtitan_wlb.attention.ops import (
        document_attention_backward,
        document_attention_op,
        max_seqlens_tensor,
    )

    if backend != "cpu":
        varlen_kernels.install(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    lens = [5, 1, 9, 3]
    q = torch.randn(18, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(18, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    index = (cu(lens), cu(lens), max_seqlens_tensor(9, 9), 8**-0.5, backend)
    # The stand-ins differ from "cpu" only in the kernel the ops run: their real outputs against
    # the fake kernels'; the rest of opcheck is the same for every backend.
    utils = {} if backend == "cpu" else {"test_utils": ("test_schema", "test_faketensor")}
    torch.library.opcheck(document_attention_op, (q, k, v, *index), **utils)
    plain = tuple(t.detach() for t in (torch.randn_like(q), q, k, v))
    torch.library.opcheck(document_attention_backward, (*plain, *index), **utils)
