"""``python -m torchtitan_wlb.sim.calibrate``: fit measured micro-batch times, predict step times.

Every step error is a prediction: fitted on the first half of the steps (or on standalone
micro-batches), reported on the second half (docs/simulator.md#calibration).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from torchtitan_wlb.models.catalogue import get_model
from torchtitan_wlb.sim import fit as sim_fit
from torchtitan_wlb.sim.hardware import Layout
from torchtitan_wlb.sim.timeline import build_schedule, simulate_pipeline

Records = list[sim_fit.MicroBatchRecord]


def play_pipeline(fwd: np.ndarray, bwd: np.ndarray, pp: int) -> float:
    """Makespan of one step's (interleaved) 1F1B; ``fwd``, ``bwd`` are [virtual stages, m]."""
    n_v, m = fwd.shape
    sched = build_schedule(pp, m, max(1, n_v // pp))
    return float(simulate_pipeline(sched, fwd[None], bwd[None]).makespan[0])


def _need_two(steps: list[int], what: str) -> None:
    if len(steps) < 2:
        raise ValueError(f"step-time check needs >= 2 {what}, got {len(steps)}")


def _errors(pred: np.ndarray, meas: np.ndarray) -> dict:
    rel = np.abs(pred - meas) / meas
    return {"mean_abs_rel_error": float(rel.mean()), "max_abs_rel_error": float(rel.max())}


def _holdout(pred: np.ndarray, meas: np.ndarray) -> dict:
    """The per-step overhead fitted on the first half (median residual), errors on the second."""
    half = len(meas) // 2
    overhead = float(np.median(meas[:half] - pred[:half]))
    return {"step_overhead_s": overhead, **_errors(pred[half:] + overhead, meas[half:])}


def _report(predict, records, measured, what: str, others: list[tuple], predict_all=None) -> dict:
    """Errors of ``predict(records, measured)`` -> (steps, predicted, measured seconds): held out
    as ``_holdout``, and (``cross``) other runs' steps predicted with ``predict_all`` (default
    ``predict``) plus the step overhead of all this run's steps."""
    steps, pred, meas = predict(records, measured)
    _need_two(steps, what)
    out = {"steps_compared": len(steps) - len(steps) // 2, **_holdout(pred, meas),
           "mean_abs_rel_error_no_overhead": _errors(pred, meas)["mean_abs_rel_error"]}  # fmt: skip
    if others:
        _, pred, meas = (predict_all or predict)(records, measured)
        overhead, out["cross"] = float(np.median(meas - pred)), []
        for other in others:
            steps, pred, meas = (predict_all or predict)(*other)
            if not steps:
                raise ValueError("a --predict-records file has no complete steps with micro-batch records")  # fmt: skip
            out["cross"].append({"steps_compared": len(steps), **_errors(pred + overhead, meas)})
    return out


def step_prediction(calib: sim_fit.Calibration, records: Records, measured: dict[int, float],
                    pp: int = 1, others: list[tuple] = ()) -> dict:  # fmt: skip
    """The steps' times predicted from their micro-batches against the measured ones. A rank's step
    is its micro-batches' fitted times summed (PP = 1), or with PP > 1 each split evenly over the
    stages (forward 1/3, backward 2/3) and played through 1F1B; a step takes its slowest rank's."""

    def predict(recs: Records, meas: dict[int, float]):
        by_rank_step: dict[tuple[int, int], list[np.ndarray]] = {}
        for r in recs:
            if r.step >= 0 and r.step in meas:
                by_rank_step.setdefault((r.rank, r.step), []).append(r.doc_lens)
        pred = dict.fromkeys(sorted({s for _, s in by_rank_step}), 0.0)
        for (_, step), mbs in by_rank_step.items():
            t = calib.predict(mbs)
            per_stage = np.broadcast_to(t[None, :] / pp, (pp, len(mbs)))
            t = float(t.sum()) if pp == 1 else play_pipeline(per_stage / 3, per_stage * 2 / 3, pp)
            pred[step] = max(pred[step], t)
        return list(pred), np.array(list(pred.values())), np.array([meas[s] for s in pred])

    what = "steps with both micro-batch records and a measured time"
    return _report(predict, records, measured, what, others)


def pipeline_step_prediction(records: Records, measured: dict[int, float], pp: int,
                             *, predict: list[tuple] | None = None, overhead: bool = True) -> dict:  # fmt: skip
    """Fit per-stage action costs on the first half of the steps, predict the second half.

    Each step is also played with the *measured* action times (``replay_*``: how much of the error
    is the timeline and the per-step constant rather than the cost fit). ``predict``: other runs
    whose steps the fit on all of this run's steps predicts (``cross``).
    """
    steps = sim_fit.pipeline_steps(records)
    common = sorted(set(steps) & set(measured))
    what = "complete pipeline steps with a measured time"
    _need_two(common, what)
    half = len(common) // 2
    first, second = set(common[:half]), set(common[half:])

    def player(pcal: sim_fit.PipelineCalibration):
        def play(recs: Records, meas: dict[int, float]):
            stp = sim_fit.pipeline_steps(recs)
            which = sorted(set(stp) & set(meas))
            pred = [play_pipeline(*pcal.predict(stp[s]["lens"]), pp) for s in which]
            return which, np.array(pred), np.array([meas[s] for s in which])

        return play

    pcal = sim_fit.fit_pipeline([r for r in records if r.step in first], overhead=overhead)
    full = predict and player(sim_fit.fit_pipeline([r for r in records if r.step in set(common)],
                                                   overhead=overhead))  # fmt: skip
    report = _report(player(pcal), records, measured, what, predict or [], full)
    n_v = len(pcal.fwd)
    replay = np.array([play_pipeline(steps[s]["fwd"], steps[s]["bwd"], pp) for s in common])
    test = {k: [r for r in records if r.step in second and r.stage == k] for k in sorted(pcal.fwd)}
    act_pred = np.concatenate([part[k].predict([r.doc_lens for r in rs])
                               for part in (pcal.fwd, pcal.bwd) for k, rs in test.items()])  # fmt: skip
    act_meas = np.array([getattr(r, a) for a in ("fwd_s", "bwd_s") for rs in test.values() for r in rs])  # fmt: skip
    cross = {"cross": report.pop("cross")} if "cross" in report else {}
    return {
        "fit": "per-stage forward/backward costs and the step overhead on the first half of "
        "the steps; errors on the second half",
        "schedule": "1f1b" if n_v <= pp else f"interleaved_1f1b (v={n_v // pp})",
        "steps_fitted": half, **report,
        "heldout_action_mean_abs_rel_error": float(np.mean(np.abs(act_pred - act_meas) / act_meas)),
        "replay_measured_actions": _holdout(replay, np.array([measured[s] for s in common])),
        "stages": pcal.summary(), **cross,
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchtitan_wlb.sim.calibrate", description="Fit "
                                "measured micro-batch times and check the step-time prediction.")  # fmt: skip
    p.add_argument("--records", required=True, help="calibration JSON (see sim.fit)")
    p.add_argument("--model", default=None, help="model preset, to derive achieved TFLOP/s")
    for dim in ("tp", "cp", "pp"):
        p.add_argument(f"--{dim}", type=int, default=None)
    p.add_argument("--no-overhead", action="store_true", help="fit without the constant c")
    p.add_argument("--predict-records", action="append", default=[], metavar="FILE",
                   help="another run's records, whose steps this fit predicts (step_prediction.cross)")  # fmt: skip
    p.add_argument("--hardware-out", default=None, help="write the fitted HardwareProfile JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p


def run(args: argparse.Namespace) -> dict:
    records, steps, meta = sim_fit.load_records(args.records)
    others = [sim_fit.load_records(path)[:2] for path in args.predict_records]
    pipeline_records = records if any(r.stage >= 0 for r in records) else None
    if pipeline_records is not None:
        # Per-stage actions: the top-level fit is of the whole micro-batch (all stages).
        records = sim_fit.whole_model_records(pipeline_records)
    # With measured steps and enough standalone micro-batches, fit on the standalone ones only:
    # the steps' micro-batches (and the steps) are then a held-out test of the prediction.
    standalone = [r for r in records if r.step < 0]
    held_out = [r for r in records if r.step >= 0]
    fit_on = standalone if steps and len(standalone) >= 3 and held_out else records
    calib = sim_fit.fit(fit_on, overhead=not args.no_overhead)
    lay = meta.get("layout", {}) if isinstance(meta.get("layout"), dict) else {}
    layout = Layout(tp=args.tp or int(lay.get("tp", 1)), cp=args.cp or int(lay.get("cp", 1)),
                    pp=args.pp or int(lay.get("pp", 1)), dp=int(lay.get("dp", 1)))  # fmt: skip
    out: dict = {
        "attn_coef": calib.attn_coef, "linear_coef": calib.linear_coef,
        "overhead_s": calib.overhead_s, "break_even_length": calib.cost_model().break_even_length,
        "records": calib.n_records, "mb_mean_abs_rel_error": calib.mean_abs_rel_error,
        "mb_max_abs_rel_error": calib.max_abs_rel_error,
        "fitted_on": "standalone micro-batches" if fit_on is standalone else "all records",
    }  # fmt: skip
    if fit_on is standalone:
        pred = calib.predict([r.doc_lens for r in held_out])
        meas = np.array([r.seconds for r in held_out])
        out["heldout_mb_mean_abs_rel_error"] = float(np.mean(np.abs(pred - meas) / meas))
    model_name = args.model or (meta.get("model") if isinstance(meta.get("model"), str) else None)
    if model_name:
        hw = calib.hardware(get_model(model_name), layout)
        out |= {"attn_tflops": hw.attn_tflops, "gemm_tflops": hw.gemm_tflops}
        if args.hardware_out:
            hw.to_json(args.hardware_out)
    if steps and pipeline_records is not None:
        n_stages = len({r.stage for r in pipeline_records})
        out["step_prediction"] = pipeline_step_prediction(
            pipeline_records, steps, pp=args.pp or int(lay.get("pp", n_stages)), predict=others,
            overhead=not args.no_overhead,
        )  # fmt: skip
    elif steps:
        out["step_prediction"] = step_prediction(calib, records, steps, layout.pp, others)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for key, value in out.items():
        print(f"{key:>24}: {value}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
