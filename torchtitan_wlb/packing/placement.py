"""Placement kernels: put documents into ``N`` micro-batches under a token cap, deterministically.

:func:`lpt_place` places one document at a time and serves only the few that must go first
(outliers, forced documents); :func:`fill_rounds` applies the same greedy rule in vectorised rounds
to whole batches; :func:`dp_order` deals a step's micro-batches to DP ranks.
"""

from __future__ import annotations

import numpy as np

# Share of its deficit a micro-batch receives per round: large enough for few rounds, small
# enough that the last rounds still hold small documents to even out the loads.
_RUN_FRACTION = 0.7


def water_level(loads: np.ndarray, extra: float) -> float:
    """Level reached if ``extra`` work is poured into the least-loaded bins (no caps)."""
    return _sorted_water_level(np.sort(loads), extra, np.arange(1, loads.size + 1))


def _sorted_water_level(s: np.ndarray, extra: float, ranks: np.ndarray) -> float:
    """:func:`water_level` of loads already sorted ascending; ``ranks``: ``1 .. s.size``."""
    cs = s.cumsum()
    need = s * ranks - cs  # work to raise the k lowest bins to s[k-1]
    k = int(need.searchsorted(extra, side="right"))
    return float((cs[k - 1] + extra) / k)


def lpt_place(
    loads: np.ndarray, tokens: np.ndarray, costs: np.ndarray, lens: np.ndarray, cap: int
) -> np.ndarray:
    """Greedy: each document (in the given order) to the least-loaded bin with room for it, or
    ``-1`` where no bin has room. ``loads`` and ``tokens`` are updated in place."""
    out = np.full(costs.size, -1, np.int64)
    for i in range(costs.size):
        room_ok = tokens + lens[i] <= cap
        if not room_ok.any():
            continue
        j = int(np.argmin(np.where(room_ok, loads, np.inf)))
        out[i] = j
        loads[j] += costs[i]
        tokens[j] += lens[i]
    return out


def _dealt(costs: np.ndarray, lens: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
    """Documents (largest first) dealt like cards over ``k`` bins (bin ``0``: the least-loaded),
    in snake order: the ``k`` largest one per bin, the next ``k`` back, and so on. A run of
    neighbours would give one micro-batch several of the largest documents; under CP, a few long
    documents kept whole cannot be split evenly over the ranks (docs/packing.md). Returns each
    document's bin and the running cost and tokens of that bin up to and including it."""
    n = costs.size
    deal = np.arange(-(-n // k) * k).reshape(-1, k)  # [turn, bin]: the document dealt there
    deal[1::2] = deal[1::2, ::-1]
    dealt = deal < n
    pos = deal[dealt]
    grid = np.zeros((2, *deal.shape))
    grid[:, dealt] = costs[pos], lens[pos]
    grid.cumsum(axis=1, out=grid)  # each bin's running cost and tokens, turn by turn
    slot, run = np.empty(n, np.int64), np.empty((2, n))
    slot[pos] = np.broadcast_to(np.arange(k), deal.shape)[dealt]
    run[:, pos] = grid[:, dealt]
    return slot, run[0], run[1]


def fill_rounds(
    loads: np.ndarray,
    tokens: np.ndarray,
    costs: np.ndarray,
    lens: np.ndarray,
    cap: int,
    limit: float = np.inf,
    deal: bool = False,
) -> np.ndarray:
    """Place documents (largest cost first) in vectorised rounds (docs/packing.md, "Vectorised
    placement"); ``loads`` (float) and ``tokens`` (int), the bins' workload and token count, are
    updated in place. ``-1``: the document fits nowhere (token cap, or ``limit``). ``deal``: the
    first round, which places the largest documents (70 % of the deficits), deals them over the
    bins (:func:`_dealt`) instead of cutting them into runs of neighbours. Runs keep stream order
    together, which the final steps' split relies on (end_of_data.py). A round fills the bins
    under the water level (:func:`_water_round`); when it places nothing, the documents are larger
    than the deficits (:func:`_lpt_round`) or the bins constrained (:func:`_proposal_round`)."""
    out = np.full(costs.size, -1, np.int64)
    rem = np.arange(costs.size)
    if np.isfinite(limit):  # the rounds' first filter (below), before sorting: often most go
        rem = np.flatnonzero((costs <= limit - loads.min()) & (lens <= (cap - tokens).max()))
    rem = rem[np.argsort(-costs[rem], kind="stable")]  # stays sorted: rounds only remove some
    ranks = np.arange(1, loads.size + 1)
    bounded = bool(np.isfinite(limit))
    while rem.size:
        c, t = costs[rem], lens[rem]
        room = cap - tokens
        # ``c`` is in descending order: every cost is under the bound when the first one is.
        if bounded and (c[0] > limit - loads.min() or t.max() > room.max()):
            keep = (c <= limit - loads.min()) & (t <= room.max())
            if not keep.all():
                rem, c, t = rem[keep], c[keep], t[keep]
                if rem.size == 0:
                    break
        open_bins = room >= t.min()
        n_open = int(np.count_nonzero(open_bins))
        if not n_open:
            break
        cc = c.cumsum()
        # One stable sort of the loads serves the water level (the open bins' sorted loads) and
        # the eligible bins, least-loaded first (a stable order restricted to a subset is that
        # subset's stable order).
        by_load = loads.argsort(kind="stable")
        asc = by_load if n_open == loads.size else by_load[open_bins[by_load]]
        asc_loads = loads[asc]  # the open bins, least-loaded first
        level = min(_sorted_water_level(asc_loads, float(cc[-1]), ranks[:n_open]), limit)
        low = int(asc_loads.searchsorted(level, side="left"))  # loads < level: a prefix
        ok = np.zeros(rem.size, bool)
        if low:
            ok, dest = _water_round(loads, room, c, t, cc, level, asc[:low], deal)
            deal = False  # later rounds: the smaller rest, in runs
        if ok.any():
            placed = rem[ok]
            out[placed] = dest
            loads += np.bincount(dest, weights=costs[placed], minlength=loads.size)
            np.add.at(tokens, dest, lens[placed])  # integers: the order of the adds does not matter
            rem = rem[~ok]
            continue
        left = _lpt_round(out, loads, tokens, rem, room, asc, limit, costs, lens)
        if left is None:
            left = _proposal_round(out, loads, tokens, rem, room, by_load, limit, costs, lens)
        rem = left
    return out


def _water_round(
    loads: np.ndarray,
    room: np.ndarray,
    c: np.ndarray,
    t: np.ndarray,
    cc: np.ndarray,
    level: float,
    elig: np.ndarray,
    deal: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """The common round of :func:`fill_rounds`: the eligible bins ``elig`` (loads under ``level``,
    least-loaded first) take the largest remaining documents (costs ``c``, descending, running
    sum ``cc``; lengths ``t``), each bin ``_RUN_FRACTION`` of its deficit, as a run of neighbours
    or dealt (``deal``). Each bin keeps the prefix of its documents that stays under the level and
    within its ``room``: checking prefixes only is exact, as costs are >= 0 (a bin's running cost
    and tokens only grow along them). Returns which documents are placed and their bins."""
    elig_loads = loads[elig]
    ok = np.zeros(c.size, bool)
    bounds = (_RUN_FRACTION * (level - elig_loads)).cumsum()
    start = cc - c
    n_in = int(start.searchsorted(bounds[-1], side="left"))  # a prefix: start grows
    if deal:
        slot, run_cost, run_tok = _dealt(c[:n_in], t[:n_in], elig.size)
    else:
        slot = bounds.searchsorted(start[:n_in], side="right")  # run of each document
        first = slot.searchsorted(slot, side="left")
        ct = t[:n_in].cumsum()
        run_cost = cc[:n_in] - start[first]
        run_tok = ct - (ct - t[:n_in])[first]
    bins = elig[slot]
    good = (loads[bins] + run_cost <= level) & (run_tok <= room[bins])
    ok[:n_in] = good
    return ok, bins[good]


def _lpt_round(
    out: np.ndarray,
    loads: np.ndarray,
    tokens: np.ndarray,
    rem: np.ndarray,
    room: np.ndarray,
    asc: np.ndarray,
    limit: float,
    costs: np.ndarray,
    lens: np.ndarray,
) -> np.ndarray | None:
    """When the remaining documents ``rem`` (largest first) are larger than the deficits, one LPT
    round: the ``k`` largest to the ``k`` least-loaded open bins ``asc``, where ``k`` counts the
    bins LPT would fill before the least-loaded bin's next turn. Places into ``out``, ``loads``
    and ``tokens``; returns the documents left, or ``None`` when none of the ``k`` fits (the bins
    are constrained: :func:`_proposal_round`)."""
    c, t = costs[rem], lens[rem]
    asc_loads = loads[asc]
    asc = asc[: int(asc_loads.searchsorted(asc_loads[0] + c[0], side="left"))][: rem.size]
    k = asc.size
    fit = (t[:k] <= room[asc]) & (loads[asc] + c[:k] <= limit)
    if not fit.any():
        return None
    sel = np.flatnonzero(fit)
    out[rem[sel]] = asc[sel]
    loads[asc[sel]] += c[sel]
    tokens[asc[sel]] += t[sel]
    return np.concatenate([rem[:k][~fit], rem[k:]])


def _proposal_round(
    out: np.ndarray,
    loads: np.ndarray,
    tokens: np.ndarray,
    rem: np.ndarray,
    room: np.ndarray,
    by_load: np.ndarray,
    limit: float,
    costs: np.ndarray,
    lens: np.ndarray,
) -> np.ndarray:
    """The round for constrained bins (token cap or ``limit``), where neither of the other rounds
    places a document: every remaining document that still fits somewhere proposes a bin (the
    k-th least-loaded for the k-th document, else its least-loaded fitting bin); each bin takes its
    largest proposer. Documents that fit nowhere now never will (bins only fill up) and are
    dropped. A document's least-loaded bin with room is the least-loaded of a prefix of the bins
    sorted by room: a running minimum of the bins' places in the load order (ties: the lower bin),
    not a documents x N table. Places into ``out``, ``loads`` and ``tokens``; returns the
    documents left."""
    c, t = costs[rem], lens[rem]
    nb = loads.size
    by_room = np.argsort(-room, kind="stable")
    place = np.empty(nb, np.int64)
    place[by_load] = np.arange(1, nb + 1)
    least = by_load[np.minimum.accumulate(place[by_room]) - 1]
    with_room = nb - room[by_room][::-1].searchsorted(t, side="left")
    best = least[np.maximum(with_room - 1, 0)]
    placeable = (with_room > 0) & (loads[best] + c <= limit)
    rem, c, t, best = rem[placeable], c[placeable], t[placeable], best[placeable]
    if rem.size == 0:
        return rem
    prop = by_load[np.arange(rem.size) % nb]  # the loads have not changed this round
    fits_prop = (t <= room[prop]) & (loads[prop] + c <= limit)
    choice = np.where(fits_prop, prop, best)
    order = np.argsort(choice, kind="stable")  # each bin's first proposer:
    by_bin = choice[order]
    head = np.empty(by_bin.size, bool)
    head[0] = True
    np.not_equal(by_bin[1:], by_bin[:-1], out=head[1:])
    first = order[head]
    out[rem[first]] = choice[first]
    loads[choice[first]] += c[first]
    tokens[choice[first]] += t[first]
    taken = np.zeros(rem.size, bool)
    taken[first] = True
    return rem[~taken]


def dp_order(loads: np.ndarray, dp: int, balanced: bool = True) -> np.ndarray:
    """A permutation of a step's micro-batches; DP rank ``r`` trains ``order[r*m:(r+1)*m]``
    (``m = N / dp``): dealt by workload in snake order when ``balanced``, so that the ranks'
    totals even out, else contiguous slices (docs/packing.md, "The torchdata node")."""
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
