"""``python -m torchtitan_wlb.sim.calibrate``: fit measured micro-batch times (``records``, ``fit``)
and check the step times predicted from the fit (``replay``); docs/simulator.md#calibration."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from torchtitan_wlb.models.catalogue import get_model
from torchtitan_wlb.sim.fit import fit
from torchtitan_wlb.sim.hardware import Layout
from torchtitan_wlb.sim.records import load_records, whole_model_records
from torchtitan_wlb.sim.replay import pipeline_step_prediction, step_prediction


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_wlb.sim.calibrate",
        description="Fit measured micro-batch times and check the step-time prediction.",
    )
    p.add_argument("--records", required=True, help="calibration JSON (docs/simulator.md)")
    p.add_argument("--model", default=None, help="model preset, to derive achieved TFLOP/s")
    for dim in ("tp", "cp", "pp"):
        p.add_argument(f"--{dim}", type=int, default=None)
    p.add_argument("--no-overhead", action="store_true", help="fit without the constant c")
    p.add_argument(
        "--predict-records",
        action="append",
        default=[],
        metavar="FILE",
        help="another run's records, whose steps this fit predicts (step_prediction.cross)",
    )
    p.add_argument("--hardware-out", default=None, help="write the fitted HardwareProfile JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p


def run(args: argparse.Namespace) -> dict:
    records, steps, meta = load_records(args.records)
    others = [load_records(path)[:2] for path in args.predict_records]
    pipeline_records = records if any(r.stage >= 0 for r in records) else None
    if pipeline_records is not None:
        # Per-stage actions: the top-level fit is of the whole micro-batch (all stages).
        records = whole_model_records(pipeline_records)
    # With measured steps and enough standalone micro-batches, fit on the standalone ones only:
    # the steps' micro-batches (and the steps) are then a held-out test of the prediction.
    standalone = [r for r in records if r.step < 0]
    held_out = [r for r in records if r.step >= 0]
    fit_on = standalone if steps and len(standalone) >= 3 and held_out else records
    calib = fit(fit_on, overhead=not args.no_overhead)
    lay = meta.get("layout", {}) if isinstance(meta.get("layout"), dict) else {}
    layout = Layout(
        tp=args.tp or int(lay.get("tp", 1)),
        cp=args.cp or int(lay.get("cp", 1)),
        pp=args.pp or int(lay.get("pp", 1)),
        dp=int(lay.get("dp", 1)),
    )
    out: dict = {
        "attn_coef": calib.attn_coef,
        "linear_coef": calib.linear_coef,
        "overhead_s": calib.overhead_s,
        "break_even_length": calib.cost_model().break_even_length,
        "records": calib.n_records,
        "mb_mean_abs_rel_error": calib.mean_abs_rel_error,
        "mb_max_abs_rel_error": calib.max_abs_rel_error,
        "fitted_on": "standalone micro-batches" if fit_on is standalone else "all records",
    }
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
            pipeline_records,
            steps,
            pp=args.pp or int(lay.get("pp", n_stages)),
            predict=others,
            overhead=not args.no_overhead,
        )
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
