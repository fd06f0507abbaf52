"""1F1B and interleaved 1F1B timelines: an op starts when its stage is free and its input has
arrived, so one slow micro-batch delays the whole pipeline (the paper's latency propagation)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

SCHEDULES = ("1f1b", "interleaved_1f1b")


class Op(NamedTuple):
    """One operation: physical stage, virtual stage (``chunk * pp + rank``), micro-batch, fwd/bwd."""

    rank: int
    vstage: int
    mb: int
    is_fwd: bool


def _rank_order(pp: int, v: int, m: int, rank: int) -> list[Op]:
    """The order in which physical stage ``rank`` runs its operations (Megatron's 1F1B schedules)."""

    def op(i: int, fwd: bool) -> Op:
        group, within = divmod(i, pp * v)
        chunk = within // pp if fwd else v - 1 - within // pp
        return Op(rank, chunk * pp + rank, group * pp + within % pp, fwd)

    total = m * v
    warmup = min(pp - rank - 1, m) if v == 1 else min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [op(i, True) for i in range(warmup)]
    for j in range(total - warmup):
        order += [op(warmup + j, True), op(j, False)]
    return order + [op(j, False) for j in range(total - warmup, total)]


@dataclass(frozen=True)
class Schedule:
    """A schedule unrolled into [n_ops] arrays in topological order: each op's stage, virtual
    stage, micro-batch, direction, the op it consumes (``dep``) and the previous op on its stage
    (``prev_same_rank``), -1 for none."""

    pp: int
    v: int
    m: int
    rank: np.ndarray
    vstage: np.ndarray
    mb: np.ndarray
    is_fwd: np.ndarray
    dep: np.ndarray
    prev_same_rank: np.ndarray


@lru_cache(maxsize=64)
def build_schedule(pp: int, m: int, v: int = 1) -> Schedule:
    """Unroll 1F1B (v = 1) or interleaved 1F1B (v > 1) for ``pp`` stages and ``m`` micro-batches."""
    if pp < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline needs pp, micro-batches and v >= 1, got pp={pp} m={m} v={v}")
    if v > 1 and m % pp:
        raise ValueError(
            f"interleaved 1F1B needs micro-batches per pipeline ({m}) divisible by PP ({pp})"
        )
    n_v = pp * v

    def input_key(op: Op) -> tuple[int, int, bool] | None:
        if op.is_fwd:
            return None if op.vstage == 0 else (op.vstage - 1, op.mb, True)
        return (op.vstage, op.mb, True) if op.vstage == n_v - 1 else (op.vstage + 1, op.mb, False)

    # Take every stage's next op as soon as its input is done, until all are placed.
    orders = [_rank_order(pp, v, m, r) for r in range(pp)]
    pos, topo, prev, last = [0] * pp, [], [], [-1] * pp
    done = {None: -1}  # op key -> its index; None: the first forward has no input
    while len(topo) < sum(len(o) for o in orders):
        placed = len(topo)
        for r, order in enumerate(orders):
            while pos[r] < len(order) and input_key(order[pos[r]]) in done:
                op = order[pos[r]]
                prev.append(last[r])
                done[(op.vstage, op.mb, op.is_fwd)] = last[r] = len(topo)
                topo.append(op)
                pos[r] += 1
        if len(topo) == placed:  # pragma: no cover - the schedules above are deadlock-free
            raise RuntimeError(f"pipeline schedule deadlocks (pp={pp}, m={m}, v={v})")
    dep = [done[input_key(op)] for op in topo]
    rank, vstage, mb, is_fwd, dep, prev = np.vstack([np.array(topo, dtype=np.int64).T, [dep, prev]])
    return Schedule(pp, v, m, rank, vstage, mb, is_fwd.astype(bool), dep, prev)


@dataclass
class TimelineResult:
    """B timed pipelines: [B] makespan, [B, pp] busy time per stage, [B] idle share of
    stage-time, [B, n_ops] start and end of each op (the schedule's order)."""

    makespan: np.ndarray
    busy: np.ndarray
    bubble_fraction: np.ndarray
    start: np.ndarray
    end: np.ndarray


def simulate_pipeline(
    schedule: Schedule, fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray | float = 0.0
) -> TimelineResult:
    """Time B pipelines: ``fwd``, ``bwd`` [B, pp * v, m] per virtual stage and micro-batch;
    ``p2p`` (scalar or [B, m]) is added when an op's input comes from another stage."""
    fwd, bwd = np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64)
    s, n_v = schedule, schedule.pp * schedule.v
    if fwd.ndim != 3 or fwd.shape[1:] != (n_v, s.m) or bwd.shape != fwd.shape:
        raise ValueError(
            f"fwd/bwd must have shape [B, {n_v}, {s.m}], got {fwd.shape} and {bwd.shape}"
        )
    batch = fwd.shape[0]
    p2p_arr = np.broadcast_to(np.asarray(p2p, dtype=np.float64), (batch, s.m))
    # Durations in topological order: [B, n_ops].
    dur = np.where(s.is_fwd[None, :], fwd[:, s.vstage, s.mb], bwd[:, s.vstage, s.mb])
    # Backward of the last virtual stage consumes its own forward on the same rank: no transfer.
    needs_transfer = (s.dep >= 0) & ~(~s.is_fwd & (s.vstage == n_v - 1))
    transfer = np.where(needs_transfer[None, :], p2p_arr[:, s.mb], 0.0)
    start = np.empty_like(dur)
    end = np.zeros((batch, dur.shape[1] + 1))  # the extra last column: op -1 (none), ends at 0
    for i, (d, p) in enumerate(zip(s.dep.tolist(), s.prev_same_rank.tolist(), strict=True)):
        start[:, i] = np.maximum(end[:, p], end[:, d] + transfer[:, i])
        end[:, i] = start[:, i] + dur[:, i]
    end = end[:, :-1]
    makespan = end.max(axis=1)
    busy = np.stack([dur[:, s.rank == r].sum(axis=1) for r in range(s.pp)], axis=1)
    bubble = 1.0 - busy.sum(axis=1) / (s.pp * makespan)
    return TimelineResult(makespan, busy, bubble, start, end)


# Action kinds of torch's schedules (torchtitan_wlb.pipeline.orders), by code.
ACTION_KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class ActionTimeline:
    """Per-rank action lists of a torch schedule unrolled into [n_ops] arrays in topological
    order: rank, stage, micro-batch, kind (index into :data:`ACTION_KINDS`), the op whose output
    it consumes (``dep``, -1 none), whether that op ran on another rank (``remote``: a transfer)
    and the previous op of the rank (``prev_same_rank``)."""

    pp: int
    n_stages: int
    m: int
    rank: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    kind: np.ndarray
    dep: np.ndarray
    remote: np.ndarray
    prev_same_rank: np.ndarray


def build_action_timeline(orders, n_stages: int, m: int) -> ActionTimeline:
    """Unroll ``orders`` (per rank, ``(kind, stage, mb)`` actions in run order). A forward needs
    the previous stage's forward; a backward (full, or for the input only) the next stage's input
    gradient (the last stage: its own forward); a weight backward its own input backward. A rank
    runs its actions in order, each once its input is there."""
    n_ops = sum(len(o) for o in orders)

    def needs(kind: str, stage: int, mb: int) -> tuple[str, int, int] | None:
        if kind == "F":
            return None if stage == 0 else ("F", stage - 1, mb)
        if kind == "W":
            return ("G", stage, mb)
        return ("F", stage, mb) if stage == n_stages - 1 else ("G", stage + 1, mb)

    pos, topo, prev, last = [0] * len(orders), [], [], [-1] * len(orders)
    done: dict = {None: -1}  # produced value -> index of the op that produced it
    while len(topo) < n_ops:
        placed = len(topo)
        for r, order in enumerate(orders):
            while pos[r] < len(order) and needs(*order[pos[r]]) in done:
                kind, stage, mb = order[pos[r]]
                prev.append(last[r])
                last[r] = len(topo)
                done[("G" if kind in "BI" else kind, stage, mb)] = len(topo)
                topo.append((r, stage, mb, ACTION_KINDS.index(kind)))
                pos[r] += 1
        if len(topo) == placed:
            stuck = [o[p] for o, p in zip(orders, pos, strict=True) if p < len(o)]
            raise RuntimeError(f"the schedule's actions deadlock, waiting: {stuck}")
    dep = np.array([done[needs(ACTION_KINDS[k], s, b)] for _, s, b, k in topo], dtype=np.int64)
    rank, stage, mb, kind = np.array(topo, dtype=np.int64).reshape(n_ops, 4).T
    remote = (dep >= 0) & (rank[np.maximum(dep, 0)] != rank)
    return ActionTimeline(
        len(orders), n_stages, m, rank, stage, mb, kind, dep, remote, np.array(prev, np.int64)
    )


def simulate_actions(
    tl: ActionTimeline,
    fwd: np.ndarray,
    bwd: np.ndarray,
    wgt: np.ndarray,
    p2p: np.ndarray | float = 0.0,
) -> TimelineResult:
    """Time B pipelines of ``tl``: ``fwd``, ``bwd`` (full backward) and ``wgt`` (its weight part)
    [B, n_stages, m]; an input backward costs ``bwd - wgt``, except on stage 0, whose input needs
    no gradient (torch runs its whole backward as the weight action). ``p2p`` (scalar or [B, m])
    is added when an op's input comes from another rank."""
    fwd, bwd, wgt = (np.asarray(x, dtype=np.float64) for x in (fwd, bwd, wgt))
    if (
        fwd.ndim != 3
        or fwd.shape[1:] != (tl.n_stages, tl.m)
        or not fwd.shape == bwd.shape == wgt.shape
    ):
        raise ValueError(
            f"fwd/bwd/wgt must have shape [B, {tl.n_stages}, {tl.m}], got {fwd.shape}, "
            f"{bwd.shape} and {wgt.shape}"
        )
    batch = fwd.shape[0]
    first = (tl.stage == 0)[None, :]
    inp = np.where(first, 0.0, (bwd - wgt)[:, tl.stage, tl.mb])
    weight = np.where(first, bwd[:, tl.stage, tl.mb], wgt[:, tl.stage, tl.mb])
    by_kind = np.stack([fwd[:, tl.stage, tl.mb], bwd[:, tl.stage, tl.mb], inp, weight])
    dur = np.take_along_axis(by_kind, tl.kind[None, None, :].repeat(batch, 1), axis=0)[0]
    p2p_arr = np.broadcast_to(np.asarray(p2p, dtype=np.float64), (batch, tl.m))
    transfer = np.where(tl.remote[None, :], p2p_arr[:, tl.mb], 0.0)
    start = np.empty_like(dur)
    end = np.zeros((batch, dur.shape[1] + 1))  # the extra last column: op -1 (none), ends at 0
    for i, (d, p) in enumerate(zip(tl.dep.tolist(), tl.prev_same_rank.tolist(), strict=True)):
        start[:, i] = np.maximum(end[:, p], end[:, d] + transfer[:, i])
        end[:, i] = start[:, i] + dur[:, i]
    end = end[:, :-1]
    makespan = end.max(axis=1)
    busy = np.stack([dur[:, tl.rank == r].sum(axis=1) for r in range(tl.pp)], axis=1)
    bubble = 1.0 - busy.sum(axis=1) / (tl.pp * makespan)
    return TimelineResult(makespan, busy, bubble, start, end)
