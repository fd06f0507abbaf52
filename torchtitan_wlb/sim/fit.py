"""The cost model ``seconds ~= a sum(d^2) + b sum(d) + c`` fitted to micro-batch times, by the
online model's fit (:func:`torchtitan_wlb.cost_fit.fit_nnls`): of measured records
(``calibrate``) and of the simulated profiling micro-batches (``engine``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from torchtitan_wlb.cost_fit import FitStats, fit_nnls
from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.models.catalogue import ModelSpec
from torchtitan_wlb.sim.hardware import HardwareProfile, Layout
from torchtitan_wlb.sim.records import MicroBatchRecord, Records


def features(doc_lens_list: list[np.ndarray]) -> np.ndarray:
    """[n, 3] regressors (sum d^2, sum d, 1) of each micro-batch, vectorised over documents."""
    counts = np.array([len(d) for d in doc_lens_list], dtype=np.int64)
    flat = np.concatenate([np.asarray(d, dtype=np.float64) for d in doc_lens_list] + [np.zeros(0)])
    owner = np.repeat(np.arange(len(doc_lens_list)), counts)
    sq = np.bincount(owner, weights=flat * flat, minlength=len(doc_lens_list))
    lin = np.bincount(owner, weights=flat, minlength=len(doc_lens_list))
    return np.stack([sq, lin, np.ones(len(doc_lens_list))], axis=1)


def fit_coefficients(doc_lens_list: list[np.ndarray], seconds: np.ndarray, overhead: bool = True):
    """Non-negative (a, b, c) of ``seconds ~ a sum d^2 + b sum d (+ c)`` (c = 0 without overhead),
    in relative error so that each micro-batch counts alike; every row is fitted as given (no
    online checks). Raises ValueError when the rows cannot tell the terms apart."""
    sq, lin, _ = features(doc_lens_list).T
    stats = FitStats.from_samples(sq, lin, seconds)
    coef, why = fit_nnls(stats, constant=overhead, online_checks=False)
    if coef is None:
        raise ValueError(f"cannot fit the micro-batch times: {why}")
    a, b, _, c = coef
    return np.array([a, b, c])


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
        return {
            "a": self.attn_coef,
            "b": self.linear_coef,
            "c": self.overhead_s,
            "mean_abs_rel_error": self.mean_abs_rel_error,
            "max_abs_rel_error": self.max_abs_rel_error,
        }

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
        return replace(
            base,
            name=f"{base.name}-calibrated",
            attn_tflops=float(attn / 1e12),
            gemm_tflops=float(gemm / 1e12),
            elementwise_bytes_per_token_dim=1e-9,
            tp_overlap=1.0,
            cp_overlap=1.0,
        )


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
        a: {
            k: fit(
                [MicroBatchRecord(r.doc_lens, getattr(r, a)) for r in records if r.stage == k],
                overhead=overhead,
            )
            for k in stages
        }
        for a in ("fwd_s", "bwd_s")
    }
