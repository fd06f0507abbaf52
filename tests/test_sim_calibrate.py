"""Calibration recovers known coefficients; wlb-analyze reports and recommends."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from torchtitan_wlb.cost_model import nnls
from torchtitan_wlb.models.catalogue import get_model
from torchtitan_wlb.sim import calibrate
from torchtitan_wlb.sim.analyze import length_histogram
from torchtitan_wlb.sim.analyze import main as analyze_main
from torchtitan_wlb.sim.fit import fit as fit_records
from torchtitan_wlb.sim.hardware import Layout
from torchtitan_wlb.sim.records import parse_records

A_TRUE, B_TRUE, C_TRUE = 3e-10, 2e-6, 0.004


def _synthetic_records(n_mb=60, noise=0.01, seed=0, steps=None):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n_mb):
        k = int(rng.integers(1, 30))
        lens = np.maximum(1, rng.lognormal(np.log(800), 1.2, size=k)).astype(np.int64)
        sec = A_TRUE * float((lens.astype(float) ** 2).sum()) + B_TRUE * lens.sum() + C_TRUE
        sec *= 1 + noise * rng.standard_normal()
        recs.append({"doc_lens": lens.tolist(), "seconds": sec, "step": i // 4 if steps else -1})
    return recs


def test_fit_recovers_known_coefficients():
    recs = parse_records(_synthetic_records(noise=0.0), "synthetic")
    fit = fit_records(recs)
    assert fit.attn_coef == pytest.approx(A_TRUE, rel=1e-6)
    assert fit.linear_coef == pytest.approx(B_TRUE, rel=1e-6)
    assert fit.overhead_s == pytest.approx(C_TRUE, rel=1e-6)
    assert fit.max_abs_rel_error < 1e-9
    noisy = fit_records(parse_records(_synthetic_records(noise=0.02), "synthetic"))
    assert noisy.attn_coef == pytest.approx(A_TRUE, rel=0.1)
    assert noisy.linear_coef == pytest.approx(B_TRUE, rel=0.1)
    assert 0.005 < noisy.mean_abs_rel_error < 0.05
    cm = noisy.cost_model()
    assert cm.unit == "seconds" and cm.break_even_length == pytest.approx(B_TRUE / A_TRUE, rel=0.2)


def test_nnls_never_returns_negative_coefficients():
    x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = np.array([-1.0, 2.0, 1.0])
    coef = nnls(x, y)
    assert np.all(coef >= 0)
    # Unconstrained least squares gives (-1, 2); with c0 pinned at 0 the optimum is c1 = 1.5.
    np.testing.assert_allclose(coef, [0.0, 1.5], atol=1e-9)


def test_hardware_from_fit_reproduces_the_throughput():
    model = get_model("7B")
    lay = Layout(tp=1, cp=1)
    fit = fit_records(parse_records(_synthetic_records(noise=0.0), "s"))
    hw = fit.hardware(model, lay)
    attn_flops_d2 = model.n_layers * 2 * model.head_dim * model.n_heads * (1 + hw.bwd_attn_factor)
    assert attn_flops_d2 / (hw.attn_tflops * 1e12) == pytest.approx(A_TRUE, rel=1e-6)


def test_step_prediction_and_cli(tmp_path, capsys):
    recs = _synthetic_records(n_mb=80, noise=0.01, steps=True)
    steps = {}
    for r in recs:
        steps[r["step"]] = steps.get(r["step"], 0.0) + r["seconds"]
    data = {
        "microbatches": recs,
        "steps": [{"step": s, "seconds": t + 0.05} for s, t in steps.items()],  # + optimizer
        "model": "7B",
        "layout": {"tp": 1, "cp": 1, "pp": 1, "dp": 1},
    }
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(data))
    rc = calibrate.main(
        ["--records", str(path), "--json", "--hardware-out", str(tmp_path / "hw.json")]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step_prediction"]["mean_abs_rel_error"] < 0.10
    assert out["step_prediction"]["step_overhead_s"] == pytest.approx(0.05, abs=0.02)
    assert (tmp_path / "hw.json").exists()


def test_calibration_bad_input(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"doc_lens": [10, 2.5], "seconds": 1.0}] * 3))
    assert calibrate.main(["--records", str(path)]) == 2
    err = capsys.readouterr().err
    assert "2.5" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------ analyze
def _lengths(n=4000, ctx=16384, seed=1):
    rng = np.random.default_rng(seed)
    body = rng.lognormal(np.log(500), 0.9, n)
    tail = rng.uniform(0.3 * ctx, 1.5 * ctx, n)
    return np.clip(np.where(rng.random(n) < 0.03, tail, body), 1, None).astype(np.int64)


def test_histogram_shares_sum_to_one():
    rows = length_histogram(_lengths(), 16384)
    assert sum(r["token_share"] for r in rows) == pytest.approx(1.0)
    assert sum(r["docs"] for r in rows) == 4000


def test_analyze_cli(tmp_path, capsys):
    path = tmp_path / "l.npy"
    np.save(path, _lengths())
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    plot_args = ["--plot", str(tmp_path / "plots")] if has_mpl else []
    layout = ["--context-len", "16384", "--model", "550M", "--steps", "12"]
    layout += ["--tp", "1", "--cp", "2", "--pp", "2", "--dp", "1"]
    rc = analyze_main(["--lengths", str(path), *layout, "--no-simulate", "--json", *plot_args])
    assert rc == 0
    if plot_args:
        assert (tmp_path / "plots" / "length_histogram.png").stat().st_size > 5000
    captured = capsys.readouterr().out
    out = json.loads(captured.strip().splitlines()[-1])
    assert set(out["packers"]) == {"original", "fixed_greedy", "wlb_paper", "wlb"}
    rec = out["recommended"]
    assert rec["micro_batch_max_len"] >= 16384
    assert np.all(np.diff(rec["queue_thresholds"]) > 0)
    assert "[wlb]" in captured and "queue_thresholds" in captured
    assert out["packers"]["wlb"]["imbalance"] <= out["packers"]["original"]["imbalance"]


def test_analyze_bad_lengths(tmp_path, capsys):
    path = tmp_path / "l.txt"
    path.write_text("12\n3.7\n")
    assert analyze_main(["--lengths", str(path), "--no-simulate"]) == 2
    err = capsys.readouterr().err
    assert "'3.7'" in err and "Traceback" not in err


def test_analyze_reads_a_local_dataset(tmp_path, capsys):
    path = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(0)
    sizes = np.where(rng.random(400) < 0.05, 6000, rng.integers(20, 800, 400))
    path.write_text("\n".join(json.dumps({"text": "a" * int(n)}) for n in sizes) + "\n")
    layout = ["--context-len", "8192", "--model", "550M", "--steps", "6"]
    layout += ["--tp", "1", "--cp", "1", "--pp", "2", "--dp", "1"]
    rc = analyze_main(["--dataset", str(path), *layout, "--no-simulate", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["documents"] == 400
    assert out["max_len"] >= 6000  # byte tokens of the longest text (plus BOS/EOS)


def test_standalone_records_are_fitted_and_steps_held_out(tmp_path, capsys):
    standalone = _synthetic_records(n_mb=30, noise=0.01, seed=3)
    in_steps = _synthetic_records(n_mb=40, noise=0.01, seed=4, steps=True)
    steps: dict[int, float] = {}
    for r in in_steps:
        steps[r["step"]] = steps.get(r["step"], 0.0) + r["seconds"]
    path = tmp_path / "calib.json"
    path.write_text(
        json.dumps(
            {
                "microbatches": standalone + in_steps,
                "steps": [{"step": s, "seconds": t} for s, t in steps.items()],
            }
        )
    )
    assert calibrate.main(["--records", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["records"] == 30 and out["fitted_on"] == "standalone micro-batches"
    assert out["heldout_mb_mean_abs_rel_error"] < 0.05
    assert out["step_prediction"]["mean_abs_rel_error"] < 0.05


# ------------------------------------------------------------------------ pipeline (PP) records
def _pp_records(n_steps=10, m=8, pp=2, seed=0, overhead=0.05, noise=0.01):
    """Per-stage actions of a PP run (the e2e_bench --parallel pp2 format) and its step times,
    generated by the 1F1B timeline from known per-stage costs."""
    from torchtitan_wlb.sim.timeline import build_schedule, simulate_pipeline

    rng = np.random.default_rng(seed)
    coef = {"fwd": (1e-9, 2e-6, 0.003), "bwd": (2e-9, 4e-6, 0.004)}
    recs, steps = [], []
    for s in range(n_steps):
        lens = [
            np.maximum(1, rng.lognormal(np.log(600), 1.3, int(rng.integers(1, 20)))).astype(int)
            for _ in range(m)
        ]
        t = {}
        for kind, (a, b, c) in coef.items():
            base = np.array(
                [a * float((x.astype(float) ** 2).sum()) + b * x.sum() + c for x in lens]
            )
            t[kind] = base[None, :] * (1 + noise * rng.standard_normal((pp, m)))
        res = simulate_pipeline(build_schedule(pp, m, 1), t["fwd"][None], t["bwd"][None])
        steps.append({"step": s, "seconds": float(res.makespan[0]) + overhead})
        for k in range(pp):
            for j in range(m):
                f, b = float(t["fwd"][k, j]), float(t["bwd"][k, j])
                recs.append(
                    {
                        "doc_lens": lens[j].tolist(),
                        "seconds": f + b,
                        "fwd_s": f,
                        "bwd_s": b,
                        "stage": k,
                        "mb": j,
                        "step": s,
                        "rank": k,
                    }
                )
    return {"microbatches": recs, "steps": steps, "layout": {"tp": 1, "cp": 1, "pp": pp, "dp": 1}}


def test_pipeline_records_fit_per_stage_and_predict_steps(tmp_path, capsys):
    a_path, b_path = tmp_path / "a.json", tmp_path / "b.json"
    a_path.write_text(json.dumps(_pp_records(seed=0)))
    b_path.write_text(json.dumps(_pp_records(seed=1, n_steps=6)))
    assert (
        calibrate.main(["--records", str(a_path), "--predict-records", str(b_path), "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pred = out["step_prediction"]
    assert pred["schedule"] == "1f1b" and pred["steps_fitted"] == 5 and pred["steps_compared"] == 5
    assert pred["mean_abs_rel_error"] < 0.03
    assert pred["step_overhead_s"] == pytest.approx(0.05, abs=0.02)
    assert pred["replay_measured_actions"]["mean_abs_rel_error"] < 0.01
    assert set(pred["stages"]) == {"stage0_fwd", "stage0_bwd", "stage1_fwd", "stage1_bwd"}
    assert pred["stages"]["stage1_bwd"]["a"] == pytest.approx(2e-9, rel=0.2)
    (cross,) = pred["cross"]
    assert cross["steps_compared"] == 6 and cross["mean_abs_rel_error"] < 0.03
    # The top-level fit is of the whole micro-batch (both stages, forward + backward).
    assert out["records"] == 80 and out["attn_coef"] == pytest.approx(6e-9, rel=0.2)


def test_pipeline_record_without_stage_times_is_rejected(tmp_path, capsys):
    data = _pp_records(n_steps=2)
    del data["microbatches"][3]["bwd_s"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert calibrate.main(["--records", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pipeline record 3" in err and "Traceback" not in err


# ------------------------------------------------------- from e2e_bench's records, end to end
def _trainer_logs(parallel: str) -> list[dict[int, dict]]:
    """Two ranks' ``[wlb.advanced] metrics_jsonl`` logs (the keys e2e_bench reads) carrying the synthetic
    times above: under DP = 2 each rank its own micro-batches, under PP = 2 one stage's actions."""
    logs: list[dict[int, dict]] = [{}, {}]
    if parallel == "pp2":
        data = _pp_records()
        for step in data["steps"]:
            for k, log in enumerate(logs):
                mine = [
                    r for r in data["microbatches"] if r["step"] == step["step"] and r["stage"] == k
                ]
                act = {"stages": [k], "doc_lens": [r["doc_lens"] for r in mine]}
                for key in ("fwd_s", "bwd_s"):  # the device clock reads the same here
                    act[key] = act[key.replace("_s", "_device_s")] = [[r[key] for r in mine]]
                log[step["step"]] = {"pp_actions": [act], "wlb/step_time_s": step["seconds"]}
        return logs
    recs = _synthetic_records(n_mb=80, noise=0.01, steps=True)
    for step in sorted({r["step"] for r in recs}):
        mine = [[r for r in recs if r["step"] == step][k::2] for k in range(2)]
        seconds = max(sum(r["seconds"] for r in rs) for rs in mine) + 0.05  # + optimizer
        for log, rs in zip(logs, mine, strict=True):
            times = [r["seconds"] for r in rs]
            log[step] = {
                "micro_batch_doc_lens": [r["doc_lens"] for r in rs],
                "micro_batch_times_s": times,
                "micro_batch_device_times_s": times,
                "wlb/step_time_s": seconds,
            }
    return logs


@pytest.mark.parametrize("parallel", ["dp2", "pp2"])
def test_calibration_from_e2e_bench_records(tmp_path, capsys, parallel):
    """The calibration file of ``e2e_bench --records-out`` is fitted and its steps predicted."""
    from torchtitan_wlb.tools import e2e_bench

    logs = _trainer_logs(parallel)
    records = e2e_bench.calibration_records(logs, sorted(logs[0]))
    e2e_bench.write_records(tmp_path, {"wlb": records}, parallel, "tiny")
    path = tmp_path / "records_wlb.json"
    assert calibrate.main(["--records", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pred = out["step_prediction"]
    assert pred["step_overhead_s"] == pytest.approx(0.05, abs=0.02)
    if parallel == "pp2":  # per-stage fits played through 1F1B (PP = 2 from the file's layout)
        assert pred["schedule"] == "1f1b" and pred["mean_abs_rel_error"] < 0.03
        assert out["attn_coef"] == pytest.approx(6e-9, rel=0.2)
    else:  # both ranks' micro-batches fitted; a step takes its slower rank's
        assert out["records"] == 80 and pred["mean_abs_rel_error"] < 0.05
        assert out["attn_coef"] == pytest.approx(A_TRUE, rel=0.1)
        assert out["linear_coef"] == pytest.approx(B_TRUE, rel=0.1)
