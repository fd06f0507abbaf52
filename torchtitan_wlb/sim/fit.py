"""The least-squares fit of micro-batch times: ``seconds ~= a sum(d^2) + b sum(d) + c``.

Over each micro-batch's documents ``d`` (a, b, c >= 0, relative least squares): ``a`` and ``b`` are the
cost model's coefficients in seconds (CostModel.from_coefficients), ``c`` a fixed per-micro-batch
overhead (kernel launches, collective latency). With a model and a layout, ``a`` and ``b`` also give
the achieved attention and GEMM throughput of a HardwareProfile. Pipeline runs fit forward and
backward separately per stage.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.models.catalogue import ModelSpec
from torchtitan_wlb.sim.hardware import HardwareProfile
from torchtitan_wlb.sim.presets import Layout
from torchtitan_wlb.sim.records import MicroBatchRecord


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
        coef = np.array([self.attn_coef, self.linear_coef, self.overhead_s])
        return features(doc_lens_list) @ coef

    def cost_model(self) -> CostModel:
        """The fitted coefficients as the project's CostModel (unit: seconds)."""
        return CostModel.from_coefficients(self.attn_coef, self.linear_coef, unit="seconds")

    def summary(self) -> dict:
        return {"a": self.attn_coef, "b": self.linear_coef, "c": self.overhead_s,
                "mean_abs_rel_error": self.mean_abs_rel_error,
                "max_abs_rel_error": self.max_abs_rel_error}  # fmt: skip

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
        attn_flops_per_d2 = model.n_layers * 2.0 * model.head_dim * model.n_heads / tp / cp
        gemm_flops_per_d = (
            (model.n_layers * 2.0 * model.params_per_layer + 2.0 * model.dim * model.vocab_size)
            / tp
            / cp
        )
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
    return Calibration(
        attn_coef=float(coef[0]),
        linear_coef=float(coef[1]),
        overhead_s=float(coef[2]),
        n_records=len(records),
        mean_abs_rel_error=float(rel.mean()),
        max_abs_rel_error=float(rel.max()),
    )


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
