"""Placement kernels: put documents into ``N`` micro-batches under a token cap.

Two kernels, both deterministic:

* :func:`lpt_place` — longest-processing-time greedy, one document at a time. Used only for the
  few documents that must be placed first (outliers, forced documents), so its Python loop runs
  over O(N) items, never over the whole batch.
* :func:`fill_rounds` — the same greedy rule (largest remaining document to the least-loaded
  micro-batch) applied in *rounds*: each round pairs the next ``k`` largest documents with the
  ``k`` least-loaded micro-batches that are still below the water level, in one vectorised
  operation. A batch of ``M`` documents takes about ``M / N`` rounds, and because documents are
  taken largest first, the last rounds place the smallest documents and even out the loads.
"""

from __future__ import annotations

import numpy as np

__all__ = ["water_level", "lpt_place", "fill_rounds"]

# Share of its deficit a micro-batch receives per round: large enough for few rounds, small
# enough that the last rounds still hold small documents to even out the loads.
_RUN_FRACTION = 0.7


def water_level(loads: np.ndarray, extra: float) -> float:
    """Level reached if ``extra`` work is poured into the least-loaded bins (no caps)."""
    s = np.sort(loads)
    cs = s.cumsum()
    need = s * np.arange(1, s.size + 1) - cs  # work to raise the k lowest bins to s[k-1]
    k = int(need.searchsorted(extra, side="right"))
    return float((cs[k - 1] + extra) / k)


def lpt_place(
    loads: np.ndarray,
    tokens: np.ndarray,
    costs: np.ndarray,
    lens: np.ndarray,
    cap: int,
    limit: float = np.inf,
) -> np.ndarray:
    """Greedy: each document (in the given order) to the least-loaded bin with room for it.

    ``loads`` and ``tokens`` are updated in place. A document is not placed (``-1``) when no bin
    has room or when placing it would lift the bin above ``limit``.
    """
    out = np.full(costs.size, -1, np.int64)
    for i in range(costs.size):
        room_ok = tokens + lens[i] <= cap
        if not room_ok.any():
            continue
        j = int(np.argmin(np.where(room_ok, loads, np.inf)))
        if loads[j] + costs[i] > limit:
            continue
        out[i] = j
        loads[j] += costs[i]
        tokens[j] += lens[i]
    return out


def fill_rounds(
    loads: np.ndarray,
    tokens: np.ndarray,
    costs: np.ndarray,
    lens: np.ndarray,
    cap: int,
    limit: float = np.inf,
) -> np.ndarray:
    """Place documents (largest cost first) in vectorised rounds; ``-1`` = did not fit.

    ``loads`` (float) and ``tokens`` (int) are the bins' current workload and token count and are
    updated in place. Each round computes the water level of the remaining work; every bin below
    it (least-loaded first) receives a contiguous run of the largest remaining documents worth
    about 70 % of its deficit, never lifting it above the level or its token cap. Deficits shrink
    geometrically from round to round while the documents get smaller, so a batch of ``M`` documents needs a
    logarithmic number of rounds, and the final rounds place the smallest documents, which even
    out the loads to within one small document (the greedy "largest first to the least loaded"
    rule, applied to runs instead of single documents). When no bin can take its run, the largest
    document goes to the least-loaded bin with room (so every round makes progress); a document
    that fits nowhere (token cap, or ``limit`` on the workload) stays unplaced.
    """
    out = np.full(costs.size, -1, np.int64)
    rem = np.argsort(-costs, kind="stable")  # stays sorted: rounds only remove documents
    while rem.size:
        c, t = costs[rem], lens[rem]
        room = cap - tokens
        if np.isfinite(limit):
            keep = (c <= limit - loads.min()) & (t <= room.max())
            if not keep.all():
                rem, c, t = rem[keep], c[keep], t[keep]
                if rem.size == 0:
                    break
        open_bins = room >= t.min()
        if not open_bins.any():
            break
        cc = c.cumsum()
        level = min(water_level(loads[open_bins], float(cc[-1])), limit)
        elig = (open_bins & (loads < level)).nonzero()[0]
        elig = elig[loads[elig].argsort(kind="stable")]
        ok = np.zeros(rem.size, bool)
        if elig.size:
            bounds = (_RUN_FRACTION * (level - loads[elig])).cumsum()
            start = cc - c
            n_in = int(start.searchsorted(bounds[-1], side="left"))  # a prefix: start grows
            slot = bounds.searchsorted(start[:n_in], side="right")  # run of each document
            first = np.minimum(slot.searchsorted(slot, side="left"), n_in - 1)
            ct = t[:n_in].cumsum()
            run_cost = cc[:n_in] - start[first]
            run_tok = ct - (ct[first] - t[first])
            bins = elig[slot]
            good = (loads[bins] + run_cost <= level) & (run_tok <= room[bins])
            # Keep each run's prefix only: stop at the first document that breaks a bound.
            bad = ~good
            bad_before = bad.cumsum() - bad
            good &= bad_before == bad_before[first]
            ok[:n_in] = good
        if not ok.any():
            # Documents larger than the deficits: one LPT round (the k largest documents to the
            # k least-loaded bins, where k counts the bins LPT would fill before the least-loaded
            # bin's next turn).
            asc = np.flatnonzero(open_bins)
            asc = asc[np.argsort(loads[asc], kind="stable")]
            asc = asc[loads[asc] < loads[asc[0]] + c[0]][: rem.size]
            k = asc.size
            fit = (t[:k] <= room[asc]) & (loads[asc] + c[:k] <= limit)
            if fit.any():
                sel = np.flatnonzero(fit)
                out[rem[sel]] = asc[sel]
                loads[asc[sel]] += c[sel]
                tokens[asc[sel]] += t[sel]
                rem = np.delete(rem, sel)
                continue
            # Constrained bins (token cap or ``limit``): every document that still fits somewhere
            # proposes a bin (the k-th least-loaded for the k-th document, else its least-loaded
            # fitting bin); each bin takes its largest proposer. Documents that fit nowhere now
            # never will (bins only fill up) and are dropped at once.
            # A document's least-loaded bin with room (the first of equals) is the least-loaded
            # of the bins with the most room: one of N prefixes of the bins sorted by room, so
            # it comes from an N x N table instead of a documents x N one. A document fits
            # somewhere iff it fits that bin (a bin with more load cannot take it either).
            nb = loads.size
            by_room = np.argsort(-room, kind="stable")
            rank = np.empty(nb, np.int64)
            rank[by_room] = np.arange(nb)
            prefix = rank[None, :] <= np.arange(nb)[:, None]
            least = np.argmin(np.where(prefix, loads[None, :], np.inf), axis=1)
            with_room = nb - room[by_room][::-1].searchsorted(t, side="left")
            best = least[np.maximum(with_room - 1, 0)]
            placeable = (with_room > 0) & (loads[best] + c <= limit)
            rem, c, t, best = rem[placeable], c[placeable], t[placeable], best[placeable]
            if rem.size == 0:
                break
            asc = np.argsort(loads, kind="stable")
            prop = asc[np.arange(rem.size) % nb]
            fits_prop = (t <= room[prop]) & (loads[prop] + c <= limit)
            choice = np.where(fits_prop, prop, best)
            _, first = np.unique(choice, return_index=True)
            out[rem[first]] = choice[first]
            loads[choice[first]] += c[first]
            tokens[choice[first]] += t[first]
            rem = np.delete(rem, first)
            continue
        placed = rem[ok]
        dest = bins[good]
        out[placed] = dest
        loads += np.bincount(dest, weights=costs[placed], minlength=loads.size)
        tokens += np.bincount(dest, weights=lens[placed], minlength=loads.size).astype(tokens.dtype)
        rem = rem[~ok]
    return out


def dp_order(loads: np.ndarray, dp: int, balanced: bool = True) -> np.ndarray:
    """A permutation of a step's micro-batches; DP rank ``r`` trains ``order[r*m:(r+1)*m]``.

    A DP rank runs its ``m = N / dp`` micro-batches one after the other, so the slowest rank's
    total sets the step time. ``balanced`` deals micro-batches sorted by workload in snake order
    (0, 1, .., dp-1, dp-1, .., 0, ...), which evens the ranks' totals; otherwise ranks take
    contiguous slices, as TorchTitan's loaders do (the ``original`` baseline). Deterministic, so
    every rank computes the same assignment. Each rank's micro-batches stay in plan order.
    """
    n = int(loads.size)
    if n % dp:
        raise ValueError(f"{n} micro-batches cannot be split evenly over {dp} DP ranks")
    if dp == 1 or not balanced:
        return np.arange(n)
    by_load = np.argsort(-np.asarray(loads, dtype=np.float64), kind="stable")
    slot = np.arange(n)
    rounds, pos = slot // dp, slot % dp
    owner = np.where(rounds % 2 == 0, pos, dp - 1 - pos)
    rank_of = np.empty(n, dtype=np.int64)
    rank_of[by_load] = owner
    return np.lexsort((np.arange(n), rank_of))
