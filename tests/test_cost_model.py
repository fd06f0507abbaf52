"""CostModel against FLOPs counted by hand, matmul by matmul."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from torchtitan_wlb.cost_fit import profile_cost_model
from torchtitan_wlb.cost_model import CostModel


def hand_flops(d, *, dim, n_layers, n_heads, n_kv_heads, ffn, vocab, tp=1, cp=1):
    """Training FLOPs of one document of d tokens on one GPU, counted matmul by matmul.

    A matmul [m, k] x [k, n] costs 2*m*k*n; backward costs twice the forward.
    """
    head_dim = dim // n_heads
    heads = n_heads // tp
    kv_heads = n_kv_heads // min(tp, n_kv_heads)
    fwd = 0
    for _ in range(n_layers):
        fwd += 2 * d * dim * (heads * head_dim)  # wq
        fwd += 2 * 2 * d * dim * (kv_heads * head_dim)  # wk, wv
        fwd += 2 * d * (heads * head_dim) * dim  # wo
        fwd += 3 * 2 * d * dim * (ffn // tp)  # w1, w3, w2
        pairs = sum(q + 1 for q in range(d))  # causal (query, key) pairs
        fwd += heads * pairs * (2 * head_dim + 2 * head_dim)  # QK^T and PV
    fwd += 2 * d * dim * (vocab // tp)  # output projection
    return 3 * fwd / cp


DIMS = dict(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden_dim=16, vocab_size=10)


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 1), (1, 4), (2, 2)])
@pytest.mark.parametrize("d", [1, 5, 37])
def test_from_model_dims_matches_hand_count(d, tp, cp):
    cm = CostModel.from_model_dims(**DIMS, tp=tp, cp=cp)
    expected = hand_flops(
        d, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn=16, vocab=10, tp=tp, cp=cp
    )
    assert cm.doc_cost(np.array([d]))[0] == pytest.approx(expected, rel=1e-12)
    assert cm.unit == "flops"


def test_coefficients_by_hand():
    # Per layer forward and token: wq+wo 256, wk+wv 128, FFN 768, attention diagonal 16.
    cm = CostModel.from_model_dims(**DIMS)
    assert cm.linear_coef == 3 * (2 * (256 + 128 + 768 + 16) + 2 * 8 * 10)
    assert cm.attn_coef == 3 * 2 * (2 * 8)
    assert cm.break_even_length == pytest.approx(cm.linear_coef / cm.attn_coef)


def test_seven_b_break_even_is_tens_of_k():
    cm = CostModel.from_model_dims(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=11008, vocab_size=128256
    )
    assert 40_000 < cm.break_even_length < 70_000
    sharded = CostModel.from_model_dims(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_hidden_dim=11008,
        vocab_size=128256,
        tp=8,
        cp=2,
    )
    assert sharded.break_even_length == pytest.approx(cm.break_even_length)
    assert sharded.doc_cost(np.array([1000]))[0] == pytest.approx(cm.doc_cost([1000])[0] / 16)


def test_vectorised_costs_and_microbatch():
    cm = CostModel.from_coefficients(2.0, 3.0)
    lens = np.array([1, 2, 10])
    assert np.array_equal(cm.attention_cost(lens), [2.0, 8.0, 200.0])
    assert np.array_equal(cm.linear_cost(lens), [3.0, 6.0, 30.0])
    assert np.array_equal(cm.doc_cost(lens), [5.0, 14.0, 230.0])
    assert cm.microbatch_cost(lens) == 249.0
    assert cm.break_even_length == 1.5
    assert CostModel.from_coefficients(0.0, 1.0).break_even_length == math.inf
    # Under CP, documents longer than whole_max_len are gathered and pay gathered_coef a token.
    cp = CostModel(2.0, 3.0, "seconds", gathered_coef=5.0, whole_max_len=2)
    assert np.array_equal(cp.linear_cost(lens), [3.0, 6.0, 50.0])
    assert np.array_equal(cp.doc_cost(lens), [5.0, 14.0, 250.0])


def test_profile_cost_model_recovers_coefficients(tmp_path):
    a, b = 3e-12, 2e-6
    d = np.array([1024, 4096, 16384, 65536, 131072])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps([[int(x), float(a * x * x + b * x)] for x in d]))
    cm = profile_cost_model(path)
    assert cm.unit == "seconds"
    assert cm.attn_coef == pytest.approx(a, rel=1e-6)
    assert cm.linear_coef == pytest.approx(b, rel=1e-6)
    other = tmp_path / "p2.json"
    other.write_text(
        json.dumps({"points": [{"length": 10, "seconds": 1.0}, {"length": 20, "seconds": 2.0}]})
    )
    lin = profile_cost_model(other)
    assert lin.attn_coef == pytest.approx(0.0, abs=1e-12)
    assert lin.linear_coef == pytest.approx(0.1)


@pytest.mark.parametrize(
    "content, match",
    [
        ("not json", "cannot read"),
        ("[]", "non-empty"),
        ("[[10, 1.0]]", "2 distinct lengths"),
        ("[[0, 1.0], [5, 2.0]]", "length and seconds must be > 0"),
        ("[[10, -1.0], [5, 2.0]]", "seconds must be > 0"),
        ("[[10, 0.0], [5, 2.0]]", "seconds must be > 0"),
        ("[[10, 1.0, 3], [5, 2.0]]", "must be \\[length, seconds\\]"),
        ('[{"length": 3}]', "needs 'length' and 'seconds'"),
    ],
)
def test_bad_profiles(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        profile_cost_model(path)


def test_missing_profile(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        profile_cost_model(tmp_path / "nope.json")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attn_coef=-1.0, linear_coef=1.0), "attn_coef"),
        (dict(attn_coef=1.0, linear_coef=float("nan")), "linear_coef"),
        (dict(attn_coef=0.0, linear_coef=0.0), "both 0"),
        (dict(attn_coef=1.0, linear_coef=1.0, unit="ms"), "unit"),
        (dict(attn_coef=1.0, linear_coef=1.0, gathered_coef=-2.0), "gathered_coef"),
        (dict(attn_coef=1.0, linear_coef=1.0, whole_max_len=-1), r"whole_max_len must be an int"),
    ],
)
def test_invalid_coefficients(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kwargs)


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(tp=3), "tp=3 must divide"),
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(dim=9), "divisible by n_heads"),
        (dict(n_layers=0), "n_layers"),
        (dict(cp=1.5), "cp"),
    ],
)
def test_invalid_dims(override, match):
    with pytest.raises(ValueError, match=match):
        CostModel.from_model_dims(**{**DIMS, **override})
