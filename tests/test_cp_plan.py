"""Properties of CP sharding plans (pure NumPy; no process group needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_wlb.cp import CPProfile, build_cp_plan, default_profile
from torchtitan_wlb.cp.plan import causal_pairs

FIXED = ["per_sequence", "per_document"]


def _global_positions(doc_lens):
    cu = np.concatenate([[0], np.cumsum(doc_lens)])
    doc = np.repeat(np.arange(len(doc_lens)), doc_lens)
    return doc, np.arange(cu[-1]) - cu[doc]


def _check_key_window(cq, ck, lo, hi, gathered_len):
    """A half's key window is tight: from its first query segment's first key to its last one's
    last (no leading or trailing gap handed to the kernel), inside the gathered rows."""
    segments = np.flatnonzero(np.diff(cq) > 0)
    assert 0 <= lo <= hi <= gathered_len
    if len(segments) == 0:
        assert (lo, hi) == (0, 0) and not ck.any()
        return
    assert ck[segments[0]] == 0 and ck[segments[-1] + 1] == hi - lo


def _check_plan(doc_lens, cp, strategy):
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    plan = build_cp_plan(doc_lens, cp, strategy)
    total = int(doc_lens.sum())
    doc_of, pos_of = _global_positions(doc_lens)
    all_idx = []
    for r in range(cp):
        idx, pos = plan.rank_indices(r)
        assert len(idx) == plan.local_lens[r] >= 1
        np.testing.assert_array_equal(pos, pos_of[idx])
        all_idx.append(idx)
        # Local attention spec: the head/tail split and key segments tile the global order.
        spec = plan.local_attention_spec(r)
        for half, (cq, ck) in enumerate(zip(spec.cu_seqlens_q, spec.cu_seqlens_k, strict=True)):
            n_q = spec.n_head_tokens if half == 0 else len(idx) - spec.n_head_tokens
            lo, hi = spec.key_window[half]
            assert cq[0] == 0 and cq[-1] == n_q and ck[0] == 0 and ck[-1] == hi - lo
            _check_key_window(cq, ck, lo, hi, total)
            assert np.all(np.diff(cq) >= 0) and np.all(np.diff(ck) >= 0)
            assert cq.dtype == np.int32 and ck.dtype == np.int32
            # Each query segment's keys are its document's prefix ending at its last query.
            q_seg = np.flatnonzero(np.diff(cq) > 0)
            local = idx[: spec.n_head_tokens] if half == 0 else idx[spec.n_head_tokens :]
            for s in q_seg[:50]:
                q_tok = local[cq[s] : cq[s + 1]]
                assert len(set(doc_of[q_tok])) == 1
                k_start, k_end = ck[s] + lo, ck[s + 1] + lo
                assert doc_of[k_start] == doc_of[q_tok[0]] and pos_of[k_start] == 0
                assert k_end - 1 == q_tok[-1]
            assert spec.max_seqlen_q[half] == max(np.diff(cq).max(), 0)
    flat = np.concatenate(all_idx)
    np.testing.assert_array_equal(np.sort(flat), np.arange(total))  # every token exactly once
    # kv_order maps global tokens to the rank-major all-gather buffer.
    buffer = np.full(cp * plan.max_local_len, -1)
    for r, idx in enumerate(all_idx):
        buffer[r * plan.max_local_len : r * plan.max_local_len + len(idx)] = idx
    np.testing.assert_array_equal(buffer[plan.kv_order()], np.arange(total))
    # Padding policy: no padding, local lengths within 2 tokens.
    assert plan.local_lens.sum() == total
    assert plan.local_lens.max() - plan.local_lens.min() <= 2
    assert plan.slot_tokens.max() - plan.slot_tokens.min() <= 1
    return plan


@pytest.mark.parametrize("strategy", FIXED)
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(
    "doc_lens",
    [[64], [37], [1] * 16, [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 1, 1, 250, 3], [8, 8, 8, 8]],
)
def test_plan_properties(doc_lens, cp, strategy):
    if sum(doc_lens) < cp:
        pytest.skip("fewer tokens than ranks is rejected (tested below)")
    _check_plan(doc_lens, cp, strategy)


@settings(max_examples=60, deadline=None)
@given(
    doc_lens=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    cp=st.sampled_from([1, 2, 4, 8, 16]),
    strategy=st.sampled_from(FIXED),
)
def test_plan_properties_random(doc_lens, cp, strategy):
    if sum(doc_lens) < cp:
        return
    _check_plan(doc_lens, cp, strategy)


@pytest.mark.parametrize("cp", [2, 4, 8, 16])
def test_per_document_balances_long_tail(cp):
    rng = np.random.default_rng(cp)
    doc_lens = np.concatenate([rng.integers(1, 500, 300), [20000, 9000]])
    per_doc = build_cp_plan(doc_lens, cp, "per_document").flops_imbalance()
    per_seq = build_cp_plan(doc_lens, cp, "per_sequence").flops_imbalance()
    assert per_doc <= 1.01
    assert per_seq > per_doc


def test_per_document_chunks_and_remainder_counter():
    # cp = 2 -> 4 slots. Doc 0 (len 6): base 1, remainder 2 dealt to slots 0, 1.
    # Doc 1 (len 5): base 1, remainder 1 dealt to slot 2 (the counter carried over).
    plan = build_cp_plan(np.array([6, 5]), 2, "per_document")
    sizes = plan.seg_len.reshape(2, 4)
    np.testing.assert_array_equal(sizes, [[2, 2, 1, 1], [1, 1, 2, 1]])
    # rank 0 keeps slots 0 and 3; head segments first (doc order), then tail segments.
    np.testing.assert_array_equal(plan.token_indices(0), [0, 1, 6, 5, 10])
    np.testing.assert_array_equal(plan.positions(0), [0, 1, 0, 5, 4])
    np.testing.assert_array_equal(plan.token_indices(1), [2, 3, 7, 4, 8, 9])


def test_per_sequence_is_head_tail_of_whole_sequence():
    plan = build_cp_plan(np.array([10, 6]), 2, "per_sequence")
    np.testing.assert_array_equal(plan.token_indices(0), [0, 1, 2, 3, 12, 13, 14, 15])
    np.testing.assert_array_equal(plan.positions(0), [0, 1, 2, 3, 2, 3, 4, 5])
    np.testing.assert_array_equal(plan.token_indices(1), [4, 5, 6, 7, 8, 9, 10, 11])


def test_not_divisible_total_and_every_rank_has_a_token():
    # 5 tokens on 4 ranks (8 slots): slots 0..4 get one token each, so ranks 0..3 all get one.
    for strategy in FIXED:
        plan = _check_plan([5], 4, strategy)
        np.testing.assert_array_equal(plan.local_lens, [1, 1, 1, 2])
        plan = _check_plan([1, 1, 1, 1], 4, strategy)
        np.testing.assert_array_equal(plan.local_lens, [1, 1, 1, 1])


def test_rank_attention_pairs_sum_to_total():
    doc_lens = np.array([50, 3, 77, 1, 12])
    for strategy in FIXED:
        plan = build_cp_plan(doc_lens, 4, strategy)
        total_pairs = causal_pairs(doc_lens, doc_lens).sum()
        assert plan.rank_attention_pairs().sum() == pytest.approx(total_pairs)


def test_adaptive_picks_lower_estimate():
    doc_lens = np.array([4000, 30, 20, 10, 40])
    plan = build_cp_plan(doc_lens, 4, "adaptive")
    assert plan.requested == "adaptive"
    est = plan.estimated_seconds
    assert set(est) == {"per_sequence", "per_document", "hybrid"}
    assert plan.strategy == min(est, key=est.get)
    # The shortcut estimates equal the profile's estimate of each fully built plan, plus its
    # gathered K/V (3 transfers per layer) over the default bandwidth.
    prof = default_profile()
    for name in ("per_sequence", "per_document", "hybrid"):
        built = build_cp_plan(doc_lens, 4, name)
        comm = 3 * built.kv_gather_bytes(prof.n_kv_heads, prof.head_dim, 4) / 50e9
        assert est[name] == pytest.approx(prof.estimate_plan_seconds(built) + comm, rel=1e-9)
    # A pack of equal short documents: hybrid keeps them whole, 8 per rank, and gathers nothing;
    # per-document cuts them into 2-token chunks.
    many_short = build_cp_plan(np.full(64, 32), 8, "adaptive")
    assert many_short.strategy == "hybrid" and many_short.flops_imbalance() == 1.0
    # Two long documents plus small ones: per-document keeps ranks balanced, so it beats
    # per-sequence; hybrid keeps the two whole, one per rank, gathers nothing and beats both.
    lens = np.array([4096, 4096, 64, 64, 64])
    long_docs = build_cp_plan(lens, 2, "adaptive", candidates=("per_sequence", "per_document"))
    est = long_docs.estimated_seconds
    assert long_docs.strategy == "per_document" and est["per_document"] < est["per_sequence"]
    assert long_docs.flops_imbalance() == pytest.approx(1.0)
    with_hybrid = build_cp_plan(lens, 2, "adaptive")
    assert with_hybrid.strategy == "hybrid" and with_hybrid.gathered_len == 0
    assert with_hybrid.flops_imbalance() == pytest.approx(1.0, abs=1e-3)
    per_seq = build_cp_plan(np.array([4096, 4096, 64, 64, 64]), 2, "per_sequence")
    assert per_seq.flops_imbalance() > 1.02


def test_shard_selects_tokens():
    from torchtitan_wlb.cp.local import shard_tensor

    plan = build_cp_plan(np.array([3, 5]), 2, "per_document")
    tokens = torch.arange(8)[None, :] * 10
    np.testing.assert_array_equal(
        shard_tensor(plan, 1, tokens).numpy()[0], plan.token_indices(1) * 10
    )
    with pytest.raises(ValueError, match="tensor has 7 tokens along dim -1, the plan covers 8"):
        shard_tensor(plan, 0, torch.zeros(1, 7))
    with pytest.raises(ValueError, match="rank 2 is outside"):
        plan.token_indices(2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"doc_lens": [3, 0, 2]}, r"doc_lens\[1\] = 0"),
        ({"doc_lens": []}, "non-empty 1-D integer"),
        ({"doc_lens": [[1, 2]]}, "non-empty 1-D integer"),
        ({"doc_lens": [1.5, 2.0]}, "integer"),
        ({"cp_degree": 0}, r"cp_degree must be in \[1, 10\].*got 0"),
        ({"cp_degree": 11}, r"got 11"),
        ({"cp_degree": 2.0}, "must be an int"),
        ({"strategy": "ring"}, "'ring' is not one of"),
        ({"seq_len": 12}, "sum to 10, but the sequence has 12"),
    ],
)
def test_bad_input(kwargs, match):
    args = {"doc_lens": [4, 6], "cp_degree": 2, "strategy": "per_document", "seq_len": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_cp_plan(
            np.asarray(args["doc_lens"]),
            args["cp_degree"],
            args["strategy"],
            seq_len=args["seq_len"],
        )


def _tiny_profile_dict():
    return {
        "lengths": [16, 64],
        "tflops": [[0.01, 0.02], [None, 0.03]],
        "tile": 16,
        "device": "cpu",
        "backend": "cpu",
        "n_heads": 2,
        "n_kv_heads": 2,
        "head_dim": 8,
        "dtype": "float32",
    }


def test_profile_roundtrip_and_lookup(tmp_path):
    prof = CPProfile.from_json(json.dumps(_tiny_profile_dict()))
    again = CPProfile.from_json(prof.to_json())
    assert again == prof or np.allclose(again.table, prof.table, equal_nan=True)
    # largest grid point <= length, clamped to the grid
    np.testing.assert_allclose(
        prof.lookup_tflops(np.array([1, 16, 63, 64, 1000]), np.array([1, 64, 64, 64, 5000])),
        [0.01, 0.02, 0.02, 0.03, 0.03],
    )
    import torchtitan_wlb.cp.profile as profile_mod

    lookups = (np.array([0, 16, 63, 64, 99999]), np.array([5, 64, 64, 64, 99999]))
    want = prof.lookup_tflops(*lookups)
    old = profile_mod.MAX_LUT_LENGTH
    profile_mod.MAX_LUT_LENGTH = 8  # force the binary-search path
    try:
        np.testing.assert_allclose(prof.lookup_tflops(*lookups), want)
    finally:
        profile_mod.MAX_LUT_LENGTH = old
    path = tmp_path / "p.json"
    path.write_text(prof.to_json())
    plan = build_cp_plan(np.array([40, 30, 2]), 2, "adaptive", profile=str(path))
    assert plan.estimated_seconds["per_document"] > 0


def test_profile_missing_entry_is_an_error(tmp_path):
    data = _tiny_profile_dict()
    data["tflops"][0][1] = None
    with pytest.raises(ValueError, match=r"\(q_len, kv_len\) = \[\(16, 64\)\]"):
        CPProfile.from_json(json.dumps(data))
    data = _tiny_profile_dict()
    del data["tile"]
    with pytest.raises(ValueError, match="lacks the fields \\['tile'\\]"):
        CPProfile.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="does not exist"):
        build_cp_plan(np.array([4, 4]), 2, "adaptive", profile=str(tmp_path / "none.json"))


def test_default_profile_is_complete():
    prof = default_profile()
    n = len(prof.lengths)
    assert prof.table.shape == (n, n)
    assert np.all(prof.table[np.triu_indices(n)] > 0)


def test_cp_bench_cli_json(capsys):
    from torchtitan_wlb.tools import cp_bench

    args = ["--generator", "longtail_scaled", "--context-len", "2048", "--cp", "2"]
    args += ["--micro-batches", "3"]
    args += ["--plan-repeats", "1", "--measure", "--measure-micro-batches", "1"]
    args += ["--measure-repeats", "1", "--json"]
    assert cp_bench.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) >= {"per_sequence", "per_document", "adaptive", "config"}
    for name in ("per_sequence", "per_document", "adaptive"):
        entry = result[name]
        assert entry["flops_imbalance"] >= 1.0 and entry["plan_ms"] > 0
        assert entry["measured_micro_batches"] == 1 and entry["measured_max_ms"] > 0
    assert 0.0 <= result["adaptive"]["per_document_share"] <= 1.0
    assert result["per_document"]["flops_imbalance"] <= result["per_sequence"]["flops_imbalance"]


def test_cp_bench_packing_splits_long_documents():
    from torchtitan_wlb.tools.cp_bench import pack_micro_batches
    from torchtitan_wlb.workloads import split_long

    np.testing.assert_array_equal(split_long(np.array([5, 25, 10]), 10), [5, 10, 10, 5, 10])
    mbs = pack_micro_batches(np.array([5, 25, 10, 3, 9, 9]), 10, 3)
    assert all(m.sum() <= 10 for m in mbs) and len(mbs) == 3


def test_cp_profile_cli_measures_a_complete_table(tmp_path, capsys):
    from torchtitan_wlb.tools import cp_profile

    out = tmp_path / "cpu.json"
    args = ["--device", "cpu", "--lengths", "16,32", "--pairs-per-cell", "2000", "--repeats", "1"]
    assert cp_profile.main([*args, "--out", str(out)]) == 0
    prof = CPProfile.load(out)
    assert prof.lengths == (16, 32) and prof.backend == "cpu" and prof.tile == 16
    assert np.all(prof.table[np.triu_indices(2)] > 0) and np.isnan(prof.table[1, 0])
    plan = build_cp_plan(np.array([30, 20, 5]), 2, "adaptive", profile=prof)
    assert plan.strategy in (*FIXED, "hybrid")


def test_cp_profile_caps_the_tokens_of_a_cell(monkeypatch, capsys):
    """A GPU table's small cells would otherwise hold 2**30 pairs of 64-token segments (33M
    tokens); with --max-tokens every cell's keys stay under the cap (one segment at least)."""
    from torchtitan_wlb import attention
    from torchtitan_wlb.cp import profile as profile_mod
    from torchtitan_wlb.tools import cp_profile

    keys = []
    real = attention.document_attention

    def counting(q, k, *args, **kwargs):
        keys.append(k.shape[0])
        return real(q, k, *args, **kwargs)

    monkeypatch.setattr(attention, "document_attention", counting)
    monkeypatch.setattr(profile_mod, "CPProfile", lambda *a: a)  # the table is not the point
    profile_mod.measure_profile([16, 64], pairs_per_cell=1 << 20, max_tokens=256, repeats=1)
    assert keys and max(keys) <= 256 and min(keys) >= 64
    with pytest.raises(SystemExit):
        cp_profile.main(["--lengths", "16", "--max-tokens", "0", "--out", "unused.json"])
    assert "--max-tokens must be >= 1; got 0" in capsys.readouterr().err


def test_draft_takes_fixed_strategies_only():
    from torchtitan_wlb.cp.plan import draft_sharding

    with pytest.raises(ValueError, match="'adaptive' is not one of.*cp.adaptive.build_cp_plan"):
        draft_sharding(np.array([4, 4]), 2, "adaptive")


# --------------------------------------------------------------------------------- hybrid
def _check_hybrid(doc_lens, cp, max_len=0, costs=None):
    """Hybrid invariants: every token once, per-document positions, whole documents uncut and
    local, the gathered tokens a prefix of every rank, key segments = document prefixes."""
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    plan = build_cp_plan(doc_lens, cp, "hybrid", hybrid_max_len=max_len, coefficients=costs)
    total = int(doc_lens.sum())
    doc_of, pos_of = _global_positions(doc_lens)
    # Keys of the split halves are the gathered documents' tokens in packed order.
    key_tokens = np.flatnonzero(plan.doc_gathered[doc_of])
    assert plan.gathered_len == len(key_tokens)
    # Whole documents are exactly those <= max_len (unless split to give every rank a token).
    assert plan.max_len >= (max_len or 2 * cp * 128)
    assert np.all(plan.doc_gathered[doc_lens > plan.max_len])
    all_idx = []
    for r in range(cp):
        idx, pos = plan.rank_indices(r)
        assert len(idx) == plan.local_lens[r] >= 1
        np.testing.assert_array_equal(pos, pos_of[idx])
        all_idx.append(idx)
        spec = plan.local_attention_spec(r)
        n_gather = spec.n_gather_tokens
        assert n_gather == plan.gather_lens[r]
        gathered = plan.doc_gathered[doc_of[idx]]
        assert gathered[:n_gather].all() and not gathered[n_gather:].any()
        # Whole documents: complete, contiguous, in the local call's boundaries.
        cw = spec.cu_seqlens_whole
        assert cw.dtype == np.int32 and cw[0] == 0 and cw[-1] == len(idx) - n_gather
        for a, b in zip(cw[:-1], cw[1:], strict=True):
            tok = idx[n_gather + a : n_gather + b]
            assert pos_of[tok[0]] == 0 and b - a == doc_lens[doc_of[tok[0]]]
            np.testing.assert_array_equal(np.diff(tok), 1)
        assert spec.max_seqlen_whole == (np.diff(cw).max() if len(cw) > 1 else 0)
        halves = (idx[: spec.n_head_tokens], idx[spec.n_head_tokens : n_gather])
        for half, (local, cq, ck) in enumerate(
            zip(halves, spec.cu_seqlens_q, spec.cu_seqlens_k, strict=True)
        ):
            lo, hi = spec.key_window[half]
            assert cq[-1] == len(local) and ck[-1] == hi - lo
            _check_key_window(cq, ck, lo, hi, plan.gathered_len)
            for s in np.flatnonzero(np.diff(cq) > 0):
                q_tok = local[cq[s] : cq[s + 1]]
                keys = key_tokens[lo + ck[s] : lo + ck[s + 1]]
                assert len(set(doc_of[q_tok])) == 1 and doc_of[keys[0]] == doc_of[q_tok[0]]
                assert pos_of[keys[0]] == 0 and keys[-1] == q_tok[-1]
    np.testing.assert_array_equal(np.sort(np.concatenate(all_idx)), np.arange(total))
    # kv_order maps the gathered keys to the rank-major buffer of gathered prefixes.
    rows = max(plan.max_gather_len, 1)
    buffer = np.full(cp * rows, -1)
    for r, idx in enumerate(all_idx):
        buffer[r * rows : r * rows + plan.gather_lens[r]] = idx[: plan.gather_lens[r]]
    np.testing.assert_array_equal(buffer[plan.kv_order()], key_tokens)
    assert plan.local_lens.sum() == total and plan.strategy == "hybrid"
    return plan


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "doc_lens,max_len",
    [
        ([37], 0),  # one document
        ([1] * 16, 0),  # all short: nothing gathered
        ([300, 900, 40, 2000, 5, 5000], 0),  # a mix at the default threshold
        ([100, 1, 1, 250, 3], 10),  # a mix, documents shorter than 2c split
        ([9, 30, 1, 17, 2, 2], 4),
    ],
)
def test_hybrid_plan_properties(doc_lens, max_len, cp):
    if sum(doc_lens) < cp:
        pytest.skip("fewer tokens than ranks is rejected")
    _check_hybrid(doc_lens, cp, max_len)


@settings(max_examples=40, deadline=None)
@given(
    doc_lens=st.lists(st.integers(1, 400), min_size=1, max_size=30),
    cp=st.sampled_from([2, 3, 4, 8]),
    max_len=st.sampled_from([0, 1, 8, 50, 200]),
    costs=st.sampled_from([None, (1e-8, 5e-5, 6e-5), (0.0, 1e-5, 4e-5), (1e-8, 0.0, 0.0)]),
)
def test_hybrid_plan_properties_random(doc_lens, cp, max_len, costs):
    if sum(doc_lens) < cp:
        return
    _check_hybrid(doc_lens, cp, max_len, costs)


def _fitted_rank_costs(plan, costs):
    """Each rank's seconds by the online fit's per-rank model (docs/cost_model.md)."""
    a, b, g = costs
    pairs = plan.rank_attention_pairs()
    d = plan.doc_lens.astype(np.float64)
    local = plan.local_lens - plan.gather_lens
    return a * float(d @ d) * pairs / pairs.sum() + b * local + g * plan.gather_lens


@pytest.mark.parametrize("cp", [2, 4])
def test_hybrid_balances_the_ranks_by_the_fitted_costs(cp):
    # The CPU runs' fit prices a gathered token 1.27x a local one (the all-gather, the longer key
    # rows): hybrid's even token counts left the rank holding more whole documents cheaper, the
    # ranks' predicted costs 2.8 % apart on average at CP = 2. Balanced by the fit, no micro-batch
    # gets worse and the slowest ranks' total (what the step waits for) falls by over 1 %.
    from torchtitan_wlb.tools.cp_bench import pack_micro_batches
    from torchtitan_wlb.workloads import generate

    costs, context = (5e-8, 5.2e-5, 6.6e-5), 1024 * cp
    lens = np.rint(generate("longtail", 6000, 8192, seed=5) * (context / 8192)).astype(np.int64)
    top = {None: 0.0, costs: 0.0}
    for doc_lens in pack_micro_batches(np.clip(lens, 3, context), context, 40):
        spread = {}
        for coef in top:
            ranks = _fitted_rank_costs(_check_hybrid(doc_lens, cp, 0, coef), costs)
            spread[coef] = ranks.max() / ranks.mean()
            top[coef] += ranks.max()
        assert spread[costs] <= spread[None] + 1e-3
    assert top[costs] < top[None] * 0.99


def test_hybrid_extremes():
    # All documents longer than the threshold: exactly per-document sharding.
    lens = np.array([37, 25, 11, 9])
    hybrid, per_doc = build_cp_plan(lens, 2, "hybrid", hybrid_max_len=8), build_cp_plan(lens, 2)
    for r in range(2):
        np.testing.assert_array_equal(hybrid.token_indices(r), per_doc.token_indices(r))
    np.testing.assert_array_equal(hybrid.kv_order(), per_doc.kv_order())
    assert hybrid.kv_gather_bytes(2, 8, 2) == per_doc.kv_gather_bytes(2, 8, 2)
    # All short: no K/V gathered at all.
    short = _check_hybrid(np.full(40, 30), 4)
    assert short.gathered_len == 0 and short.kv_gather_bytes(8, 128, 2) == 0
    assert short.kv_order().size == 0 and not short.doc_gathered.any()
    np.testing.assert_array_equal(short.local_lens, [300] * 4)
    # Fewer documents than ranks, all short: the longest are split so that every rank has tokens.
    few = _check_hybrid([5, 3, 2], 4)
    assert few.doc_gathered.tolist() == [True, False, False]


def test_hybrid_with_nothing_split_evens_tokens_and_work_together():
    # A packed micro-batch of the CPU runs, every document under hybrid's floor (512 at CP = 2):
    # nothing is split, so no chunk can even the ranks out and the whole documents' deal must
    # balance tokens (the linear layers' work) and attention work at once. Refining on attention
    # work alone left the tokens 23 % apart here.
    lens = np.array([10, 19, 64, 19, 28, 68, 277, 65, 28, 264, 67, 28, 64, 60, 28, 62, 263, 19,
                     29, 20, 333, 70])  # fmt: skip
    plan = build_cp_plan(lens, 2, "hybrid")
    assert plan.gathered_len == 0
    assert plan.token_imbalance() <= 1.07 and plan.flops_imbalance() <= 1.07
    # Given the fit, the deal evens its per-rank costs (here: tokens priced, attention work free).
    fitted = build_cp_plan(lens, 2, "hybrid", coefficients=(0.0, 1e-5, 2e-5))
    assert fitted.gathered_len == 0 and fitted.token_imbalance() <= 1.01


def test_hybrid_keeps_short_documents_whole_and_gathers_less():
    from torchtitan_wlb.tools.cp_bench import pack_micro_batches
    from torchtitan_wlb.workloads import generate

    cp, tile = 4, 128
    lens = generate("longtail_scaled", 3000, 32768, seed=3)
    for doc_lens in pack_micro_batches(lens, 32768, 4):
        hybrid = build_cp_plan(doc_lens, cp, "hybrid")
        per_doc = build_cp_plan(doc_lens, cp, "per_document")
        # Balanced in attention work and in tokens (the split documents' chunks compensate).
        assert hybrid.flops_imbalance() <= 1.01
        assert hybrid.token_imbalance() <= 1.01
        # No document under the threshold is cut: no sub-tile chunk comes from one.
        short = doc_lens[hybrid.seg_doc] <= hybrid.max_len
        assert np.all(hybrid.seg_len[short] == doc_lens[hybrid.seg_doc[short]])
        assert hybrid.max_len >= 2 * cp * tile
        assert hybrid.small_chunks(tile) < per_doc.small_chunks(tile)
        assert hybrid.kv_gather_bytes(8, 128, 2) < per_doc.kv_gather_bytes(8, 128, 2)


@pytest.mark.parametrize("strategy", ["per_sequence", "per_document", "hybrid"])
def test_draft_kv_gather_bytes_matches_plan(strategy):
    from torchtitan_wlb.cp.plan import draft_sharding

    lens = np.array([300, 2000, 40, 7000, 5, 1200, 900])
    draft = draft_sharding(lens, 4, strategy, max_len=1000)
    plan = draft.plan()
    assert draft.kv_gather_bytes(8, 128, 2) == plan.kv_gather_bytes(8, 128, 2) > 0


def test_kv_gather_bytes_and_small_chunks():
    plan = build_cp_plan(np.array([6, 5]), 2, "per_document")  # local lengths 5 and 6
    assert (
        plan.kv_gather_bytes(kv_heads=2, head_dim=4, dtype_bytes=2) == (2 - 1) * 6 * 2 * 2 * 4 * 2
    )
    # Chunks [[2, 2, 1, 1], [1, 1, 2, 1]] (see the remainder-counter test): five under 2 tokens.
    assert plan.small_chunks(tile=2) == 5
    # Per-sequence slots [0, 3) [3, 6) [6, 9) [9, 11): four proper pieces under 128 tokens; a
    # document inside one slot is not a chunk.
    assert build_cp_plan(np.array([6, 5]), 2, "per_sequence").small_chunks(tile=128) == 4
    assert build_cp_plan(np.array([2, 2, 2, 2]), 2, "per_sequence").small_chunks() == 0


def test_hybrid_threshold_errors_and_auto():
    from torchtitan_wlb.cp.plan import auto_hybrid_max_len, draft_sharding

    with pytest.raises(ValueError, match=r"hybrid max_len must be an int >= 0.*got -3"):
        draft_sharding(np.array([4, 4]), 2, "hybrid", max_len=-3)
    # Auto: never below 2c * 128; raised when the split documents can absorb whole ones.
    assert auto_hybrid_max_len(np.array([10, 20]), 4) == 1024
    lens = np.array([60000, 30000, 3000, 2500, 2000, 1500])
    raised = auto_hybrid_max_len(lens, 4)
    assert 3000 <= raised < 30000
    assert draft_sharding(lens, 4, "hybrid").max_len in (raised, 1024)
