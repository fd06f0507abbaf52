"""The end of the data: the documents still held, spread over balanced final steps instead of
one step as slow as its heaviest micro-batch (max/mean of 1.6-17 on real workloads; docs/packing.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchtitan_wlb.packing.placement import fill_rounds


@dataclass(frozen=True)
class DrainPlan:
    """Where :func:`plan_drain` puts each held document."""

    steps: int
    """Number of final steps planned (``S``)."""
    step: np.ndarray
    """Per document: its final step (0 = the heaviest, emitted first)."""
    micro_batch: np.ndarray
    """Per document: its micro-batch within that step (``0..N-1``)."""
    predicted_time: float
    """Sum over the planned steps of the heaviest micro-batch's workload."""


def _chunked(costs: np.ndarray, lens: np.ndarray, n: int, cap: int, steps: int) -> DrainPlan | None:
    """Even split: place into ``steps * n`` micro-batches, sort them by workload, cut into steps
    of ``n`` (similar costs share a step). ``None`` when a document finds no room."""
    loads = np.zeros(steps * n)
    tokens = np.zeros(steps * n, np.int64)
    bins = fill_rounds(loads, tokens, costs, lens, cap)
    if (bins < 0).any():
        return None
    rank = np.empty(steps * n, np.int64)
    rank[np.argsort(-loads, kind="stable")] = np.arange(steps * n)
    by_rank = rank[bins]
    predicted = float(np.sort(loads)[::-1].reshape(steps, n)[:, 0].sum())
    return DrainPlan(steps, by_rank // n, by_rank % n, predicted)


def _levelled(
    costs: np.ndarray, lens: np.ndarray, n: int, cap: int, bound: float = np.inf
) -> DrainPlan | None:
    """Step by step: the ``n`` costliest documents left set the step's level, the others fill
    every micro-batch up to it (largest first, under the token cap). ``None`` as soon as the
    predicted time would exceed ``bound`` (the plan to beat): it only grows with more steps.
    """
    step = np.full(costs.size, -1, np.int64)
    mb = np.full(costs.size, -1, np.int64)
    left = np.argsort(-costs, kind="stable")
    predicted, k = 0.0, 0
    while left.size:
        seeds, rest = left[:n], left[n:]
        loads = np.zeros(n)
        tokens = np.zeros(n, np.int64)
        loads[: seeds.size] = costs[seeds]
        tokens[: seeds.size] = lens[seeds]
        step[seeds], mb[seeds] = k, np.arange(seeds.size)
        bins = fill_rounds(loads, tokens, costs[rest], lens[rest], cap, float(loads.max()))
        placed = bins >= 0
        step[rest[placed]], mb[rest[placed]] = k, bins[placed]
        left = rest[~placed]
        predicted += float(loads.max())
        k += 1
        # The steps left cost at least their mean and their costliest document (margin: rounding).
        rest = costs[left]
        if predicted + max(rest.sum() / n, rest.max(initial=0.0)) * (1 - 1e-9) > bound:
            return None
    return DrainPlan(k, step, mb, predicted)


def plan_drain(
    costs: np.ndarray, lens: np.ndarray, n: int, cap: int, extra_steps: int = 2
) -> DrainPlan:
    """Final steps of ``n`` micro-batches (cap ``cap`` tokens) for the held documents: the even
    split over the fewest feasible steps or up to ``extra_steps`` more, or the levelled plan,
    whichever is predicted faster (ties: fewer steps)."""
    costs = np.asarray(costs, np.float64)
    lens = np.asarray(lens, np.int64)
    if lens.size == 0:
        return DrainPlan(0, np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0)
    steps = max(1, -(-int(lens.sum()) // (n * cap)))
    while (best := _chunked(costs, lens, n, cap, steps)) is None:
        steps += 1  # bin packing under the cap may need more than the token bound
    fewest = best.steps
    for more in range(1, extra_steps + 1):
        if fewest + more > lens.size:  # a step beyond one document each only adds fillers
            break
        trial = _chunked(costs, lens, n, cap, fewest + more)
        if trial is not None and trial.predicted_time < best.predicted_time * (1 - 1e-9):
            best = trial
    levelled = _levelled(costs, lens, n, cap, best.predicted_time)
    if levelled is not None and (
        levelled.predicted_time < best.predicted_time * (1 - 1e-9)
        or (levelled.predicted_time <= best.predicted_time and levelled.steps < best.steps)
    ):
        best = levelled
    return best
