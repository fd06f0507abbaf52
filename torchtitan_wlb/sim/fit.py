"""Calibration data and its fit: measured micro-batch times (the records file of
docs/simulator.md#calibration) and ``seconds ~= a sum(d^2) + b sum(d) + c`` (a, b, c >= 0).

``a`` and ``b`` are the cost model's coefficients in seconds, ``c`` a fixed per-micro-batch overhead
(launches, collective latency). Pipeline runs write one record per micro-batch *and stage*, fitted
forward and backward per stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from torchtitan_wlb.cost_model import CostModel, nnls
from torchtitan_wlb.models.catalogue import ModelSpec
from torchtitan_wlb.sim.hardware import HardwareProfile, Layout


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


_INT_FIELDS = {"step": -1, "rank": 0, "stage": -1, "mb": -1}  # optional, with their defaults


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def parse_records(raw: list, source: str) -> list[MicroBatchRecord]:
    """Validate a list of JSON records (dicts, or ``[doc_lens, seconds]`` pairs)."""
    records = []
    for i, item in enumerate(raw):
        where = f"{source}: micro-batch record {i}"
        if isinstance(item, (list, tuple)) and len(item) == 2:
            item = {"doc_lens": item[0], "seconds": item[1]}
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be {{doc_lens, seconds}}")
        if "doc_lens" not in item or "seconds" not in item:
            raise ValueError(f"{where} needs 'doc_lens' and 'seconds'")
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
        steps = {int(s["step"]): float(s["seconds"]) for s in raw.get("steps", [])}
        raw = raw.get("microbatches", [])
    if not isinstance(raw, list):
        raise ValueError(f"calibration file {path}: expected a list of micro-batch records")
    return parse_records(raw, str(path)), steps, meta


def whole_model_records(records: list[MicroBatchRecord]) -> list[MicroBatchRecord]:
    """Per-stage records summed over the stages (each micro-batch's whole time)."""
    by_mb: dict[tuple[int, int], list[MicroBatchRecord]] = {}
    for r in records:
        by_mb.setdefault((r.step, r.mb), []).append(r)
    n_stages = len({r.stage for r in records})
    return [
        MicroBatchRecord(rs[0].doc_lens, float(sum(r.seconds for r in rs)), step)
        for (step, _), rs in sorted(by_mb.items())
        if len({r.stage for r in rs}) == n_stages
    ]


def pipeline_steps(records: list[MicroBatchRecord]) -> dict[int, dict]:
    """step -> {"lens": [doc_lens per mb], "fwd", "bwd": measured [n_stages, m]}; steps missing
    an action (a rank's log is incomplete) are left out."""
    row = {k: i for i, k in enumerate(sorted({r.stage for r in records if r.stage >= 0}))}
    by_step: dict[int, list[MicroBatchRecord]] = {}
    for r in records:
        if r.stage >= 0 and r.step >= 0:
            by_step.setdefault(r.step, []).append(r)
    out = {}
    for step, recs in by_step.items():
        m = max(r.mb for r in recs) + 1
        fwd, bwd = np.full((len(row), m), np.nan), np.full((len(row), m), np.nan)
        lens: list[np.ndarray | None] = [None] * m
        for r in recs:
            if not np.isnan(fwd[row[r.stage], r.mb]):
                raise ValueError(
                    f"step {step}: two records for stage {r.stage}, micro-batch {r.mb}; pipeline "
                    f"calibration supports one pipeline (DP = 1)"
                )
            fwd[row[r.stage], r.mb], bwd[row[r.stage], r.mb] = r.fwd_s, r.bwd_s
            lens[r.mb] = r.doc_lens
        if not (np.isnan(fwd).any() or np.isnan(bwd).any() or any(x is None for x in lens)):
            out[step] = {"lens": lens, "fwd": fwd, "bwd": bwd}
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

    def hardware(self, model: ModelSpec, layout: Layout, base: HardwareProfile | None = None):
        """Per-GPU throughputs implied by the fit: ``a`` = attention FLOPs per squared token (fwd
        + bwd) / attention throughput, ``b`` = GEMM FLOPs per token / GEMM throughput, with the
        element-wise time and exposed communication folded into the GEMM throughput."""
        base = base or HardwareProfile()
        tp, cp = layout.tp, layout.cp
        attn_flops_per_d2 = model.n_layers * 2.0 * model.head_dim * model.n_heads / tp / cp
        gemm = model.n_layers * 2.0 * model.params_per_layer + 2.0 * model.dim * model.vocab_size
        gemm_flops_per_d = gemm / tp / cp
        attn = attn_flops_per_d2 * (1.0 + base.bwd_attn_factor) / max(self.attn_coef, 1e-30)
        gemm = gemm_flops_per_d * (1.0 + base.bwd_gemm_factor) / max(self.linear_coef, 1e-30)
        return replace(base, name=f"{base.name}-calibrated", attn_tflops=float(attn / 1e12),
                       gemm_tflops=float(gemm / 1e12), elementwise_bytes_per_token_dim=1e-9,
                       tp_overlap=1.0, cp_overlap=1.0)  # fmt: skip


def features(doc_lens_list: list[np.ndarray]) -> np.ndarray:
    """[n, 3] regressors (sum d^2, sum d, 1) of each micro-batch, vectorised over documents."""
    counts = np.array([len(d) for d in doc_lens_list], dtype=np.int64)
    flat = np.concatenate([np.asarray(d, dtype=np.float64) for d in doc_lens_list] + [np.zeros(0)])
    owner = np.repeat(np.arange(len(doc_lens_list)), counts)
    sq = np.bincount(owner, weights=flat * flat, minlength=len(doc_lens_list))
    lin = np.bincount(owner, weights=flat, minlength=len(doc_lens_list))
    return np.stack([sq, lin, np.ones(len(doc_lens_list))], axis=1)


def fit(records: list[MicroBatchRecord], overhead: bool = True) -> Calibration:
    """Fit ``seconds ~ a sum d^2 + b sum d (+ c)``, weighted so each record counts alike."""
    if len(records) < 3:
        raise ValueError(f"calibration needs at least 3 micro-batch records, got {len(records)}")
    x_all = features([r.doc_lens for r in records])
    y = np.array([r.seconds for r in records], dtype=np.float64)
    if np.any(y <= 0):
        i = int(np.flatnonzero(y <= 0)[0])
        raise ValueError(f"micro-batch record {i}: seconds = {y[i]!r} must be > 0")
    x = x_all if overhead else x_all[:, :2]
    w = 1.0 / y
    col_scale = np.abs(x * w[:, None]).max(axis=0)
    col_scale[col_scale == 0] = 1.0
    coef = nnls(x * w[:, None] / col_scale, y * w) / col_scale
    coef = np.concatenate([coef, np.zeros(3 - coef.size)])
    rel = np.abs(x_all @ coef - y) / y
    a, b, c = (float(x) for x in coef)
    return Calibration(a, b, c, len(records), float(rel.mean()), float(rel.max()))


@dataclass(frozen=True)
class PipelineCalibration:
    """Per-stage fits: stage -> Calibration of its forward (the last with the loss), backward."""

    fwd: dict[int, Calibration]
    bwd: dict[int, Calibration]

    def predict(self, doc_lens_list: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return tuple(
            np.stack([part[k].predict(doc_lens_list) for k in sorted(part)])
            for part in (self.fwd, self.bwd)
        )

    def summary(self) -> dict:
        return {
            f"stage{k}_{kind}": part[k].summary()
            for k in sorted(self.fwd)
            for kind, part in (("fwd", self.fwd), ("bwd", self.bwd))
        }


def fit_pipeline(records: list[MicroBatchRecord], overhead: bool = True) -> PipelineCalibration:
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
