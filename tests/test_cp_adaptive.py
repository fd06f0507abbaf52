"""Adaptive CP selection among per-sequence, per-document and hybrid sharding (pure NumPy), and
the trainer's log of its choices.

Synthetic throughput tables make each candidate win where its trade-off says it should: compute from
the table, plus the gathered K/V over the configured bandwidth.
"""

from __future__ import annotations

import numpy as np
import pytest

from torchtitan_wlb.cp import CPProfile, build_cp_plan
from torchtitan_wlb.cp.adaptive import (
    ADAPTIVE_CANDIDATES,
    adaptive_candidates,
    predicted_seconds,
)
from torchtitan_wlb.cp.plan import draft_sharding
from torchtitan_wlb.online_fit import cp_fit_features

GRID = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
FAST = 1e9  # GB/s: communication costs nothing
SLOW = 1e-3  # GB/s: communication dominates


def _profile(rate) -> CPProfile:
    """A table whose throughput is ``rate(q_len)`` TFLOP/s, NaN below the diagonal."""
    n = len(GRID)
    rows = tuple(
        tuple(rate(GRID[i]) if j >= i else float("nan") for j in range(n)) for i in range(n)
    )
    return CPProfile(
        lengths=GRID,
        tflops=rows,
        tile=16,
        device="synthetic",
        backend="cpu",
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        dtype="bfloat16",
    )


FLAT = _profile(lambda q: 1.0)  # work is work: the best-balanced plan wins
TILE_HUNGRY = _profile(lambda q: q / 4096)  # small query chunks run far below peak


def _choose(lens, cp, profile, bandwidth, max_len=512):
    lens = np.asarray(lens, dtype=np.int64)
    return build_cp_plan(
        lens, cp, "adaptive", profile, hybrid_max_len=max_len, bandwidth_gbps=bandwidth
    )


def test_per_sequence_wins_when_small_chunks_are_slow():
    # Two long documents: head-tail over the sequence is already balanced with 1000-token chunks;
    # per-document (and hybrid, which splits both) cut 500-token chunks.
    plan = _choose([2000, 2000], 2, TILE_HUNGRY, FAST)
    assert plan.strategy == "per_sequence" and plan.requested == "adaptive"


def test_per_document_wins_when_whole_documents_cannot_be_balanced():
    # Documents under hybrid's threshold that no whole-document split balances; per-sequence
    # cuts the sequence where the work is uneven.
    plan = _choose([400, 500, 100, 500], 2, FLAT, FAST)
    est = plan.estimated_seconds
    assert plan.strategy == "per_document"
    assert est["hybrid"] > 1.1 * est["per_document"] and est["per_sequence"] > est["per_document"]


def test_hybrid_wins_on_many_short_documents():
    plan = _choose([100] * 40, 4, FLAT, FAST)
    assert plan.strategy == "hybrid" and plan.gathered_len == 0


def test_bandwidth_decides_between_balance_and_gathered_bytes():
    # Whole, these documents leave the ranks about 4 % apart in work; per-document is balanced
    # but gathers all of them. A fast link picks the balance, a slow one the smaller gather.
    lens = [300, 500, 700]
    assert _choose(lens, 2, FLAT, FAST, max_len=1024).strategy == "per_document"
    slow = _choose(lens, 2, FLAT, SLOW, max_len=1024)
    assert slow.strategy == "hybrid" and slow.gathered_len == 0


@pytest.mark.parametrize("name", ADAPTIVE_CANDIDATES)
def test_prediction_is_the_built_plans_compute_plus_its_gather(name):
    lens = np.array([3000, 40, 700, 5, 1200, 90])
    draft = draft_sharding(lens, 4, name, max_len=512)
    compute, comm = predicted_seconds(draft, FLAT, 2.0)
    plan = draft.plan()
    assert compute == pytest.approx(FLAT.estimate_plan_seconds(plan), rel=1e-12)
    assert comm == pytest.approx(3 * plan.kv_gather_bytes(2, 32, 2) / 2e9, rel=1e-12)


def test_fitted_coefficients_choose_by_the_ranks_measured_costs():
    # The online fit's per-rank model (a, b, g): the estimate of each candidate is its slowest
    # rank's a * Σd² * (share of the pairs) + b * local + g * gathered tokens, the features the
    # trainer fits, and the cheapest candidate wins whatever the profile would say.
    lens = np.array([400, 500, 100, 500, 30, 30])
    dear_gather = (1e-7, 1e-5, 1e-3)  # gathering a token costs 100x keeping it
    plan = build_cp_plan(
        lens, 2, "adaptive", TILE_HUNGRY, hybrid_max_len=512, coefficients=dear_gather
    )
    for name, seconds in plan.estimated_seconds.items():
        built = draft_sharding(lens, 2, name, max_len=512, costs=dear_gather).plan()
        ranks = [np.dot(cp_fit_features(built, r), dear_gather) for r in range(2)]
        assert seconds == pytest.approx(max(ranks), rel=1e-12)
    assert plan.strategy == "hybrid" and plan.gathered_len == 0
    cheap_gather = (1e-7, 1e-3, 1e-5)  # the other way round: the balanced all-gathered plan
    plan = build_cp_plan(
        lens, 2, "adaptive", TILE_HUNGRY, hybrid_max_len=512, coefficients=cheap_gather
    )
    assert plan.strategy == "per_document"


@pytest.mark.parametrize(
    "bad", [(1e-7, 1e-5), (1e-7, -1e-5, 1e-5), (1e-7, float("nan"), 1.0), "abc", (True, 1.0, 1.0)]
)
@pytest.mark.parametrize("strategy", ["adaptive", "hybrid"])  # hybrid balances by them too
def test_bad_fitted_coefficients_are_one_clear_error(bad, strategy):
    with pytest.raises(ValueError, match=r"coefficients must be three finite numbers >= 0"):
        build_cp_plan(np.array([10, 20]), 2, strategy, coefficients=bad)


def test_bad_bandwidth_is_one_clear_error():
    with pytest.raises(ValueError, match=r"bandwidth_gbps must be a number > 0 \(GB/s\); got 0"):
        _choose([10, 20], 2, FLAT, 0)


def test_sequence_parallel_tp_leaves_hybrid_out():
    # Where hybrid wins (see above), TP > 1 makes adaptive choose among the other two, whose
    # local lengths differ by at most two tokens (sequence-parallel TP splits them evenly).
    assert adaptive_candidates(False) == ADAPTIVE_CANDIDATES
    assert adaptive_candidates(True) == ("per_sequence", "per_document")
    lens = np.array([100] * 40)
    plan = build_cp_plan(
        lens,
        4,
        "adaptive",
        FLAT,
        hybrid_max_len=512,
        bandwidth_gbps=FAST,
        candidates=adaptive_candidates(True),
    )
    assert plan.strategy in ("per_sequence", "per_document")
    assert set(plan.estimated_seconds) == {"per_sequence", "per_document"}
    assert plan.local_lens.max() - plan.local_lens.min() <= 2


def test_trainer_logs_the_share_of_each_chosen_strategy():
    from types import SimpleNamespace

    from torchtitan_wlb.trainer import WLBTrainer

    logged = []
    stats = [("hybrid", 1.0), ("per_document", 1.2), ("hybrid", 1.1), ("per_sequence", 1.5)]
    trainer = SimpleNamespace(
        _cp_stats=stats, metrics_processor=SimpleNamespace(record=logged.append)
    )
    WLBTrainer._flush_cp_stats(trainer)
    assert logged == [
        {
            "cp_per_document_share": 0.25,
            "cp_hybrid_share": 0.5,
            "cp_flops_imbalance": pytest.approx(1.2),
        }
    ]
    assert trainer._cp_stats == []


def _named(device: str) -> CPProfile:
    return CPProfile(
        lengths=FLAT.lengths,
        tflops=FLAT.tflops,
        tile=128,
        device=device,
        backend="torch_varlen",
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
    )


def test_a_shipped_gpu_profile_is_found_by_device_name_then_family(monkeypatch):
    from torchtitan_wlb.cp import profile as profile_mod

    sxm, h200 = _named("NVIDIA H100 80GB HBM3"), _named("NVIDIA H200")
    shipped = [profile_mod.default_profile(), h200, sxm]
    monkeypatch.setattr(profile_mod, "packaged_profiles", lambda: shipped)
    assert profile_mod.packaged_profile_for("NVIDIA H100 80GB HBM3") is sxm
    assert profile_mod.packaged_profile_for("nvidia h200 ") is h200  # case, spaces
    assert profile_mod.packaged_profile_for("NVIDIA H100 PCIe") is sxm  # same family
    assert profile_mod.packaged_profile_for("NVIDIA A100-SXM4-80GB") is None
    assert profile_mod.packaged_profile_for("cpu") is None  # the CPU table is never "found"
    assert [
        profile_mod.gpu_family(n) for n in ("NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "cpu")
    ] == ["H100", "A100", None]


def test_every_shipped_profile_loads_and_the_cpu_default_is_among_them():
    from torchtitan_wlb.cp.profile import default_profile, packaged_profile_for, packaged_profiles

    shipped, cpu = packaged_profiles(), default_profile()
    assert [(p.device, p.lengths) for p in shipped].count((cpu.device, cpu.lengths)) == 1
    assert all(p.device for p in shipped)
    assert packaged_profile_for("NVIDIA Z999 (no such GPU)") is None
