"""The fit of micro-batch times: ``seconds ~= a sum(d^2) + b sum(d) + c`` (a, b, c >= 0).

``a`` and ``b`` are the cost model's coefficients in seconds, ``c`` a fixed per-micro-batch overhead
(launches, collective latency); with a model and layout they also give achieved throughputs.
Pipeline runs fit forward and backward per stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from torchtitan_wlb.cost_model import CostModel, nnls
from torchtitan_wlb.models.catalogue import ModelSpec
from torchtitan_wlb.sim.hardware import HardwareProfile, Layout
from torchtitan_wlb.sim.records import MicroBatchRecord


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
