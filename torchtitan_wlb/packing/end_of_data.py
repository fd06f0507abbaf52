"""The end of the data: the documents still held, spread over balanced final steps instead of
one step as slow as its heaviest micro-batch (max/mean of 1.6-17 on real workloads; docs/packing.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchtitan_wlb.packing.placement import fill_rounds

# A plan with more final steps must be predicted this much faster: each step adds delay to the
# documents it holds (and a step's fixed cost in training) for a gain in the noise otherwise.
_STEP_GAIN = 1e-3
_EXTRA_STEPS = 2  # even splits tried beyond the fewest steps that hold the documents


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
    rank = np.argsort(np.argsort(-loads, kind="stable"))  # 0: the heaviest micro-batch
    by_rank = rank[bins]
    predicted = float(np.sort(loads)[::-1].reshape(steps, n)[:, 0].sum())
    return DrainPlan(steps, by_rank // n, by_rank % n, predicted)


def _fill_densest_first(
    loads: np.ndarray, tokens: np.ndarray, costs: np.ndarray, lens: np.ndarray, cap: int
) -> np.ndarray:
    """Fill up to the heaviest micro-batch's load (``costs`` descending) in two passes: first the
    costliest documents the micro-batches below that level have room for, then the rest. One pass
    fills them with mid-sized documents to the token cap while the densest wait for a later step,
    which is then lopsided (docs/packing.md, "The end of the data")."""
    level = float(loads.max())
    free = int((cap - tokens)[loads < level].sum())
    k = int(np.cumsum(lens).searchsorted(free, side="right"))
    if not 0 < k < costs.size:
        return fill_rounds(loads, tokens, costs, lens, cap, level)
    first = fill_rounds(loads, tokens, costs[:k], lens[:k], cap, level)
    return np.concatenate([first, fill_rounds(loads, tokens, costs[k:], lens[k:], cap, level)])


def _levelled(
    costs: np.ndarray, lens: np.ndarray, n: int, cap: int, bound: float = np.inf
) -> DrainPlan | None:
    """Step by step: the ``n`` costliest documents left set the step's level, the others fill
    every micro-batch up to it (largest first, under the token cap). ``None`` as soon as the
    predicted time would exceed ``bound`` (the plan to beat): it only grows with more steps.
    """
    step, mb = np.full((2, costs.size), -1, np.int64)  # each document's final step, micro-batch
    left = np.argsort(-costs, kind="stable")
    predicted, k = 0.0, 0
    if costs.max() * n * -(-int(lens.sum()) // (n * cap)) <= costs.sum():
        return None  # no document above the even share: nothing for seeds to level
    while left.size:
        seeds, rest = left[:n], left[n:]
        loads = np.zeros(n)
        tokens = np.zeros(n, np.int64)
        loads[: seeds.size] = costs[seeds]
        tokens[: seeds.size] = lens[seeds]
        step[seeds], mb[seeds] = k, np.arange(seeds.size)
        bins = _fill_densest_first(loads, tokens, costs[rest], lens[rest], cap)
        placed = bins >= 0
        step[rest[placed]], mb[rest[placed]] = k, bins[placed]
        left = rest[~placed]
        predicted += float(loads.max())
        k += 1
        # The steps left cost at least their mean and their costliest document (margin: rounding).
        rest = costs[left]
        if predicted + max(rest.sum() / n, rest.max(initial=0.0)) * (1 - 1e-9) > bound:
            return None
        fewest = -(-int(lens[left].sum()) // (n * cap))
        if left.size and rest.max() * n * fewest <= rest.sum():
            # No document left is above the even share of the fewest steps: seeds would only
            # add a step per ``n`` documents (one step each at the end); the even plan ends it.
            while (tail := _chunked(rest, lens[left], n, cap, fewest)) is None:
                fewest += 1
            step[left], mb[left] = k + tail.step, tail.micro_batch
            predicted += tail.predicted_time
            k += tail.steps
            if predicted * (1 - 1e-9) > bound:
                return None
            break
    return DrainPlan(k, step, mb, predicted)


def _step_ratios(plan: DrainPlan, costs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per planned step: the heaviest micro-batch's workload and the mean."""
    loads = np.bincount(plan.step * n + plan.micro_batch, weights=costs, minlength=plan.steps * n)
    loads = loads.reshape(plan.steps, n)
    return loads.max(axis=1), loads.mean(axis=1)


def _top_up_last(
    plan: DrainPlan, costs: np.ndarray, lens: np.ndarray, n: int, cap: int
) -> DrainPlan:
    """With two final steps, fill documents of the first (each micro-batch keeps its costliest)
    move into the second up to its heaviest micro-batch, at no cost in time; kept only if the worse
    of the two steps' max/mean improves (docs/packing.md, "The end of the data")."""
    if plan.steps != 2:  # with more, the steps after the first are planned again next step
        return plan
    last = plan.steps - 1
    in_last = plan.step == last
    loads = np.bincount(plan.micro_batch[in_last], weights=costs[in_last], minlength=n)
    tokens = np.bincount(plan.micro_batch[in_last], weights=lens[in_last], minlength=n)
    tokens = tokens.astype(np.int64)
    # Each earlier micro-batch's costliest document (its seed) stays where it is.
    slot = plan.step * n + plan.micro_batch
    order = np.lexsort((-costs, slot))
    seed = np.zeros(costs.size, bool)
    seed[order[np.r_[True, slot[order][1:] != slot[order][:-1]]]] = True
    movable = np.flatnonzero(~in_last & ~seed)
    if movable.size == 0:
        return plan
    bins = fill_rounds(loads, tokens, costs[movable], lens[movable], cap, float(loads.max()))
    moved = movable[bins >= 0]
    if moved.size == 0:
        return plan
    step, mb = plan.step.copy(), plan.micro_batch.copy()
    step[moved], mb[moved] = last, bins[bins >= 0]
    trial = DrainPlan(plan.steps, step, mb, plan.predicted_time)
    old_max, old_mean = _step_ratios(plan, costs, n)
    new_max, new_mean = _step_ratios(trial, costs, n)
    if (new_max / new_mean).max() >= (old_max / old_mean).max() or new_max[0] < new_max[1]:
        return plan  # no better, or the first step would no longer be the heavier
    return DrainPlan(plan.steps, step, mb, float(new_max.sum()))


def _absorb_last(
    plan: DrainPlan, costs: np.ndarray, lens: np.ndarray, n: int, cap: int
) -> DrainPlan:
    """With two final steps, the second's documents go into the first when they fit under the
    cap and the one step is predicted faster than the two (a second step of a few short leftovers
    costs little time but is as unbalanced as a step can be: micro-batches with nothing)."""
    if plan.steps != 2 or int(lens.sum()) > n * cap:
        return plan  # more tokens than one step holds: some document would find no room
    first, last = plan.step == 0, plan.step == 1
    loads = np.bincount(plan.micro_batch[first], weights=costs[first], minlength=n)
    tokens = np.bincount(plan.micro_batch[first], weights=lens[first], minlength=n)
    tokens = tokens.astype(np.int64)
    moving = np.flatnonzero(last)
    bins = fill_rounds(loads, tokens, costs[moving], lens[moving], cap)
    if (bins < 0).any() or float(loads.max()) >= plan.predicted_time * (1 - 1e-9):
        return plan
    mb = plan.micro_batch.copy()
    mb[moving] = bins
    return DrainPlan(1, np.zeros(costs.size, np.int64), mb, float(loads.max()))


def _better(plan: DrainPlan, best: DrainPlan) -> bool:
    """Whether ``plan`` replaces ``best``: with more steps only ``_STEP_GAIN`` faster; else faster,
    or as fast in fewer steps."""
    gain = _STEP_GAIN if plan.steps > best.steps else 1e-9
    faster = plan.predicted_time < best.predicted_time * (1 - gain)
    return faster or (plan.predicted_time <= best.predicted_time and plan.steps < best.steps)


def plan_drain(
    costs: np.ndarray, lens: np.ndarray, n: int, cap: int, max_steps: int | None = None
) -> DrainPlan:
    """Final steps of ``n`` micro-batches (cap ``cap`` tokens) for the held documents: the even
    split over the fewest feasible steps or up to ``_EXTRA_STEPS`` more, or the levelled plan,
    whichever is predicted faster (more steps only for a gain of ``_STEP_GAIN``). ``max_steps``:
    the steps an earlier plan of these documents still has to come; a plan made again never adds
    steps to it (only when fewer cannot hold them)."""
    costs = np.asarray(costs, np.float64)
    lens = np.asarray(lens, np.int64)
    if lens.size == 0:
        return DrainPlan(0, np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0)
    steps = max(1, -(-int(lens.sum()) // (n * cap)))
    while (best := _chunked(costs, lens, n, cap, steps)) is None:
        steps += 1  # bin packing under the cap may need more than the token bound
    # More steps, unless the best is within _STEP_GAIN of what no plan beats: the mean micro-batch
    # workload of all the documents (each step's heaviest is at least its mean; margin: rounding).
    floor = float(costs.sum()) / n * (1 - 1e-9)
    limit = lens.size if max_steps is None else max(best.steps, max_steps)
    for steps in range(best.steps + 1, min(best.steps + _EXTRA_STEPS, lens.size, limit) + 1):
        if best.predicted_time * (1 - _STEP_GAIN) <= floor:
            break
        trial = _chunked(costs, lens, n, cap, steps)
        if trial is not None and _better(trial, best):
            best = trial
    levelled = _levelled(costs, lens, n, cap, best.predicted_time)
    if levelled is not None and levelled.steps <= limit and _better(levelled, best):
        best = levelled
    return _top_up_last(_absorb_last(best, costs, lens, n, cap), costs, lens, n, cap)
