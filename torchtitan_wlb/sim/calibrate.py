"""``python -m torchtitan_wlb.sim.calibrate``: measured micro-batch times (the records file of
docs/simulator.md#calibration), their fit ``seconds ~= a sum(d^2) + b sum(d) + c``, and the step
times predicted from it: fitted on the first half of the steps (or on standalone micro-batches),
every step error is reported on the second half.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from torchtitan_wlb.cost_fit import stage_sums
from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.models.catalogue import ModelSpec, get_model
from torchtitan_wlb.sim.engine import features, fit_coefficients
from torchtitan_wlb.sim.hardware import HardwareProfile, Layout
from torchtitan_wlb.sim.timeline import build_schedule, simulate_pipeline


@dataclass(frozen=True)
class MicroBatchRecord:
    """One measured micro-batch: its documents and forward + backward seconds; the step (-1:
    standalone) and DP rank that ran it; for pipeline records the (virtual) stage (-1: whole
    model), its index in the step and that stage's forward and backward seconds."""

    doc_lens: np.ndarray
    seconds: float
    step: int = -1
    rank: int = 0
    stage: int = -1
    mb: int = -1
    fwd_s: float | None = None
    bwd_s: float | None = None


Records = list[MicroBatchRecord]
_INT_FIELDS = {"step": -1, "rank": 0, "stage": -1, "mb": -1}  # optional, with their defaults


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def parse_records(raw: list, source: str) -> Records:
    """Validate a list of JSON records (dicts, or ``[doc_lens, seconds]`` pairs)."""
    records = []
    for i, item in enumerate(raw):
        where = f"{source}: micro-batch record {i}"
        if isinstance(item, (list, tuple)) and len(item) == 2:
            item = {"doc_lens": item[0], "seconds": item[1]}
        if not isinstance(item, dict) or "doc_lens" not in item or "seconds" not in item:
            raise ValueError(f"{where} must be {{doc_lens, seconds, ...}} or [doc_lens, seconds]")
        lens, secs = item["doc_lens"], item["seconds"]
        extra = {k: int(item.get(k, d)) for k, d in _INT_FIELDS.items()}
        extra |= {k: None if item.get(k) is None else float(item[k]) for k in ("fwd_s", "bwd_s")}
        if extra["stage"] >= 0 and not (
            extra["mb"] >= 0 and _positive(extra["fwd_s"]) and _positive(extra["bwd_s"])
        ):
            raise ValueError(
                f"{source}: pipeline record {i} (stage {extra['stage']}) needs 'mb' >= 0 and "
                f"'fwd_s', 'bwd_s' > 0"
            )
        ok = isinstance(lens, list) and all(isinstance(d, int) and _positive(d) for d in lens)
        if not (ok and lens):
            raise ValueError(f"{where} doc_lens = {lens!r} must be positive integers")
        if not _positive(secs):
            raise ValueError(f"{where} seconds = {secs!r} must be > 0")
        records.append(MicroBatchRecord(np.asarray(lens, dtype=np.int64), float(secs), **extra))
    return records


def load_records(path: str | Path) -> tuple[Records, dict[int, float], dict]:
    """Read a calibration file: (micro-batch records, measured step times, metadata)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"calibration file {str(path)!r} does not exist")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {path}: invalid JSON ({exc.msg})") from None
    meta: dict = {}
    steps: dict[int, float] = {}
    if isinstance(raw, dict):
        meta = {k: v for k, v in raw.items() if k not in ("microbatches", "steps")}
        steps = {int(s["step"]): float(s["seconds"]) for s in raw.get("steps", [])}
        raw = raw.get("microbatches", [])
    if not isinstance(raw, list):
        raise ValueError(f"calibration file {path}: expected a list of micro-batch records")
    return parse_records(raw, str(path)), steps, meta


def whole_model_records(records: Records) -> Records:
    """Per-stage records summed over the stages (each micro-batch's whole time)."""
    keys = [(r.step, r.mb, tuple(r.doc_lens.tolist())) for r in records]
    done, sums = stage_sums(keys, [r.stage for r in records], [r.seconds for r in records])
    rows = zip(done, sums[:, 0].tolist(), strict=True)
    return [MicroBatchRecord(np.asarray(k[2], np.int64), t, k[0]) for k, t in rows]


def pipeline_steps(records: Records) -> dict[int, tuple[list[np.ndarray], np.ndarray]]:
    """step -> (doc_lens per micro-batch, measured [fwd / bwd, n_stages, m] seconds); steps
    missing an action (a rank's log is incomplete) are left out."""
    row = {k: i for i, k in enumerate(sorted({r.stage for r in records if r.stage >= 0}))}
    by_step: dict[int, Records] = {}
    for r in records:
        if r.stage >= 0 and r.step >= 0:
            by_step.setdefault(r.step, []).append(r)
    out = {}
    for step, recs in by_step.items():
        m = max(r.mb for r in recs) + 1
        times, lens = np.full((2, len(row), m), np.nan), [np.zeros(0, np.int64)] * m
        for r in recs:
            if not np.isnan(times[0, row[r.stage], r.mb]):
                raise ValueError(
                    f"step {step}: two records for stage {r.stage}, micro-batch {r.mb}; pipeline "
                    f"calibration supports one pipeline (DP = 1)"
                )
            times[:, row[r.stage], r.mb], lens[r.mb] = (r.fwd_s, r.bwd_s), r.doc_lens
        if not np.isnan(times).any():  # every (stage, micro-batch) recorded
            out[step] = (lens, times)
    return out


@dataclass(frozen=True)
class Calibration:
    """The fitted a, b, c (seconds), the records fitted and the mean and worst relative error."""

    attn_coef: float
    linear_coef: float
    overhead_s: float
    n_records: int
    mean_abs_rel_error: float
    max_abs_rel_error: float

    def predict(self, doc_lens_list: list[np.ndarray]) -> np.ndarray:
        coef = np.array([self.attn_coef, self.linear_coef, self.overhead_s])
        return features(doc_lens_list) @ coef

    def cost_model(self) -> CostModel:
        return CostModel.from_coefficients(self.attn_coef, self.linear_coef, unit="seconds")

    def summary(self) -> dict:
        return {"a": self.attn_coef, "b": self.linear_coef, "c": self.overhead_s,
                "mean_abs_rel_error": self.mean_abs_rel_error,
                "max_abs_rel_error": self.max_abs_rel_error}  # fmt: skip

    def hardware(self, model: ModelSpec, layout: Layout) -> HardwareProfile:
        """Per-GPU throughputs implied by the fit: ``a`` = attention FLOPs per squared token (fwd
        + bwd) / attention throughput, ``b`` = GEMM FLOPs per token / GEMM throughput, with the
        element-wise time and exposed communication folded into the GEMM throughput."""
        base, tp, cp = HardwareProfile(), layout.tp, layout.cp
        attn_flops_per_d2 = model.n_layers * 2.0 * model.head_dim * model.n_heads / tp / cp
        gemm = model.n_layers * 2.0 * model.params_per_layer + 2.0 * model.dim * model.vocab_size
        gemm_flops_per_d = gemm / tp / cp
        attn = attn_flops_per_d2 * (1.0 + base.bwd_attn_factor) / max(self.attn_coef, 1e-30)
        gemm = gemm_flops_per_d * (1.0 + base.bwd_gemm_factor) / max(self.linear_coef, 1e-30)
        return replace(base, name=f"{base.name}-calibrated", attn_tflops=float(attn / 1e12),
                       gemm_tflops=float(gemm / 1e12), elementwise_bytes_per_token_dim=1e-9,
                       tp_overlap=1.0, cp_overlap=1.0)  # fmt: skip


def fit(records: Records, overhead: bool = True) -> Calibration:
    """Fit ``seconds ~ a sum d^2 + b sum d (+ c)``, weighted so each record counts alike."""
    if len(records) < 3:
        raise ValueError(f"calibration needs at least 3 micro-batch records, got {len(records)}")
    lens, y = [r.doc_lens for r in records], np.array([r.seconds for r in records])
    coef = fit_coefficients(lens, y, overhead)
    rel = np.abs(features(lens) @ coef - y) / y
    a, b, c = (float(x) for x in coef)
    return Calibration(a, b, c, len(records), float(rel.mean()), float(rel.max()))


def fit_pipeline(records: Records, overhead: bool = True) -> dict[str, dict[int, Calibration]]:
    """Per-stage fits: {"fwd_s" (the last stage's with the loss), "bwd_s"}: stage -> Calibration."""
    stages = sorted({r.stage for r in records if r.stage >= 0})
    return {
        a: {k: fit([MicroBatchRecord(r.doc_lens, getattr(r, a)) for r in records if r.stage == k],
                   overhead=overhead) for k in stages}
        for a in ("fwd_s", "bwd_s")
    }  # fmt: skip


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


def _report(play, records: Records, measured: dict[int, float], what: str) -> dict:
    """Errors of ``play(records, measured)`` -> (steps, predicted, measured seconds), as
    ``_holdout``, and without the step overhead."""
    steps, pred, meas = play(records, measured)
    _need_two(steps, what)
    return {"steps_compared": len(steps) - len(steps) // 2, **_holdout(pred, meas),
            "mean_abs_rel_error_no_overhead": _errors(pred, meas)["mean_abs_rel_error"]}  # fmt: skip


def _cross(play, records: Records, measured: dict[int, float], others: list[tuple]) -> dict:
    """Other runs' steps predicted by ``play`` plus the step overhead of all this run's steps."""
    _, pred, meas = play(records, measured)
    overhead, cross = float(np.median(meas - pred)), []
    for other in others:
        steps, pred, meas = play(*other)
        if not steps:
            raise ValueError("a --predict-records file has no complete steps with micro-batch records")  # fmt: skip
        cross.append({"steps_compared": len(steps), **_errors(pred + overhead, meas)})
    return {"cross": cross}


def step_prediction(calib: Calibration, records: Records, measured: dict[int, float],
                    pp: int = 1, others: list[tuple] = ()) -> dict:  # fmt: skip
    """The steps' times predicted from their micro-batches against the measured ones. A rank's step
    is its micro-batches' fitted times summed (PP = 1), or with PP > 1 each split evenly over the
    stages (forward 1/3, backward 2/3) and played through 1F1B; a step takes its slowest rank's."""

    def play(recs: Records, meas: dict[int, float]):
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

    out = _report(play, records, measured, "steps with both micro-batch records and a measured time")  # fmt: skip
    return out | (_cross(play, records, measured, others) if others else {})


def pipeline_step_prediction(records: Records, measured: dict[int, float], pp: int,
                             *, predict: list[tuple] | None = None, overhead: bool = True) -> dict:  # fmt: skip
    """Fit per-stage action costs on the first half of the steps, predict the second half.

    Each step is also played with the *measured* action times (``replay_*``: how much of the error
    is the timeline and the per-step constant rather than the cost fit). ``predict``: other runs
    whose steps the fit on all of this run's steps predicts (``cross``).
    """
    steps = pipeline_steps(records)
    common = sorted(set(steps) & set(measured))
    what = "complete pipeline steps with a measured time"
    _need_two(common, what)
    half = len(common) // 2
    first, second = set(common[:half]), set(common[half:])

    def player(fits: dict[str, dict[int, Calibration]]):
        def play(recs: Records, meas: dict[int, float]):
            stp = pipeline_steps(recs)
            which = sorted(set(stp) & set(meas))
            pred = [play_pipeline(*(np.stack([c.predict(stp[s][0]) for c in part.values()])
                                    for part in fits.values()), pp) for s in which]  # fmt: skip
            return which, np.array(pred), np.array([meas[s] for s in which])

        return play

    fits = fit_pipeline([r for r in records if r.step in first], overhead=overhead)
    report, cross = _report(player(fits), records, measured, what), {}
    if predict:
        full = fit_pipeline([r for r in records if r.step in set(common)], overhead=overhead)
        cross = _cross(player(full), records, measured, predict)
    n_v = len(fits["fwd_s"])
    replay = np.array([play_pipeline(*steps[s][1], pp) for s in common])
    test = {k: [r for r in records if r.step in second and r.stage == k] for k in fits["fwd_s"]}
    act_pred = np.concatenate([part[k].predict([r.doc_lens for r in rs])
                               for part in fits.values() for k, rs in test.items()])  # fmt: skip
    act_meas = np.array([getattr(r, a) for a in fits for rs in test.values() for r in rs])
    return {
        "fit": "per-stage forward/backward costs and the step overhead on the first half of "
        "the steps; errors on the second half",
        "schedule": "1f1b" if n_v <= pp else f"interleaved_1f1b (v={n_v // pp})",
        "steps_fitted": half, **report,
        "heldout_action_mean_abs_rel_error": float(np.mean(np.abs(act_pred - act_meas) / act_meas)),
        "replay_measured_actions": _holdout(replay, np.array([measured[s] for s in common])),
        "stages": {f"stage{k}_{a[:3]}": fits[a][k].summary() for k in fits["fwd_s"] for a in fits},
        **cross,
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchtitan_wlb.sim.calibrate", description="Fit "
                                "measured micro-batch times and check the step-time prediction.")  # fmt: skip
    p.add_argument("--records", required=True, help="calibration JSON (docs/simulator.md)")
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
