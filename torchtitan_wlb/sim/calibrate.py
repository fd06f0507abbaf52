"""Calibration: fit the cost model and the hardware profile to measured per-micro-batch times.

Input (JSON), written by a training run's profiler or the end-to-end benchmark::

    {"microbatches": [{"doc_lens": [int, ...], "seconds": float, "step": int (optional)}, ...],
     "steps": [{"step": int, "seconds": float}, ...],            # optional: measured step times
     "model": "7B" | {dims...}, "layout": {"tp":1,"cp":1,"pp":1,"dp":1}}   # optional

A bare JSON list of micro-batch records is accepted too. Each record's ``seconds`` is the micro-batch's
forward + backward time on one GPU. The fit is

    seconds ~= a * sum(d^2) + b * sum(d) + c          (a, b, c >= 0, relative least squares)

over each micro-batch's documents ``d``: ``a`` and ``b`` are the cost model's coefficients in seconds
(CostModel.from_coefficients), ``c`` a fixed per-micro-batch overhead (kernel launches, collective
latency). With a model and a layout, ``a`` and ``b`` also give the achieved attention and GEMM throughput
of a HardwareProfile. When measured step times are given, the step times are predicted from the
micro-batches (pipeline timeline of the fitted times) and compared: the prediction error is reported
on the second half of the steps, with any per-step overhead fitted on the first half only. Records
with ``step`` < 0 (standalone micro-batches), when present next to measured steps, are the only ones
fitted, so the steps' own micro-batches are held out.

Pipeline-parallel runs (records with ``stage``, written by ``e2e_bench --parallel pp2``): one record
per micro-batch and stage, with that stage's ``fwd_s`` and ``bwd_s`` and the micro-batch's index
``mb`` in its step. Forward and backward are fitted separately per stage (``a sum d^2 + b sum d +
c`` each) on the actions of the first half of the steps; every step is then predicted by playing the
simulator's own pipeline timeline (:mod:`torchtitan_wlb.sim.timeline`, the 1F1B schedule the run
used) with the fitted action times, plus a constant per-step overhead fitted on the first half, and
compared with the measured step time on the second half. ``--predict-records`` predicts other runs
(other modes) from this file's fit.

Run: ``python -m torchtitan_wlb.sim.calibrate --records runs/e2e_mb_times.json [--json]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.models.catalogue import ModelSpec, get_model
from torchtitan_wlb.sim.hardware import HardwareProfile
from torchtitan_wlb.sim.presets import Layout
from torchtitan_wlb.sim.timeline import build_schedule, simulate_pipeline


@dataclass(frozen=True)
class MicroBatchRecord:
    """One measured micro-batch.

    Attributes:
        doc_lens: Document lengths packed in it.
        seconds: Measured forward + backward time (s).
        step: Optimizer step it belongs to (-1 when unknown).
    """

    doc_lens: np.ndarray
    seconds: float
    step: int = -1
    rank: int = 0
    """Data-parallel rank that ran it: ranks run their micro-batches concurrently, so a step's
    predicted time is the slowest rank's."""
    stage: int = -1
    """Pipeline (virtual) stage the times are for; -1: the whole model (no pipeline)."""
    mb: int = -1
    """Index of the micro-batch in its step (schedule order); -1 when unknown."""
    fwd_s: float | None = None
    """Forward time of this stage (pipeline records)."""
    bwd_s: float | None = None
    """Backward time of this stage (pipeline records)."""


@dataclass(frozen=True)
class Calibration:
    """A fitted micro-batch time model and how well it fits.

    Attributes:
        attn_coef: Seconds per squared document token (a).
        linear_coef: Seconds per token (b).
        overhead_s: Fixed seconds per micro-batch (c).
        n_records: Micro-batches fitted.
        mean_abs_rel_error: Mean |predicted - measured| / measured over the records.
        max_abs_rel_error: Worst relative error.
    """

    attn_coef: float
    linear_coef: float
    overhead_s: float
    n_records: int
    mean_abs_rel_error: float
    max_abs_rel_error: float

    def predict(self, doc_lens_list: list[np.ndarray]) -> np.ndarray:
        """Predicted seconds of each micro-batch."""
        feats = features(doc_lens_list)
        return feats @ np.array([self.attn_coef, self.linear_coef, self.overhead_s])

    def cost_model(self) -> CostModel:
        """The fitted coefficients as the project's CostModel (unit: seconds)."""
        return CostModel.from_coefficients(self.attn_coef, self.linear_coef, unit="seconds")

    def hardware(
        self, model: ModelSpec, layout: Layout, base: HardwareProfile | None = None
    ) -> HardwareProfile:
        """Achieved throughputs implied by the fit for ``model`` on ``layout`` (per GPU).

        ``a`` is all layers' causal-attention FLOPs per squared token (fwd + bwd) divided by
        attention throughput; ``b`` is the GEMM FLOPs per token divided by GEMM throughput. Element-wise
        time and exposed communication are folded into the GEMM throughput (set to zero), which is
        what a fit on one kind of run can identify.
        """
        base = base or HardwareProfile()
        tp, cp = layout.tp, layout.cp
        attn_flops_per_d2 = (model.n_layers * 2.0 * model.head_dim * model.n_heads / tp / cp) * (
            1.0 + base.bwd_attn_factor
        )
        gemm_flops_per_d = (
            (model.n_layers * 2.0 * model.params_per_layer + 2.0 * model.dim * model.vocab_size)
            / tp
            / cp
            * (1.0 + base.bwd_gemm_factor)
        )
        attn_tflops = attn_flops_per_d2 / max(self.attn_coef, 1e-30) / 1e12
        gemm_tflops = gemm_flops_per_d / max(self.linear_coef, 1e-30) / 1e12
        return base.with_overrides(
            name=f"{base.name}-calibrated",
            attn_tflops=float(attn_tflops),
            gemm_tflops=float(gemm_tflops),
            elementwise_bytes_per_token_dim=1e-9,
            tp_overlap=1.0,
            cp_overlap=1.0,
        )


def features(doc_lens_list: list[np.ndarray]) -> np.ndarray:
    """[n, 3] regressors (sum d^2, sum d, 1) of each micro-batch, vectorised over documents."""
    counts = np.array([len(d) for d in doc_lens_list], dtype=np.int64)
    flat = (
        np.concatenate([np.asarray(d, dtype=np.float64) for d in doc_lens_list])
        if counts.sum()
        else np.zeros(0)
    )
    owner = np.repeat(np.arange(len(doc_lens_list)), counts)
    sq = np.bincount(owner, weights=flat * flat, minlength=len(doc_lens_list))
    lin = np.bincount(owner, weights=flat, minlength=len(doc_lens_list))
    return np.stack([sq, lin, np.ones(len(doc_lens_list))], axis=1)


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: best over all active sets (exact)."""
    n_col = x.shape[1]
    best, best_err = np.zeros(n_col), float(np.sum(y * y))
    for k in range(1, n_col + 1):
        for cols in itertools.combinations(range(n_col), k):
            sub = x[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err:
                best = np.zeros(n_col)
                best[list(cols)] = coef
                best_err = err
    return best


def fit(records: list[MicroBatchRecord], overhead: bool = True) -> Calibration:
    """Fit ``seconds ~ a sum d^2 + b sum d (+ c)`` with relative weighting (each record counts alike)."""
    if len(records) < 3:
        raise ValueError(f"calibration needs at least 3 micro-batch records, got {len(records)}")
    x = features([r.doc_lens for r in records])
    y = np.array([r.seconds for r in records], dtype=np.float64)
    if np.any(y <= 0):
        i = int(np.flatnonzero(y <= 0)[0])
        raise ValueError(f"micro-batch record {i}: seconds = {y[i]!r} must be > 0")
    if not overhead:
        x = x[:, :2]
    w = 1.0 / y
    col_scale = np.abs(x * w[:, None]).max(axis=0)
    col_scale[col_scale == 0] = 1.0
    coef = nnls(x * w[:, None] / col_scale, y * w) / col_scale
    coef = np.concatenate([coef, np.zeros(3 - coef.size)])
    pred = features([r.doc_lens for r in records]) @ coef
    rel = np.abs(pred - y) / y
    return Calibration(
        attn_coef=float(coef[0]),
        linear_coef=float(coef[1]),
        overhead_s=float(coef[2]),
        n_records=len(records),
        mean_abs_rel_error=float(rel.mean()),
        max_abs_rel_error=float(rel.max()),
    )


def predict_step_times(
    calib: Calibration, steps: dict[int, list[np.ndarray]], pp: int = 1
) -> dict[int, float]:
    """Predicted step time of each step from its micro-batches' fitted times.

    With PP = 1 the micro-batches run one after another (gradient accumulation); with PP > 1 each
    micro-batch's time is split evenly over the stages (forward 1/3, backward 2/3) and played through
    the 1F1B timeline.
    """
    out: dict[int, float] = {}
    for step, mbs in sorted(steps.items()):
        t = calib.predict(mbs)
        if pp == 1:
            out[step] = float(t.sum())
            continue
        sched = build_schedule(pp, len(mbs), 1)
        per_stage = np.broadcast_to(t[None, None, :] / pp, (1, pp, len(mbs)))
        res = simulate_pipeline(sched, per_stage / 3.0, per_stage * 2.0 / 3.0)
        out[step] = float(res.makespan[0])
    return out


def step_prediction_error(
    calib: Calibration,
    records: list[MicroBatchRecord],
    measured: dict[int, float],
    pp: int = 1,
) -> dict:
    """Compare predicted with measured step times.

    A constant per-step overhead (optimizer, data loading) is fitted as the median residual of the
    first half of the steps and the error reported on the second half, so the number is a prediction,
    not a fit.
    """
    by_rank_step: dict[tuple[int, int], list[np.ndarray]] = {}
    for r in records:
        if r.step >= 0:
            by_rank_step.setdefault((r.rank, r.step), []).append(r.doc_lens)
    by_step = {step for _, step in by_rank_step}
    common = sorted(by_step & set(measured))
    if len(common) < 2:
        raise ValueError(
            f"step-time check needs >= 2 steps with both micro-batch records and a measured time, "
            f"got {len(common)}"
        )
    ranks = sorted({rank for rank, _ in by_rank_step})
    per_rank = [
        predict_step_times(
            calib, {s: by_rank_step[(k, s)] for s in common if (k, s) in by_rank_step}, pp=pp
        )
        for k in ranks
    ]
    p = np.array([max(pr.get(s, 0.0) for pr in per_rank) for s in common])
    m = np.array([measured[s] for s in common])
    half = len(common) // 2
    overhead = float(np.median(m[:half] - p[:half]))
    rel = np.abs(p[half:] + overhead - m[half:]) / m[half:]
    rel_raw = np.abs(p - m) / m
    return {
        "steps_compared": len(common) - half,
        "step_overhead_s": overhead,
        "mean_abs_rel_error": float(rel.mean()),
        "max_abs_rel_error": float(rel.max()),
        "mean_abs_rel_error_no_overhead": float(rel_raw.mean()),
    }


@dataclass(frozen=True)
class PipelineCalibration:
    """Per-stage fits of forward and backward times (``a sum d^2 + b sum d + c`` each).

    Attributes:
        fwd: stage index -> Calibration of the forward (loss included on the last stage).
        bwd: stage index -> Calibration of the backward.
    """

    fwd: dict[int, Calibration]
    bwd: dict[int, Calibration]

    @property
    def n_stages(self) -> int:
        return len(self.fwd)

    def predict(self, doc_lens_list: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """[n_stages, m] forward and backward seconds of each micro-batch on each stage."""
        stages = sorted(self.fwd)
        fwd = np.stack([self.fwd[k].predict(doc_lens_list) for k in stages])
        bwd = np.stack([self.bwd[k].predict(doc_lens_list) for k in stages])
        return fwd, bwd

    def summary(self) -> dict:
        out = {}
        for k in sorted(self.fwd):
            for kind, cal in (("fwd", self.fwd[k]), ("bwd", self.bwd[k])):
                out[f"stage{k}_{kind}"] = {
                    "a": cal.attn_coef,
                    "b": cal.linear_coef,
                    "c": cal.overhead_s,
                    "mean_abs_rel_error": cal.mean_abs_rel_error,
                    "max_abs_rel_error": cal.max_abs_rel_error,
                }
        return out


def is_pipeline(records: list[MicroBatchRecord]) -> bool:
    """Whether the records are per-stage pipeline actions (``e2e_bench --parallel pp2``)."""
    return any(r.stage >= 0 for r in records)


def fit_pipeline(records: list[MicroBatchRecord], overhead: bool = True) -> PipelineCalibration:
    """Fit forward and backward time per stage from per-action records."""
    fwd, bwd = {}, {}
    for k in sorted({r.stage for r in records if r.stage >= 0}):
        recs = [r for r in records if r.stage == k]
        if any(r.fwd_s is None or r.bwd_s is None for r in recs):
            raise ValueError(f"pipeline records of stage {k} need 'fwd_s' and 'bwd_s'")
        fwd[k] = fit([MicroBatchRecord(r.doc_lens, r.fwd_s) for r in recs], overhead=overhead)
        bwd[k] = fit([MicroBatchRecord(r.doc_lens, r.bwd_s) for r in recs], overhead=overhead)
    if not fwd:
        raise ValueError("no pipeline records (with 'stage') to fit")
    return PipelineCalibration(fwd, bwd)


def whole_model_records(records: list[MicroBatchRecord]) -> list[MicroBatchRecord]:
    """Per-stage records summed over the stages: each micro-batch's whole forward + backward."""
    by_mb: dict[tuple[int, int], list[MicroBatchRecord]] = {}
    for r in records:
        by_mb.setdefault((r.step, r.mb), []).append(r)
    n_stages = len({r.stage for r in records})
    return [
        MicroBatchRecord(rs[0].doc_lens, float(sum(r.seconds for r in rs)), step)
        for (step, _), rs in sorted(by_mb.items())
        if len({r.stage for r in rs}) == n_stages
    ]


def _pipeline_steps(records: list[MicroBatchRecord]) -> dict[int, dict]:
    """step -> {"lens": [doc_lens per mb], "fwd": [n_stages, m], "bwd": [n_stages, m]} (measured)."""
    stages = sorted({r.stage for r in records if r.stage >= 0})
    row = {k: i for i, k in enumerate(stages)}
    by_step: dict[int, list[MicroBatchRecord]] = {}
    for r in records:
        if r.stage >= 0 and r.step >= 0:
            by_step.setdefault(r.step, []).append(r)
    out = {}
    for step, recs in by_step.items():
        m = max(r.mb for r in recs) + 1
        fwd = np.full((len(stages), m), np.nan)
        bwd = np.full((len(stages), m), np.nan)
        lens: list[np.ndarray | None] = [None] * m
        for r in recs:
            if not np.isnan(fwd[row[r.stage], r.mb]):
                raise ValueError(
                    f"step {step}: two records for stage {r.stage}, micro-batch {r.mb}; pipeline "
                    f"calibration supports one pipeline (DP = 1)"
                )
            fwd[row[r.stage], r.mb] = r.fwd_s
            bwd[row[r.stage], r.mb] = r.bwd_s
            lens[r.mb] = r.doc_lens
        if np.isnan(fwd).any() or np.isnan(bwd).any() or any(x is None for x in lens):
            continue  # an incomplete step (a rank's log is missing)
        out[step] = {"lens": lens, "fwd": fwd, "bwd": bwd}
    return out


def play_pipeline(fwd: np.ndarray, bwd: np.ndarray, pp: int) -> float:
    """Makespan of one step's 1F1B (interleaved when there are more stages than ranks) timeline.

    ``fwd`` and ``bwd`` are [virtual stages, m]; virtual stage k runs on rank k % pp.
    """
    n_v, m = fwd.shape
    v = max(1, n_v // pp)
    sched = build_schedule(pp, m, v)
    return float(simulate_pipeline(sched, fwd[None], bwd[None]).makespan[0])


def pipeline_step_prediction(
    records: list[MicroBatchRecord],
    measured: dict[int, float],
    pp: int,
    *,
    predict: list[tuple[list[MicroBatchRecord], dict[int, float]]] | None = None,
    overhead: bool = True,
) -> dict:
    """Fit per-stage action costs on the first half of the steps, predict the second half.

    Each step is played through the pipeline timeline twice: with the *fitted* action times (the
    prediction) and with the *measured* ones (``replay_*``: how much of the error is the timeline
    and the per-step constant rather than the cost fit). A constant per-step overhead (optimizer,
    data loading, point-to-point transfers) is the median residual on the fitting half. With
    ``predict``, the fit (coefficients and overhead, on all of this run's steps) also predicts
    every step of other runs (``cross``).
    """
    steps = _pipeline_steps(records)
    common = sorted(set(steps) & set(measured))
    if len(common) < 2:
        raise ValueError(
            f"step-time check needs >= 2 complete pipeline steps with a measured time, "
            f"got {len(common)}"
        )
    half = len(common) // 2
    first, second = common[:half], common[half:]

    def predict_steps(pcal: PipelineCalibration, stp: dict, which: list[int]) -> np.ndarray:
        out = []
        for s in which:
            f, b = pcal.predict(stp[s]["lens"])
            out.append(play_pipeline(f, b, pp))
        return np.array(out)

    def errors(pred: np.ndarray, meas: np.ndarray) -> dict:
        rel = np.abs(pred - meas) / meas
        return {"mean_abs_rel_error": float(rel.mean()), "max_abs_rel_error": float(rel.max())}

    fit_recs = [r for r in records if r.step in set(first)]
    pcal = fit_pipeline(fit_recs, overhead=overhead)
    m_all = np.array([measured[s] for s in common])
    p_all = predict_steps(pcal, steps, common)
    step_overhead = float(np.median(m_all[:half] - p_all[:half]))
    replay = np.array([play_pipeline(steps[s]["fwd"], steps[s]["bwd"], pp) for s in common])
    replay_overhead = float(np.median(m_all[:half] - replay[:half]))
    test_recs = [r for r in records if r.step in set(second)]
    pred_f, pred_b = [], []
    meas_f, meas_b = [], []
    for k in sorted(pcal.fwd):
        recs = [r for r in test_recs if r.stage == k]
        lens = [r.doc_lens for r in recs]
        pred_f.append(pcal.fwd[k].predict(lens))
        pred_b.append(pcal.bwd[k].predict(lens))
        meas_f.append([r.fwd_s for r in recs])
        meas_b.append([r.bwd_s for r in recs])
    act_pred = np.concatenate(pred_f + pred_b)
    act_meas = np.concatenate([np.asarray(x, dtype=float) for x in meas_f + meas_b])
    out = {
        "fit": "per-stage forward/backward costs and the step overhead on the first half of "
        "the steps; errors on the second half",
        "schedule": "1f1b"
        if pcal.n_stages <= pp
        else f"interleaved_1f1b (v={pcal.n_stages // pp})",
        "steps_fitted": half,
        "steps_compared": len(second),
        "step_overhead_s": step_overhead,
        **errors(p_all[half:] + step_overhead, m_all[half:]),
        "mean_abs_rel_error_no_overhead": float(np.mean(np.abs(p_all - m_all) / m_all)),
        "heldout_action_mean_abs_rel_error": float(np.mean(np.abs(act_pred - act_meas) / act_meas)),
        "replay_measured_actions": {
            "step_overhead_s": replay_overhead,
            **errors(replay[half:] + replay_overhead, m_all[half:]),
        },
        "stages": pcal.summary(),
    }
    if predict:
        full = fit_pipeline([r for r in records if r.step in set(common)], overhead=overhead)
        full_overhead = float(np.median(m_all - predict_steps(full, steps, common)))
        cross = []
        for other_records, other_measured in predict:
            o_steps = _pipeline_steps(other_records)
            o_common = sorted(set(o_steps) & set(other_measured))
            if not o_common:
                raise ValueError("a --predict-records file has no complete pipeline steps")
            pred = predict_steps(full, o_steps, o_common) + full_overhead
            meas = np.array([other_measured[s] for s in o_common])
            cross.append({"steps_compared": len(o_common), **errors(pred, meas)})
        out["cross"] = cross
    return out


def cross_step_prediction(
    calib: Calibration,
    records: list[MicroBatchRecord],
    measured: dict[int, float],
    other_records: list[MicroBatchRecord],
    other_measured: dict[int, float],
    pp: int = 1,
) -> dict:
    """Predict another run's steps (no pipeline records) from this run's fit and step overhead."""

    def predicted(recs: list[MicroBatchRecord], meas: dict[int, float]) -> tuple[list, np.ndarray]:
        by_rank_step: dict[tuple[int, int], list[np.ndarray]] = {}
        for r in recs:
            if r.step >= 0:
                by_rank_step.setdefault((r.rank, r.step), []).append(r.doc_lens)
        common = sorted({s for _, s in by_rank_step} & set(meas))
        ranks = sorted({k for k, _ in by_rank_step})
        per_rank = [
            predict_step_times(
                calib, {s: by_rank_step[(k, s)] for s in common if (k, s) in by_rank_step}, pp=pp
            )
            for k in ranks
        ]
        return common, np.array([max(pr.get(s, 0.0) for pr in per_rank) for s in common])

    own_steps, own_pred = predicted(records, measured)
    overhead = float(np.median(np.array([measured[s] for s in own_steps]) - own_pred))
    steps, pred = predicted(other_records, other_measured)
    if not steps:
        raise ValueError("a --predict-records file has no steps with micro-batch records")
    meas = np.array([other_measured[s] for s in steps])
    rel = np.abs(pred + overhead - meas) / meas
    return {
        "steps_compared": len(steps),
        "mean_abs_rel_error": float(rel.mean()),
        "max_abs_rel_error": float(rel.max()),
    }


def _parse_records(raw: list, source: str) -> list[MicroBatchRecord]:
    records = []
    for i, item in enumerate(raw):
        if isinstance(item, dict):
            if "doc_lens" not in item or "seconds" not in item:
                raise ValueError(f"{source}: micro-batch record {i} needs 'doc_lens' and 'seconds'")
            lens, secs, step = item["doc_lens"], item["seconds"], item.get("step", -1)
            rank = item.get("rank", 0)
            extra = {
                "stage": int(item.get("stage", -1)),
                "mb": int(item.get("mb", -1)),
                "fwd_s": None if item.get("fwd_s") is None else float(item["fwd_s"]),
                "bwd_s": None if item.get("bwd_s") is None else float(item["bwd_s"]),
            }
            if extra["stage"] >= 0 and (
                extra["mb"] < 0
                or extra["fwd_s"] is None
                or extra["bwd_s"] is None
                or extra["fwd_s"] <= 0
                or extra["bwd_s"] <= 0
            ):
                raise ValueError(
                    f"{source}: pipeline record {i} (stage {extra['stage']}) needs 'mb' >= 0 and "
                    f"'fwd_s', 'bwd_s' > 0"
                )
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            (lens, secs), step, rank, extra = item, -1, 0, {}
        else:
            raise ValueError(f"{source}: micro-batch record {i} must be {{doc_lens, seconds}}")
        if (
            not isinstance(lens, list)
            or not lens
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in lens)
        ):
            raise ValueError(
                f"{source}: micro-batch record {i} doc_lens = {lens!r} must be positive integers"
            )
        if not isinstance(secs, (int, float)) or secs <= 0:
            raise ValueError(f"{source}: micro-batch record {i} seconds = {secs!r} must be > 0")
        records.append(
            MicroBatchRecord(
                np.asarray(lens, dtype=np.int64), float(secs), int(step), int(rank), **extra
            )
        )
    return records


def load_records(path: str | Path) -> tuple[list[MicroBatchRecord], dict[int, float], dict]:
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
        for s in raw.get("steps", []):
            steps[int(s["step"])] = float(s["seconds"])
        raw = raw.get("microbatches", [])
    if not isinstance(raw, list):
        raise ValueError(f"calibration file {path}: expected a list of micro-batch records")
    return _parse_records(raw, str(path)), steps, meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_wlb.sim.calibrate",
        description="Fit cost-model coefficients and achieved throughputs to measured micro-batch "
        "times, and check the step-time prediction.",
    )
    parser.add_argument("--records", required=True, help="calibration JSON (see module docstring)")
    parser.add_argument("--model", default=None, help="model preset, to derive achieved TFLOP/s")
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--cp", type=int, default=None)
    parser.add_argument("--pp", type=int, default=None)
    parser.add_argument("--no-overhead", action="store_true", help="fit without the constant c")
    parser.add_argument(
        "--predict-records",
        action="append",
        default=[],
        metavar="FILE",
        help="another run's calibration JSON (e.g. another mode) whose step times are predicted "
        "from this file's fit (repeatable); reported under step_prediction.cross",
    )
    parser.add_argument(
        "--hardware-out", default=None, help="write the fitted HardwareProfile JSON"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    try:
        records, steps, meta = load_records(args.records)
        others = [load_records(path)[:2] for path in args.predict_records]
        pipeline_records = records if is_pipeline(records) else None
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
        model_name = args.model or (
            meta.get("model") if isinstance(meta.get("model"), str) else None
        )
        if model_name:
            hw = calib.hardware(get_model(model_name), layout)
            out["attn_tflops"] = hw.attn_tflops
            out["gemm_tflops"] = hw.gemm_tflops
            if args.hardware_out:
                hw.to_json(args.hardware_out)
        if steps and pipeline_records is not None:
            n_stages = len({r.stage for r in pipeline_records})
            out["step_prediction"] = pipeline_step_prediction(
                pipeline_records,
                steps,
                pp=args.pp or int(lay.get("pp", n_stages)),
                predict=[(o[0], o[1]) for o in others],
                overhead=not args.no_overhead,
            )
        elif steps:
            out["step_prediction"] = step_prediction_error(calib, records, steps, pp=layout.pp)
            if others:
                out["step_prediction"]["cross"] = [
                    cross_step_prediction(calib, records, steps, o[0], o[1], pp=layout.pp)
                    for o in others
                ]
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
