"""The end of the data: spread the documents still held over balanced final steps.

When the stream runs out, a packer may still hold outliers in its queues and regular documents it
carried. Releasing them all in one step makes that step as slow as its heaviest micro-batch while
the others idle (max/mean of 1.6-17 on real workloads), and a step can hold only ``N * S_max``
tokens anyway. :func:`plan_drain` instead treats the held documents as one multiway-partition
problem: place them (largest cost first, vectorised rounds) into ``S * N`` micro-batches, sort the
micro-batches by workload and cut the sorted list into ``S`` steps of ``N``. Documents of similar
cost then share a step, so each final step is as balanced as its documents allow. ``S`` is the
fewest steps whose micro-batches hold the documents under the token cap, or up to
``extra_steps`` more when that lowers the predicted time of the drain (the sum over its steps of
the heaviest micro-batch); ties go to fewer steps.

A packer calls it on every flushing step and emits the first (heaviest) planned step only; the
rest stays pending and is planned again next step, so the drain is a pure function of the
documents held and needs no state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchtitan_wlb.packing.placement import fill_rounds

__all__ = ["DrainPlan", "plan_drain"]


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
    """Even split: place into ``steps * n`` micro-batches, sort them, cut into steps of ``n``.

    ``None`` when some document finds no room under the token cap.
    """
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
    predicted time exceeds ``bound`` (the plan to beat): it only grows with more steps.

    A step that holds a long document costs that document's time whatever else it holds, so its
    other micro-batches should carry as much work as fits under that level: what they take is
    work no later step pays for. The even split cannot do this; it leaves the micro-batches
    beside an outlier at the average.
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
        if rest.size:
            bins = fill_rounds(loads, tokens, costs[rest], lens[rest], cap, float(loads.max()))
            placed = bins >= 0
            step[rest[placed]], mb[rest[placed]] = k, bins[placed]
            left = rest[~placed]
        else:
            left = rest
        predicted += float(loads.max())
        k += 1
        if predicted > bound:
            return None
    return DrainPlan(k, step, mb, predicted)


def plan_drain(
    costs: np.ndarray, lens: np.ndarray, n: int, cap: int, extra_steps: int = 2
) -> DrainPlan:
    """Plan the final steps for the documents left at the end of the data.

    Two candidate plans, the one with the lower predicted time wins (ties: fewer steps): the
    even split over the fewest feasible steps (or up to ``extra_steps`` more), and the levelled
    plan (:func:`_levelled`). The levelled plan wins when long documents remain, the even split
    when the documents are many and alike.

    Args:
        costs: predicted workload of each held document.
        lens: token count of each held document (each ``<= cap``).
        n: micro-batches per step.
        cap: token cap of one micro-batch (``S_max``).
        extra_steps: how many steps beyond the fewest feasible the even split tries.
    """
    costs = np.asarray(costs, np.float64)
    lens = np.asarray(lens, np.int64)
    if lens.size == 0:
        return DrainPlan(0, np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0)
    steps = max(1, -(-int(lens.sum()) // (n * cap)))
    best = _chunked(costs, lens, n, cap, steps)
    while best is None:  # bin packing under the cap may need more than the token bound
        steps += 1
        best = _chunked(costs, lens, n, cap, steps)
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
