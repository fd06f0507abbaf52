"""Correctness of the CUDA attention paths, to run on a machine with a GPU before trusting them.

CI has no GPU, so the CUDA kernels (torch's ``varlen_attn``, flash-attn) are otherwise only ever run
as CPU stand-ins (tests/varlen_kernels.py). This module checks the real ones:

1. :func:`document_attention` per backend, forward and backward, against a float64 dense reference
   written here: GQA, 1-token documents, one document filling the micro-batch, and bottom-right
   aligned segments with fewer queries than keys beside zero-query "key gap" segments (as the CP
   op passes them).
2. The CP op's per-rank local attention (``cp.op._local_attention``) at CP = 4 for every strategy:
   each rank's problem in turn on the one device, the all-gather emulated by indexing, scattered
   back to packed order and compared, values and gradients, with single-device attention.

Every test runs for device "cpu" too (backend "cpu", float32/float64), so the harness runs in CI;
the CUDA cases are skipped where the backend's kernel or a GPU is missing. On a GPU machine::

    python3 -m pytest tests/test_gpu.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor

from torchtitan_wlb.attention import document_attention
from torchtitan_wlb.attention.cuda import cuda_available
from torchtitan_wlb.cp import build_cp_plan
from torchtitan_wlb.cp.op import _local_attention, op_arguments
from torchtitan_wlb.cp.plan import CPPlan

# ||got - ref|| / ||ref|| allowed per dtype. bf16 keeps 8 significant bits (unit roundoff 2**-9,
# ~2e-3) and the kernels round the probabilities, dS and their outputs to it: a correct bf16
# attention lands at 2e-3 (output) to 5e-3 (dK, dV) from float64 (torch's CPU bf16 SDPA on these
# cases). 1e-2 leaves twice that, while a wrong mask, alignment or gather order moves whole rows:
# errors of 0.1 to 1. float32/float64 compute the same sums in another order.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}
# CP against single-device: in bf16 each rank's dK/dV of the gathered keys is rounded to bf16 and
# the ranks' parts are summed in bf16 (as the op's reduce-scatter does), about as much rounding
# again as the kernel's own (5e-3 CP vs single-device measured with the CPU backend in bf16).
CP_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
REFERENCE_CHUNK = 1 << 26  # score elements per float64 reference step (bounds its memory)


def _needs(backend: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not cuda_available(backend), reason=f"needs CUDA and the {backend!r} kernel"
    )


# (device, backend, dtype): the CPU cases run the same harness everywhere.
BACKEND_CASES = [
    pytest.param("cpu", "cpu", torch.float32, id="cpu-float32"),
    pytest.param("cpu", "cpu", torch.float64, id="cpu-float64"),
    pytest.param("cuda", "torch_varlen", torch.bfloat16, id="cuda-torch_varlen-bf16",
                 marks=_needs("torch_varlen")),
    pytest.param("cuda", "flash", torch.bfloat16, id="cuda-flash-bf16", marks=_needs("flash")),
]  # fmt: skip

# name -> device -> (query lengths per segment, key lengths (None: the same), heads, KV heads,
# head_dim). Small on CPU (fast in CI), large on CUDA.
ATTENTION_CASES: dict[str, dict[str, tuple]] = {
    "mixed_with_1_token_docs": {
        "cpu": ([1, 37, 1, 1, 120, 5, 1, 90, 1, 3], None, 4, 2, 16),
        "cuda": ([1, 700, 1, 1, 1500, 33, 1, 900, 1, 57], None, 8, 2, 64),
    },
    "one_document": {"cpu": ([256], None, 4, 2, 16), "cuda": ([4096], None, 8, 2, 64)},
    # CP halves: q_len < kv_len aligned bottom-right; zero-query segments over keys (key gaps) and
    # an empty (0, 0) segment, as cp.plan.local_attention_spec emits them.
    "bottom_right_key_gaps": {
        "cpu": ([0, 3, 0, 1, 10, 0, 2, 0], [7, 12, 0, 1, 40, 5, 50, 9], 4, 2, 16),
        "cuda": ([0, 300, 0, 1, 900, 0, 127, 0], [700, 1200, 0, 1, 2500, 129, 900, 64], 8, 2, 64),
    },
    "llama_7b_heads": {  # on CUDA: 8192 tokens, 32 heads / 8 KV heads, head_dim 128
        "cpu": ([1, 300, 1, 120, 90], None, 8, 2, 32),
        "cuda": ([1, 5000, 1, 2000, 1190], None, 32, 8, 128),
    },
}


def _cu(lengths, device: str) -> Tensor:
    """int32 cu_seqlens of ``lengths`` on ``device``."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int64), 0)
    return cu.to(device)


def _inputs(n_q: int, n_k: int, n_heads: int, n_kv: int, dim: int, device: str, dtype, seed: int):
    """Random leaf q, k, v (requiring grad) and an upstream gradient, drawn on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = ((n_q, n_heads), (n_k, n_kv), (n_k, n_kv), (n_q, n_heads))
    q, k, v, grad_out = (
        torch.randn(n, h, dim, generator=gen, device=device).to(dtype) for n, h in shapes
    )
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


def _reference(
    q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, len_q, len_k, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Output and dq, dk, dv of bottom-right causal attention in float64 on q's device: per segment
    (query ``j`` of ``lq`` sees keys ``0 .. lk - lq + j``) and per group of KV heads, a dense
    masked softmax differentiated by autograd. Independent of every backend under test."""
    q, k, v, grad_out = (t.detach().double() for t in (q, k, v, grad_out))
    out, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    rep, n_kv = q.shape[1] // k.shape[1], k.shape[1]
    sq = sk = 0
    for lq, lk in zip(len_q, len_k, strict=True):
        assert lq <= lk or lq == 0, "the reference covers segments whose queries all see a key"
        rows = torch.arange(lk, device=q.device)[None, :]
        allowed = rows <= (lk - lq + torch.arange(lq, device=q.device))[:, None]  # [lq, lk]
        step = max(1, REFERENCE_CHUNK // max(1, rep * lq * lk))
        for h in range(0, n_kv if lq else 0, step):
            hq, hk = slice(h * rep, (h + step) * rep), slice(h, h + step)
            qs = q[sq : sq + lq, hq].clone().requires_grad_()
            ks = k[sk : sk + lk, hk].clone().requires_grad_()
            vs = v[sk : sk + lk, hk].clone().requires_grad_()
            scores = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(rep, 1)) * scale
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            o = torch.einsum("hqk,khd->qhd", probs, vs.repeat_interleave(rep, 1))
            grads = torch.autograd.grad(o, (qs, ks, vs), grad_out[sq : sq + lq, hq])
            out[sq : sq + lq, hq] = o.detach()
            dq[sq : sq + lq, hq], dk[sk : sk + lk, hk], dv[sk : sk + lk, hk] = grads
        sq, sk = sq + lq, sk + lk
    return out, dq, dk, dv


def _check_close(names, got, want, tolerance: float) -> None:
    """Every ``got`` finite and within ``tolerance`` of ``want`` (relative, in norm)."""
    for name, g, w in zip(names, got, want, strict=True):
        g, w = g.detach(), w.detach()
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert bool(torch.isfinite(g).all()), f"{name}: non-finite values"
        diff = torch.linalg.vector_norm(g.double() - w.double())
        err = float(diff / torch.linalg.vector_norm(w.double()))
        assert err <= tolerance, f"{name}: relative error {err:.3e} > {tolerance}"


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
@pytest.mark.parametrize("device, backend, dtype", BACKEND_CASES)
def test_document_attention_matches_reference(device: str, backend: str, dtype, case: str):
    len_q, len_k, n_heads, n_kv, dim = ATTENTION_CASES[case][device]
    len_k = len_q if len_k is None else len_k
    q, k, v, grad_out = _inputs(sum(len_q), sum(len_k), n_heads, n_kv, dim, device, dtype, 1)
    out = document_attention(
        q, k, v, _cu(len_q, device), _cu(len_k, device), max(len_q), max(len_k), backend=backend
    )
    assert out.dtype == dtype and out.device == q.device
    got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    want = _reference(q, k, v, grad_out, len_q, len_k, 1.0 / math.sqrt(dim))
    _check_close(("out", "dq", "dk", "dv"), got, want, TOLERANCE[dtype])


def _cp_ranks_in_turn(
    plan: CPPlan, q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str
) -> Tensor:
    """The CP op's forward on every rank of ``plan`` in turn on q's device, in packed order.

    The GPU machine has one GPU, so the all-gather of ``cp.op._all_gather_kv`` is emulated by
    indexing the global tensors: rank ``r``'s local rows are ``plan.token_indices(r)``; the gather
    buffer holds every rank's first ``n_gather_tokens`` local rows from row ``r * max_gather_len``
    (the padding NaN: a correct ``kv_order`` never reads it), and ``index_select(kv_order)`` puts
    it in key order. All of it is differentiable indexing, so autograd sums the ranks' dK/dV as the
    op's reduce-scatter does, and a wrong gather order or half split changes the result."""
    device, cp, rows_per_rank = q.device, plan.cp_degree, plan.max_gather_len
    local = [torch.from_numpy(plan.token_indices(r)).to(device) for r in range(cp)]
    buffer_rows = torch.full((cp * rows_per_rank,), plan.seq_len, dtype=torch.int64, device=device)
    for r, rows in enumerate(local):
        n_gather = int(plan.gather_lens[r])
        buffer_rows[r * rows_per_rank : r * rows_per_rank + n_gather] = rows[:n_gather]
    kv_order = torch.from_numpy(plan.kv_order()).to(device)
    pad = torch.full((1, *k.shape[1:]), float("nan"), dtype=k.dtype, device=device)
    k_glob, v_glob = (
        torch.cat([t, pad]).index_select(0, buffer_rows).index_select(0, kv_order) for t in (k, v)
    )
    outs = []
    for r, rows in enumerate(local):
        spec = plan.local_attention_spec(r)
        n_gather = spec.n_gather_tokens
        cus, sizes = op_arguments(spec, rows_per_rank)
        cus = tuple(torch.from_numpy(cu).to(device) for cu in cus)
        q_r, k_r, v_r = (t.index_select(0, rows) for t in (q, k, v))
        outs.append(
            _local_attention(
                q_r, k_glob, v_glob, k_r[n_gather:], v_r[n_gather:], cus, sizes, scale, backend
            )
        )
    return torch.cat(outs).index_select(0, torch.argsort(torch.cat(local)))


CP = 4
CP_DEVICES = [
    pytest.param("cpu", "cpu", torch.float32, id="cpu-float32"),
    pytest.param("cuda", "torch_varlen", torch.bfloat16, id="cuda-torch_varlen-bf16",
                 marks=_needs("torch_varlen")),
]  # fmt: skip
# device -> (tokens, heads, KV heads, head_dim, hybrid's whole-document threshold: on CPU below
# the automatic floor of 2 * CP * 128, so that short documents stay whole and long ones split)
CP_SHAPES = {"cpu": (512, 4, 2, 16, 48), "cuda": (8192, 32, 8, 128, 0)}


def _micro_batch(name: str, total: int) -> np.ndarray:
    """Document lengths summing to ``total``: one document, or (seeded) one longer than half the
    sequence, three 1-token ones and 6 to 11 of random lengths, shuffled."""
    if name == "one_document":
        return np.array([total])
    rng = np.random.default_rng({"mixed_a": 0, "mixed_b": 1}[name])
    long = total // 2 + 1 + int(rng.integers(0, total // 8))
    rest = total - long - 3
    cuts = np.sort(rng.choice(np.arange(1, rest), size=5 + int(rng.integers(0, 6)), replace=False))
    pieces = np.diff(np.concatenate(([0], cuts, [rest])))
    return rng.permutation(np.concatenate(([long, 1, 1, 1], pieces)))


@pytest.mark.parametrize("batch", ["mixed_a", "mixed_b", "one_document"])
@pytest.mark.parametrize("strategy", ["per_sequence", "per_document", "hybrid", "adaptive"])
@pytest.mark.parametrize("device, backend, dtype", CP_DEVICES)
def test_cp_ranks_match_single_device(device: str, backend: str, dtype, strategy: str, batch: str):
    total, n_heads, n_kv, dim, hybrid_max_len = CP_SHAPES[device]
    doc_lens = _micro_batch(batch, total)
    assert doc_lens.sum() == total and total % (2 * CP) == 0
    plan = build_cp_plan(doc_lens, CP, strategy, hybrid_max_len=hybrid_max_len)
    order = np.sort(np.concatenate([plan.token_indices(r) for r in range(CP)]))
    assert np.array_equal(order, np.arange(total)), "the ranks' tokens must partition the batch"
    if strategy == "hybrid" and batch != "one_document":  # both whole and split documents
        assert 0 < plan.gathered_len < total, plan.gathered_len

    q, k, v, grad_out = _inputs(total, total, n_heads, n_kv, dim, device, dtype, 2)
    scale = 1.0 / math.sqrt(dim)
    out = _cp_ranks_in_turn(plan, q, k, v, scale, backend)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    cu = _cu(doc_lens.tolist(), device)
    single = document_attention(
        q, k, v, cu, cu, int(doc_lens.max()), int(doc_lens.max()), scale=scale, backend=backend
    )
    want = (single, *torch.autograd.grad(single, (q, k, v), grad_out))
    _check_close(("out", "dq", "dk", "dv"), got, want, CP_TOLERANCE[dtype])
