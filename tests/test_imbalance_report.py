"""tools/imbalance_report: the plan's imbalance (the run's own fit) apart from the timing noise."""

import json

import numpy as np
import pytest

from torchtitan_wlb.tools import e2e_bench, imbalance_report

A, B, G, C = 1e-7, 1e-5, 3e-5, 1e-3


def _cp_records(noise=None, steps=(3, 4, 5)):
    """2 CP ranks, ``steps`` of 4 micro-batches; rank times exactly ``A sq + B local + G gathered +
    C`` times a step's common slow-down (and ``noise`` per record, if given)."""
    rng = np.random.default_rng(0)
    mbs = []
    for step in steps:
        slow = 1.0 + 0.1 * step
        for rank in (0, 1):
            for i in range(4):
                sq, local, gathered = 1e5 * (1 + i), 100.0 + 50 * rank, 200.0 + 10 * i
                t = (A * sq + B * local + G * gathered + C) * slow
                if noise is not None:
                    t *= 1.0 + noise * rng.standard_normal()
                mbs.append(
                    {
                        "doc_lens": [10 + i, 20],
                        "seconds": t,
                        "device_s": t,
                        "step": step,
                        "rank": rank,
                        "fit_features": [sq, local, gathered],
                    }
                )
    return {"microbatches": mbs, "steps": [], "layout": {"cp": 2}}


def test_exact_times_leave_no_residual_and_the_plan_imbalance_is_measured():
    out = imbalance_report.report(_cp_records())
    assert out["micro_batches"] == 12
    assert out["residual_spread"] == pytest.approx(0.0, abs=1e-9)
    assert out["fit_mean_abs_error"] < 0.06  # one fit for all steps: the slow-down is not in it
    assert out["fitted"] == pytest.approx(out["measured"], rel=1e-6)
    # The ranks' fitted costs: rank 1 holds 50 more local tokens in every micro-batch.
    t = [
        [A * 1e5 * (1 + i) + B * (100 + 50 * r) + G * (200 + 10 * i) + C for r in (0, 1)]
        for i in range(4)
    ]
    spread = [max(x) / np.mean(x) for x in t]
    assert out["rank_spread_mean"] == pytest.approx(np.mean(spread), rel=1e-3)
    slowest = [max(x) for x in t]
    assert out["measured"] == pytest.approx(max(slowest) / np.mean(slowest), rel=1e-9)


def test_fitted_whole_prices_micro_batches_as_the_packer_does():
    """``fitted_whole``: the run's fit on whole micro-batches, ranks even, documents local up to
    hybrid's 512-token floor (CP = 2) and gathered beyond; all gathered when no rank held a local
    token. Exact times on independent features: the fit is A, B, G, C."""
    lens = [[300, 400 + 100 * i] for i in range(4)]  # 400, 500 local; 600, 700 gathered

    def records(local_of):
        mbs = []
        for rank, i in ((r, i) for r in (0, 1) for i in range(4)):
            sq, local, gathered = 1e5 * (1 + i), local_of(rank, i), 200.0 + 30 * i * i + 40 * rank
            t = A * sq + B * local + G * gathered + C
            mbs.append(
                {
                    "doc_lens": lens[i],
                    "seconds": t,
                    "device_s": t,
                    "step": 3,
                    "rank": rank,
                    "fit_features": [sq, local, gathered],
                }
            )
        return {"microbatches": mbs, "steps": [], "layout": {"cp": 2}}

    def whole(d, local_max):
        d = np.asarray(d, float)
        local = d[d <= local_max].sum()
        return (A * d @ d + B * local + G * (d.sum() - local)) / 2 + C

    out = imbalance_report.report(records(lambda rank, i: 100.0 + 50 * rank + 20 * i * i))
    costs = [whole(d, 512) for d in lens]
    assert out["fitted_whole"] == pytest.approx(max(costs) / np.mean(costs), rel=1e-6)
    assert out["fitted"] != pytest.approx(out["fitted_whole"], rel=1e-3)  # the CP plans' part
    # Per-document sharding: no local token anywhere, every document priced as gathered.
    out = imbalance_report.report(records(lambda rank, i: 0.0))
    costs = [whole(d, 0) for d in lens]
    assert out["fitted_whole"] == pytest.approx(max(costs) / np.mean(costs), rel=1e-6)


def test_noise_shows_as_residual_spread():
    # 5 % noise on each rank's time; a micro-batch takes its slower rank's, so a little less.
    out = imbalance_report.report(_cp_records(noise=0.05, steps=range(3, 40)))
    assert 0.02 < out["residual_spread"] < 0.06
    assert out["measured"] > 1.0 and out["fitted"] > 1.0


def test_floor_and_pipeline_records():
    # Floor: identical micro-batches; their spread within a step is the noise.
    times = {3: [1.0, 1.1, 0.9, 1.0], 4: [2.0, 2.0, 2.0, 2.0]}
    floor = {
        "microbatches": [
            {"doc_lens": [5, 5], "device_s": t, "seconds": t, "step": s, "rank": 0}
            for s, ts in times.items()
            for t in ts
        ],
        "layout": {"cp": 1},
    }
    out = imbalance_report.floor_report(floor)
    dev = np.array([0.0, 0.1, -0.1, 0.0, 0, 0, 0, 0])
    assert out["residual_spread"] == pytest.approx(float(np.std(dev)))
    assert out["measured"] == pytest.approx((1.1 + 2.0) / (1.0 + 2.0))
    # PP: one fit per stage, the imbalance of each stage apart.
    mbs = []
    for stage, (a, b) in enumerate([(1e-7, 1e-5), (2e-7, 5e-6)]):
        for mb, lens in enumerate([[100, 300], [50], [400]]):
            d = np.array(lens, float)
            t = a * d @ d + b * d.sum()
            mbs.append(
                {
                    "doc_lens": lens,
                    "device_s": t,
                    "seconds": t,
                    "step": 3,
                    "rank": stage,
                    "stage": stage,
                    "mb": mb,
                }
            )
    out = imbalance_report.report({"microbatches": mbs, "layout": {"pp": 2}})
    assert out["residual_spread"] == pytest.approx(0.0, abs=1e-9)
    assert out["fitted"] == pytest.approx(out["measured"], rel=1e-6)
    per_stage = [
        [a * np.dot(x, x) + b * sum(x) for x in ([100, 300], [50], [400])]
        for a, b in [(1e-7, 1e-5), (2e-7, 5e-6)]
    ]
    expect = sum(max(s) for s in per_stage) / sum(np.mean(s) for s in per_stage)
    assert out["measured"] == pytest.approx(expect)


def test_cli_reads_e2e_bench_records(tmp_path, capsys):
    e2e_bench.write_records(tmp_path, {"wlb_online": _cp_records(0.02)}, "cp2", "tiny")
    assert imbalance_report.main([str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"wlb_online"} and "rank_spread_p95" in out["wlb_online"]
    assert imbalance_report.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("wlb_online   measured")


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required"),
        (["{empty}"], "holds no records_<mode>.json"),
        (["{full}", "--from-step", "99"], "no micro-batch recorded from step 99 on"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    e2e_bench.write_records(tmp_path / "full", {"wlb": _cp_records()}, "cp2", "tiny")
    argv = [a.format(empty=tmp_path / "empty", full=tmp_path / "full") for a in argv]
    with pytest.raises(SystemExit) as exc:
        imbalance_report.main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and message in err


def test_dp_ranks_micro_batches_are_their_own():
    # DP = 2: each rank trains its own micro-batches; a step's imbalance pools them (as
    # e2e_bench's measured_imbalance does), never a max over ranks.
    times = {0: [1.0, 2.0], 1: [3.0, 2.0]}
    mbs = [
        {"doc_lens": [10 * (i + 1)], "device_s": t, "seconds": t, "step": 3, "rank": r}
        for r, ts in times.items()
        for i, t in enumerate(ts)
    ]
    out = imbalance_report.floor_report({"microbatches": mbs, "layout": {"dp": 2}})
    assert out["micro_batches"] == 4 and out["measured"] == pytest.approx(3.0 / 2.0)
