"""Benchmark statistics: measured imbalance, the noise floors, fit errors and the interval over
repeated runs. e2e_bench computes them from its jobs' metrics logs, imbalance_report from the
records it writes (docs/benchmarks_e2e.md names every figure)."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from torchtitan_wlb.cost_fit import Coefficients, OnlineFitConfig, stage_sums

# ----------------------------------------------------------------------------- imbalance


def imbalance(groups: Iterable[np.ndarray]) -> float:
    """Time-weighted imbalance of groups of micro-batch times (a step's, or one pipeline stage's
    of a step): Σ max / Σ mean over the groups, 1.0 when there is no time at all."""
    top = total = 0.0
    for times in groups:
        if times.size:
            top += float(times.max())
            total += float(times.mean())
    return top / total if total else 1.0


def measured_imbalance(
    per_rank: list[dict[int, dict]], steps: list[int], parallel: str, device: bool = False
) -> float:
    """Time-weighted micro-batch imbalance (Σ max / Σ mean of fwd + bwd): per stage under PP, the
    slowest rank under CP, else all ranks pooled; on the wall clock, or the device's (``device``)."""
    return imbalance(g for s in steps for g in _step_groups(per_rank, s, parallel, device))


def _step_groups(
    per_rank: list[dict[int, dict]], step: int, parallel: str, device: bool
) -> list[np.ndarray]:
    """Step ``step``'s micro-batch times, one array per group :func:`imbalance` compares."""
    fwd, bwd = ("fwd_device_s", "bwd_device_s") if device else ("fwd_s", "bwd_s")
    mbs = "micro_batch_device_times_s" if device else "micro_batch_times_s"
    if parallel == "pp2":
        acts = [act for r in per_rank for act in r[step].get("pp_actions", [])]
        return [np.add(f, b) for a in acts for f, b in zip(a[fwd], a[bwd], strict=True)]
    if parallel == "cp2":
        return [np.max([r[step][mbs] for r in per_rank], axis=0)]
    return [np.concatenate([r[step][mbs] for r in per_rank])]


def half_gap(
    per_rank: list[dict[int, dict]], steps: list[int], parallel: str, device: bool = False
) -> float | None:
    """|measured imbalance of the later half of ``steps`` - that of the earlier half|: on the
    noise floor's identical micro-batches, how far two windows of one run land apart, a perfectly
    balanced plan's own spread, to read ``measured_imbalance - floor`` against. None under 2 steps.
    """
    if len(steps) < 2:
        return None
    h = len(steps) // 2
    halves = [
        measured_imbalance(per_rank, part, parallel, device) for part in (steps[:h], steps[h:])
    ]
    return abs(halves[1] - halves[0])


def predicted_imbalance(plans: list[dict[str, Any]], step_times: list[float]) -> float:
    """The packer's own max/mean micro-batch workload of each step, weighted by the step's
    measured time. Not Σ max / Σ mean: a step's workloads are in the units of the model that
    packed it, and under the online cost model that changes (FLOPs before the first refit,
    seconds after), so the sums would be those of the FLOP-priced steps alone."""
    pairs = [
        (rec["wlb/max_workload"] / rec["wlb/mean_workload"], t)
        for rec, t in zip(plans, step_times, strict=True)
        if rec.get("wlb/mean_workload", 0.0) > 0
    ]
    if not pairs:
        return 1.0
    ratios, weights = np.asarray(pairs, np.float64).T
    return float(ratios @ weights / weights.sum()) if weights.sum() > 0 else 1.0


def pipeline_balance_loss(records: dict[str, Any], pp: int = 2) -> float:
    """The timed steps' measured time over what a 1F1B pipeline takes when every micro-batch of a
    step costs that step's mean on each stage (the busiest stage's work x (m + pp - 1) / m): the
    most that better balance could still save (1.0: nothing; the stages' split is not counted)."""
    work: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    n_mb: dict[int, set[int]] = collections.defaultdict(set)
    for mb in records["microbatches"]:
        work[mb["step"]][mb["stage"]] += mb["seconds"]
        n_mb[mb["step"]].add(mb["mb"])
    measured = sum(s["seconds"] for s in records["steps"] if s["step"] in work)
    m = {s: len(ids) for s, ids in n_mb.items()}
    balanced = sum(max(w.values()) * (m[s] + pp - 1) / m[s] for s, w in work.items())
    return measured / balanced if balanced else float("nan")


# ---------------------------------------------------------------------------- fit errors


def fit_error(
    micro_batches: list[dict[str, Any]], coef: list[float], cp: int, key: str = "seconds"
) -> float:
    """Mean absolute relative error of ``coef`` = ``(a, b, c[, g])`` on the micro-batches' ``key``
    time: on the trainer's ``fit_features`` where recorded, else ``(a Σd² + b Σd) / cp + c``."""
    if not micro_batches:
        return float("nan")
    # The trainer's predictor (g None: b for both token kinds) on the features it fits.
    model = Coefficients(*coef[:3], g=coef[3] if len(coef) > 3 else None)
    rows = []
    for m in micro_batches:
        d = np.asarray(m["doc_lens"], float)
        rows.append(m.get("fit_features") or (float(d @ d) / cp, float(d.sum()) / cp, 0.0))
    t = np.asarray([m[key] for m in micro_batches], float)
    return float(np.mean(np.abs(model.predict(*np.asarray(rows).T) - t) / t))


def in_use_error(
    micro_batches: list[dict[str, Any]],
    adoptions: list[tuple[int, list[float]]],
    cp: int,
    key: str = "seconds",
) -> float:
    """:func:`fit_error` of the online model as the packer used it: each micro-batch predicted by
    the adopted model that packed its step (``adoptions``: ``(first step, coefficients)`` in step
    order), fitted on steps that ran before it, so this is a prediction, not a fit. The last
    model alone (``fit_error``) is judged on steps it was fitted on and on steps long before it,
    whose machine may have run faster or slower. Steps the starting model packed are left out: it
    predicts FLOPs, not seconds."""
    first = np.asarray([step for step, _ in adoptions], np.int64)
    groups: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for m in micro_batches:
        if (i := int(np.searchsorted(first, m["step"], side="right")) - 1) >= 0:
            groups[i].append(m)
    n = sum(map(len, groups.values()))
    if not n:
        return float("nan")
    return sum(fit_error(ms, adoptions[i][1], cp, key) * len(ms) for i, ms in groups.items()) / n


def stage_totals(micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """PP records summed over the stages: one per micro-batch, as the online fit has them."""
    keys = [(m["step"], m["mb"], tuple(m["doc_lens"])) for m in micro_batches]
    stages = [m["stage"] for m in micro_batches]
    done, sums = stage_sums(keys, stages, [(m["seconds"], m["device_s"]) for m in micro_batches])
    return [
        {"step": key[0], "doc_lens": list(key[2]), "seconds": sec, "device_s": dev}
        for key, (sec, dev) in zip(done, sums.tolist(), strict=True)
    ]


# ------------------------------------------------------------------------- noise floors


def best_constant_error(times: np.ndarray) -> float:
    """The least mean absolute relative error any single prediction ``m`` of ``times`` attains,
    ``min_m mean(|m - t| / t)``: at the median of ``t`` weighted by ``1 / t``."""
    t = np.sort(np.asarray(times, np.float64))
    if not t.size:
        return float("nan")
    w = 1.0 / t
    m = t[int(np.searchsorted(np.cumsum(w), 0.5 * w.sum()))]
    return float(np.mean(np.abs(m - t) / t))


def window_constant_error(times: np.ndarray, steps: np.ndarray, window: int, lag: int) -> float:
    """Mean absolute relative error of predicting each step's ``times`` by the online fit's
    estimate of a constant, ``Σ(1/t) / Σ(1/t²)`` (least squares in relative error, as the trainer
    weighs its rows), over the ``window`` steps that end ``lag`` steps before it, the freshest
    rows a refit that packs the step can have seen. Steps without a full window are left out."""
    t, steps = np.asarray(times, np.float64), np.asarray(steps, np.int64)
    errors = []
    for s in np.unique(steps):
        before = (steps > s - lag - window) & (steps <= s - lag)
        if np.unique(steps[before]).size < window:
            continue
        past = t[before]
        m = (1.0 / past).sum() / (1.0 / past**2).sum()
        errors.append(np.abs(m - t[steps == s]) / t[steps == s])
    return float(np.mean(np.concatenate(errors))) if errors else float("nan")


FIT_ERROR_FLOOR_KEYS = ("fit_error_floor", "fit_error_floor_wall", "fit_error_floor_in_use")


def fit_error_floor(micro_batches: list[dict[str, Any]], parallel: str, window: int) -> dict:
    """The noise floor of the online model's fit error: the floor's micro-batches are identical,
    so a model that knew their cost exactly still errs by their timing noise. ``fit_error_floor``
    (device clock; ``_wall`` on the wall's) is the least error of one prediction for the whole
    pass, the bound for ``fit_mean_abs_error`` (one model judged on every step);
    ``fit_error_floor_in_use`` predicts each step from the window before it, as refits do, the
    bound for ``fit_mean_abs_error_in_use`` (docs/benchmarks_e2e.md). Rows as the fit has them: per
    rank, under PP (``parallel`` "pp2") one per micro-batch summed over its stages; ``window``:
    the online fit's window in steps."""
    rows = stage_totals(micro_batches) if parallel == "pp2" else micro_batches
    if not rows:
        return {}
    dev = np.asarray([m["device_s"] for m in rows], np.float64)
    steps = np.asarray([m["step"] for m in rows], np.int64)
    lag = OnlineFitConfig().apply_lag_steps  # the trainer's default; e2e_bench keeps it
    whole, wall = best_constant_error(dev), best_constant_error([m["seconds"] for m in rows])
    in_use = window_constant_error(dev, steps, window, lag)
    return dict(zip(FIT_ERROR_FLOOR_KEYS, (whole, wall, in_use), strict=True))


# ------------------------------------------------------------------ over repeated runs


# Two-sided 95 % quantiles of Student's t, 1 to 30 degrees of freedom.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t95(df: int) -> float:
    """Student's t two-sided 95 % quantile: tabulated to 30 degrees of freedom, past them the
    Cornish-Fisher series in 1/df (within 0.001 of the exact value there)."""
    if df < 1:
        raise ValueError(f"t95: degrees of freedom must be >= 1, got {df}")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def across_runs(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Every per-run figure over ``--runs``: its mean, and from two runs its min, max and the 95 %
    interval of the mean (``_ci95_low`` / ``_ci95_high``, Student's t). Machine noise moves one
    run's figures by about as much as the effects measured (docs/benchmarks_e2e.md), so a target is
    read on the interval, not on one run. A figure some runs lack (a fit error where no refit was
    adopted) is taken over the runs that have it, and ``_runs`` says how many those were."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for run in runs for k in run if k != "modes"):
        values = np.asarray([run[key] for run in runs if key in run], np.float64)
        out[key] = float(values.mean())
        if values.size < len(runs):
            out[f"{key}_runs"] = values.size
        if values.size > 1:
            half = t95(values.size - 1) * float(values.std(ddof=1)) / math.sqrt(values.size)
            out[f"{key}_min"], out[f"{key}_max"] = float(values.min()), float(values.max())
            out[f"{key}_ci95_low"], out[f"{key}_ci95_high"] = out[key] - half, out[key] + half
    return out
