"""e2e_bench: its measures on synthetic logs, and one real (small) whole-pass run."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from torchtitan_wlb.tools import analysis, e2e_bench


def test_measured_imbalance_is_time_weighted_per_layout():
    # Two steps, two ranks. Without PP or CP the ranks' micro-batches are pooled per step.
    logs = [
        {1: {"micro_batch_times_s": [1.0, 3.0]}, 2: {"micro_batch_times_s": [1.0, 1.0]}},
        {1: {"micro_batch_times_s": [2.0, 2.0]}, 2: {"micro_batch_times_s": [1.0, 1.0]}},
    ]
    # step 1: max 3, mean 2; step 2: max 1, mean 1 -> (3 + 1) / (2 + 1)
    assert analysis.measured_imbalance(logs, [1, 2], "dp2") == pytest.approx(4 / 3)
    # CP: a micro-batch takes its slowest rank's time: step 1 [2, 3] -> 3 / 2.5
    assert analysis.measured_imbalance(logs, [1], "cp2") == pytest.approx(3 / 2.5)
    pp = [{1: {"pp_actions": [{"fwd_s": [[1.0, 2.0]], "bwd_s": [[1.0, 4.0]]}]}}]
    assert analysis.measured_imbalance(pp, [1], "pp2") == pytest.approx(6 / 4)


def test_floor_half_gap_compares_the_two_halves_of_the_timed_steps():
    """Steps 1-2 balanced, 3-4 at 2 / 1.5: the gap is 1/3 whichever half is worse; the device
    clock's variant reads the device seconds; an odd count puts the middle step in the later half."""
    even = {"micro_batch_times_s": [1.0, 1.0], "micro_batch_device_times_s": [2.0, 2.0]}
    odd = {"micro_batch_times_s": [1.0, 2.0], "micro_batch_device_times_s": [2.0, 2.0]}
    logs = [{1: even, 2: even, 3: odd, 4: odd}]
    assert analysis.half_gap(logs, [1, 2, 3, 4], "dp2") == pytest.approx(1 / 3)
    assert analysis.half_gap(logs, [3, 4, 1, 2], "dp2") == pytest.approx(1 / 3)
    assert analysis.half_gap(logs, [1, 2, 3, 4], "dp2", device=True) == pytest.approx(0.0)
    # [1] against [2, 3]: 1.0 against (1 + 2) / (1 + 1.5)
    assert analysis.half_gap(logs, [1, 2, 3], "dp2") == pytest.approx(3 / 2.5 - 1.0)
    assert analysis.half_gap(logs, [1], "dp2") is None


def test_device_clock_figures_read_the_device_times():
    """The device-clock variants read the device seconds, the existing keys the wall times."""
    rec = {
        "micro_batch_times_s": [1.0, 3.0],
        "micro_batch_device_times_s": [1.0, 1.0],
        "micro_batch_doc_lens": [[2, 3], [4]],
        "wlb/step_time_s": 4.0,
    }
    logs = [{1: rec}]
    assert analysis.measured_imbalance(logs, [1], "dp2") == pytest.approx(1.5)
    assert analysis.measured_imbalance(logs, [1], "dp2", device=True) == pytest.approx(1.0)
    act = {
        "stages": [0],
        "fwd_s": [[1.0, 2.0]],
        "bwd_s": [[1.0, 4.0]],
        "doc_lens": [[2], [3]],
        "fwd_device_s": [[1.0, 1.0]],
        "bwd_device_s": [[2.0, 2.0]],
    }
    pp = [{1: {"pp_actions": [act], "wlb/step_time_s": 7.0}}]
    assert analysis.measured_imbalance(pp, [1], "pp2", device=True) == pytest.approx(1.0)
    mbs = e2e_bench.calibration_records(logs, [1])["microbatches"]
    assert [(m["seconds"], m["device_s"]) for m in mbs] == [(1.0, 1.0), (3.0, 1.0)]
    assert "fit_features" not in mbs[0]
    with_features = [{1: {**rec, "micro_batch_fit_features": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]}}]
    cp_mbs = e2e_bench.calibration_records(with_features, [1])["microbatches"]
    assert [m["fit_features"] for m in cp_mbs] == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    # a = 0, b = 0, c = 1 predicts the device seconds exactly, the wall times off by 2/3 on one
    assert analysis.fit_error(mbs, [0.0, 0.0, 1.0], cp=1, key="device_s") == 0.0
    assert analysis.fit_error(mbs, [0.0, 0.0, 1.0], cp=1) == pytest.approx(1 / 3)
    [first, second] = e2e_bench.calibration_records(pp, [1])["microbatches"]
    assert (first["seconds"], first["device_s"], second["bwd_device_s"]) == (2.0, 3.0, 2.0)
    # Two stages of one micro-batch: the fit's row is their sum.
    other_stage = {**act, "stages": [1], "fwd_device_s": [[0.5, 0.5]], "bwd_device_s": [[1.0, 1.0]]}
    pp2 = [
        {1: {"pp_actions": [act], "wlb/step_time_s": 7.0}},
        {1: {"pp_actions": [other_stage], "wlb/step_time_s": 7.0}},
    ]
    totals = analysis.stage_totals(e2e_bench.calibration_records(pp2, [1])["microbatches"])
    assert [(t["doc_lens"], t["device_s"]) for t in totals] == [([2], 4.5), ([3], 4.5)]


def test_speedups_are_time_to_train_ratios():
    res = {
        "plain_4d": {"time_to_train_s": 30.0, "step_time_s": 1.0, "peak_mem_mb": 100.0},
        "wlb": {"time_to_train_s": 20.0, "step_time_s": 0.5, "peak_mem_mb": 110.0},
    }
    out = e2e_bench.speedups(res)
    assert out["speedup_wlb_vs_plain"] == pytest.approx(1.5)
    assert out["median_step_speedup_wlb_vs_plain"] == pytest.approx(2.0)
    assert out["mem_wlb_vs_plain"] == pytest.approx(1.1)
    assert "speedup_wlb_vs_fixed" not in out


def test_balance_loss_is_measured_time_over_the_balanced_pipeline():
    # One step, PP = 2, m = 2. Stage 1 is the busier (3 + 1 = 4 s): a balanced 1F1B takes
    # 4 x (m + pp - 1) / m = 6 s, the step took 7.5 s.
    mbs = [
        {"step": 5, "stage": st, "mb": j, "seconds": t}
        for st, j, t in ((0, 0, 1.0), (0, 1, 2.0), (1, 0, 3.0), (1, 1, 1.0))
    ]
    records = {
        "microbatches": mbs,
        "steps": [{"step": 5, "seconds": 7.5}, {"step": 9, "seconds": 9.0}],
    }
    assert analysis.pipeline_balance_loss(records) == pytest.approx(7.5 / 6.0)
    even = [dict(mb, seconds=2.0) for mb in mbs]  # equal micro-batches: nothing left to save
    assert (
        analysis.pipeline_balance_loss(
            {"microbatches": even, "steps": [{"step": 5, "seconds": 6.0}]}
        )
        == 1.0
    )


def test_predicted_imbalance_weighs_each_step_by_its_time_not_its_units():
    """Under the online cost model the first steps are priced in FLOPs and the later ones in
    seconds: each step's own max/mean counts by its measured time, so the FLOP-priced steps (10^9
    times larger) do not stand for the pass."""
    flops = {"wlb/max_workload": 1.10e12, "wlb/mean_workload": 1.0e12}  # 1.10 apart
    seconds = {"wlb/max_workload": 0.102, "wlb/mean_workload": 0.1}  # 1.02 apart
    got = analysis.predicted_imbalance([flops, seconds, seconds, seconds], [1.0, 1.0, 1.0, 1.0])
    assert got == pytest.approx((1.10 + 3 * 1.02) / 4)
    assert analysis.predicted_imbalance([flops, seconds], [1.0, 3.0]) == pytest.approx(
        (1.10 + 3 * 1.02) / 4
    )
    # Steps without a plan's workloads (a loader that does not pack) are left out.
    assert analysis.predicted_imbalance([{}, seconds], [5.0, 1.0]) == pytest.approx(1.02)
    assert analysis.predicted_imbalance([{}], [1.0]) == 1.0


def test_short_whole_passes_are_flagged():
    results = {"plain_4d": {"steps": 45}, "wlb": {"steps": 39}}
    (line,) = e2e_bench.short_passes(results)
    assert line.startswith("warning: wlb trained the set in 39 steps (< 40)")
    assert e2e_bench.short_passes({"wlb": {"steps": 40}}) == []


def test_floor_documents_cost_what_a_typical_micro_batch_does():
    """The floor's micro-batches: k identical documents, k the workload's typical documents per
    context (token-weighted), so that fixed-time effects weigh as much as in the modes' runs."""
    lens = np.array([400] * 10)  # token-weighted mean 400: 5 per 2048-token context
    assert e2e_bench.floor_doc_len(lens, 2048) == 409
    assert e2e_bench.floor_doc_len(np.array([2048, 2048]), 2048) == 2048
    assert e2e_bench.floor_doc_len(np.array([1, 3, 2]), 2048) == 2048 // 44  # k + 1 never fits
    assert e2e_bench.floor_doc_len(lens, 2048, asked=2048) == 2048  # the full-context floor
    # The floor's S_max holds k of its documents, not k + 1; the modes keep theirs.
    args = e2e_bench.parser().parse_args(["--context-len", "2048"])
    assert e2e_bench.micro_batch_max_len(e2e_bench.FLOOR, args, 409) == 2453
    assert e2e_bench.micro_batch_max_len(e2e_bench.FLOOR, args, 2048) == 2560
    assert e2e_bench.micro_batch_max_len("wlb", args, 409) == 2560
    with pytest.raises(SystemExit):
        e2e_bench.main(["--floor-doc-len", "5000", "--context-len", "2048"])


@pytest.mark.parametrize("value", ["0", "many", "-3"])
def test_bad_steps(value, capsys):
    with pytest.raises(SystemExit) as exc:
        e2e_bench.main(["--steps", value])
    assert exc.value.code == 2
    assert "a positive integer or 'epoch'" in capsys.readouterr().err


def test_fit_error_is_mean_absolute_relative_error():
    mbs = [{"doc_lens": [2, 3], "seconds": 2.0}, {"doc_lens": [4], "seconds": 4.0}]
    # a=0.1, b=0.2, c=0.5: [2,3] -> 0.1*13 + 0.2*5 + 0.5 = 2.8; [4] -> 1.6 + 0.8 + 0.5 = 2.9
    err = analysis.fit_error(mbs, [0.1, 0.2, 0.5], cp=1)
    assert err == pytest.approx((0.8 / 2 + 1.1 / 4) / 2)
    # Under CP a rank does 1/cp of the document work; the fixed cost is per rank.
    assert analysis.fit_error(mbs, [0.2, 0.4, 0.5], cp=2) == pytest.approx(err)
    # A record with the trainer's CP features (Σd² share, local, gathered tokens) is judged on
    # them: 0.1*10 + 0.2*1 + 0.3*2 + 0.5 = 2.3 against 2.0, also without g (b for both): 2.1.
    cp_mb = [{"doc_lens": [2, 3], "seconds": 2.0, "fit_features": [10.0, 1.0, 2.0]}]
    assert analysis.fit_error(cp_mb, [0.1, 0.2, 0.5, 0.3], cp=2) == pytest.approx(0.15)
    assert analysis.fit_error(cp_mb, [0.1, 0.2, 0.5], cp=2) == pytest.approx(0.05)


def test_in_use_error_judges_each_step_by_the_model_that_packed_it():
    mbs = [{"step": s, "doc_lens": [4], "seconds": t} for s, t in ((2, 9.0), (3, 1.0), (5, 2.0))]
    # The model adopted for step 3 predicts 1.0 (c = 1), the one for step 5 on 2.0 (b = 0.5):
    # exact where each packed; the starting model's step 2 is left out.
    adoptions = [(3, [0.0, 0.0, 1.0]), (5, [0.0, 0.5, 0.0])]
    assert analysis.in_use_error(mbs, adoptions, cp=1) == 0.0
    # The last model alone misses step 3 by 100 % (and step 2 by 7/9).
    assert analysis.fit_error(mbs[1:], [0.0, 0.5, 0.0], cp=1) == pytest.approx(0.5)
    # Weighted by micro-batches: step 3's 100 % error over three micro-batches of which one is off.
    adoptions = [(3, [0.0, 0.5, 0.0])]
    two = mbs + [{"step": 4, "doc_lens": [4], "seconds": 2.0}]
    assert analysis.in_use_error(two, adoptions, cp=1) == pytest.approx(1 / 3)
    assert math.isnan(analysis.in_use_error(mbs[:1], adoptions, cp=1))
    # Under PP the stage totals keep their step.
    act = {
        "stages": [0],
        "fwd_s": [[1.0]],
        "bwd_s": [[1.0]],
        "doc_lens": [[2]],
        "fwd_device_s": [[1.0]],
        "bwd_device_s": [[1.0]],
    }
    pp = [{7: {"pp_actions": [act], "wlb/step_time_s": 3.0}}]
    [total] = analysis.stage_totals(e2e_bench.calibration_records(pp, [7])["microbatches"])
    assert total["step"] == 7


def test_best_constant_error_is_the_least_any_one_prediction_attains():
    assert analysis.best_constant_error(np.full(5, 0.3)) == 0.0
    # [1, 2]: m = 1 errs (0 + 1/2) / 2 = 0.25, m = 2 errs (1 + 0) / 2 = 0.5.
    assert analysis.best_constant_error(np.array([2.0, 1.0])) == pytest.approx(0.25)
    t = np.random.default_rng(0).lognormal(0.0, 0.2, 101)
    best = analysis.best_constant_error(t)
    grid = np.linspace(t.min(), t.max(), 4001)
    assert best == pytest.approx(min(np.mean(np.abs(m - t) / t) for m in grid), rel=1e-3)
    assert math.isnan(analysis.best_constant_error(np.array([])))


def test_window_constant_error_predicts_each_step_from_the_window_before():
    # Steps 1..6, every micro-batch of step s takes s seconds (two a step); window 2, lag 1:
    # step 3 is predicted from steps 1-2 by Σ(1/t) / Σ(1/t²) = (2 + 1) / (2 + 1/2) = 1.2.
    steps = np.repeat(np.arange(1, 7), 2)
    t = steps.astype(float)
    err = analysis.window_constant_error(t, steps, window=2, lag=1)
    expect = [
        abs((1 / a + 1 / b) / (1 / a**2 + 1 / b**2) - s) / s
        for s, a, b in ((3, 1, 2), (4, 2, 3), (5, 3, 4), (6, 4, 5))
    ]
    assert err == pytest.approx(np.mean(expect))
    # Identical times: a constant predicts them exactly; no step with a full window: NaN.
    assert analysis.window_constant_error(np.ones(12), steps, window=2, lag=2) == 0.0
    assert math.isnan(analysis.window_constant_error(t, steps, window=6, lag=1))


def test_fit_error_floor_reads_the_floor_as_the_fit_has_its_rows():
    args = argparse.Namespace(parallel="cp2", fit_window=2)
    rows = [
        {"step": s, "device_s": 1.0 + 0.1 * (i % 2), "seconds": 2.0, "doc_lens": [8]}
        for s in range(3, 8)
        for i in range(4)
    ]
    out = analysis.fit_error_floor(rows, args.parallel, args.fit_window)
    assert out["fit_error_floor_wall"] == 0.0
    assert out["fit_error_floor"] == pytest.approx(
        analysis.best_constant_error(np.array([r["device_s"] for r in rows]))
    )
    assert 0.0 < out["fit_error_floor_in_use"] < 0.1
    # Under PP a row is a micro-batch's time summed over its stages.
    pp = [
        {"step": 3, "mb": mb, "stage": st, "device_s": 1.0 + mb, "seconds": 1.0, "doc_lens": [8]}
        for mb in range(2)
        for st in range(2)
    ]
    out = analysis.fit_error_floor(pp, "pp2", window=2)
    assert out["fit_error_floor"] == pytest.approx(
        analysis.best_constant_error(np.array([2.0, 4.0]))
    )
    assert analysis.fit_error_floor([], args.parallel, args.fit_window) == {}


def test_runs_alternate_the_modes_order_after_the_floor():
    data = Path("docs.jsonl")
    jobs = [(e2e_bench.FLOOR, "", data), ("wlb", "", data), ("wlb_online", "", data)]
    first, second, third = (e2e_bench.run_order(jobs, run) for run in range(3))
    assert [j[0] for j in first] == [j[0] for j in third] == ["floor", "wlb", "wlb_online"]
    assert [j[0] for j in second] == ["floor", "wlb_online", "wlb"]
    shardings = [("wlb", "hybrid", data), ("wlb", "per_document", data)]
    assert [e2e_bench.label_of(j) for j in e2e_bench.run_order(shardings, 1)] == [
        "wlb+per_document",
        "wlb+hybrid",
    ]


def test_imbalance_over_floor_per_mode_and_clock():
    floor = {"measured_imbalance": 1.05, "measured_imbalance_device": 1.02}
    res = {
        "wlb": {"measured_imbalance": 1.10, "measured_imbalance_device": 1.07},
        "wlb_online": {"measured_imbalance": 1.06, "measured_imbalance_device": 1.035},
    }
    assert e2e_bench.over_floor(res, floor) == pytest.approx(
        {
            "imbalance_over_floor_wlb": 0.05,
            "imbalance_over_floor_device_wlb": 0.05,
            "imbalance_over_floor_wlb_online": 0.01,
            "imbalance_over_floor_device_wlb_online": 0.015,
        }
    )


def test_across_runs_gives_the_mean_and_its_t_interval():
    runs = [{"modes": {}, "x": v, "k": 7} for v in (1.0, 2.0, 3.0)]
    out = analysis.across_runs(runs)
    half = 4.303 * 1.0 / math.sqrt(3)  # t(2 df) x sample sd / sqrt(n)
    assert out["x"] == 2.0 and (out["x_min"], out["x_max"]) == (1.0, 3.0)
    assert (out["x_ci95_low"], out["x_ci95_high"]) == pytest.approx((2.0 - half, 2.0 + half))
    assert (out["k_ci95_low"], out["k_ci95_high"]) == (7.0, 7.0)
    assert "modes" not in out
    # One run: the figure alone, no spread to show.
    assert analysis.across_runs(runs[:1]) == {"x": 1.0, "k": 7.0}
    # A figure only some runs report (no refit adopted in the others): over those, counted.
    runs[1]["fit"] = 0.03
    out = analysis.across_runs(runs)
    assert out["fit"] == 0.03 and out["fit_runs"] == 1 and "fit_ci95_low" not in out
    assert "x_runs" not in out


def test_per_run_figures_name_each_mode():
    res = {
        "wlb": {"time_to_train_s": 30.0, "docs_trained": 9, "docs_repeated": 0, "steps": 4},
        "wlb_online": {"time_to_train_s": 28.0, "fit_mean_abs_error_in_use": 0.03},
    }
    assert e2e_bench.per_run_figures(res) == {
        "time_to_train_s_wlb": 30.0,
        "docs_trained_wlb": 9.0,
        "docs_repeated_wlb": 0.0,
        "time_to_train_s_wlb_online": 28.0,
        "fit_mean_abs_error_in_use_wlb_online": 0.03,
    }


def test_every_run_is_checked_for_exactly_once():
    ok = {"docs_trained": 5, "docs_repeated": 0}
    runs = [
        {"modes": {"wlb": ok, "wlb_online": ok}},
        {"modes": {"wlb": {"docs_trained": 4, "docs_repeated": 0}, "wlb_online": ok}},
        {"modes": {"wlb": ok, "wlb_online": {"docs_trained": 5, "docs_repeated": 1}}},
    ]
    assert e2e_bench.not_exactly_once(runs, 5) == [
        "error: run 2: wlb trained 4 of 5 documents, 0 repeated",
        "error: run 3: wlb_online trained 5 of 5 documents, 1 repeated",
    ]
    assert e2e_bench.not_exactly_once(runs[:1], 5) == []


@pytest.mark.parametrize(
    "df, exact", [(1, 12.706), (10, 2.228), (30, 2.042), (40, 2.021), (60, 2.000), (120, 1.980)]
)
def test_t95_matches_the_tables(df, exact):
    assert analysis.t95(df) == pytest.approx(exact, abs=1e-3)


def test_t95_rejects_no_degrees_of_freedom():
    with pytest.raises(ValueError, match="degrees of freedom must be >= 1, got 0"):
        analysis.t95(0)


def test_modes_and_the_floor_run_set_the_trainer_flags():
    args = e2e_bench.parser().parse_args(["--cost-model", "online", "--fit-window", "4"])
    assert e2e_bench.mode_args("wlb", args)[:4] == [
        "--wlb.mode",
        "wlb",
        "--wlb.cost_model",
        "online",
    ]
    assert "--wlb.online.window_steps" in e2e_bench.mode_args("wlb_online", args)
    assert e2e_bench.mode_args(e2e_bench.FLOOR, args)[:2] == ["--wlb.packing", "original"]


@pytest.mark.slow
def test_whole_pass_trains_every_document_once(capsys, tmp_path):
    # wlb with the online cost model: the whole pass, and refits on the way; a short floor first.
    args = ["--parallel", "cp2", "--modes", "wlb_online", "--context-len", "512"]
    args += ["--micro-batches", "4", "--num-docs", "120", "--scale-from", "8192", "--json"]
    args += ["--floor-steps", "3", "--fit-warmup", "1", "--fit-window", "2", "--fit-interval", "1"]
    args += ["--records-out", str(tmp_path)]
    assert e2e_bench.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    wlb = out["modes"]["wlb_online"]
    assert wlb["refits"] >= 1
    assert len(wlb["refits_effective_steps"]) == wlb["refits_adopted"]
    assert all(s > 1 for s in wlb["refits_effective_steps"])
    # Each step after the first adoption is predicted by the model that packed it.
    assert wlb["refits_adopted"] >= 1 and 0.0 <= wlb["fit_mean_abs_error_in_use"] < 10.0
    assert out["steps"] == "epoch" and out["documents"]["count"] == 120
    assert wlb["docs_trained"] == 120 and wlb["docs_repeated"] == 0
    assert wlb["steps"] >= 3 and wlb["time_to_train_s"] == pytest.approx(sum(wlb["step_times_s"]))
    assert wlb["measured_imbalance"] >= 1.0 and wlb["predicted_imbalance"] >= 1.0
    assert wlb["tokens_per_s"] > 0 and wlb["peak_mem_mb"] > 0
    # adaptive CP: the shares of micro-batches planned per-document and hybrid
    assert 0.0 <= wlb["cp_per_document_share"] <= 1.0 and 0.0 <= wlb["cp_hybrid_share"] <= 1.0
    assert wlb["cp_per_document_share"] + wlb["cp_hybrid_share"] <= 1.0
    assert 1.0 <= out["measured_imbalance_floor"] < 2.0
    assert out["docs_trained_wlb_online"] == 120 and out["docs_repeated_wlb_online"] == 0
    assert out["time_to_train_s_wlb_online"] == pytest.approx(wlb["time_to_train_s"])
    for clock in ("", "_device"):
        assert out[f"imbalance_over_floor{clock}_wlb_online"] == pytest.approx(
            wlb[f"measured_imbalance{clock}"] - out[f"measured_imbalance_floor{clock}"]
        )
    # --records-out: the mode's measured micro-batches, and the floor's identical ones.
    mode_records = json.loads((tmp_path / "records_wlb_online.json").read_text())
    assert len(mode_records["microbatches"]) >= 2 * 4 and mode_records["layout"]["cp"] == 2
    floor = json.loads((tmp_path / "records_floor.json").read_text())["microbatches"]
    floor_len = int(out["floor_doc_len"])
    assert {tuple(mb["doc_lens"]) for mb in floor} == {(floor_len,) * (512 // floor_len)}
    assert len(floor) == 2 * 4 * (3 - 2)  # two CP ranks, 4 micro-batches, the steps past warm-up
    assert "floor_half_gap" not in out  # one timed floor step: no halves to compare
    # The fit error's floor: the floor's identical micro-batches predicted by one constant (one
    # timed step: no window before it to predict from).
    assert 0.0 <= out["fit_error_floor"] < 1.0 and 0.0 <= out["fit_error_floor_wall"] < 1.0
    assert out["fit_error_floor_in_use"] is None  # NaN: written as null (strict JSON)


def test_cp_sharding_speedups_compare_against_the_first_sharding():
    res = {
        "wlb+per_document": {"time_to_train_s": 30.0, "step_time_s": 1.0},
        "wlb+hybrid": {"time_to_train_s": 24.0, "step_time_s": 0.8},
    }
    out = e2e_bench.sharding_speedups(res, ["wlb"], ["per_document", "hybrid"])
    assert out == {
        "speedup_hybrid_vs_per_document": pytest.approx(1.25),
        "median_step_speedup_hybrid_vs_per_document": pytest.approx(1.25),
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parallel", "cp2", "--cp-sharding", "per_document,ring"], "--cp-sharding"),
        (["--parallel", "cp2", "--cp-sharding", "hybrid,hybrid"], "distinct values"),
        (["--cp-sharding", "hybrid"], "needs --parallel cp2"),
    ],
)
def test_bad_cp_sharding(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        e2e_bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
