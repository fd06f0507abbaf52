"""Pipeline timelines for 1F1B and interleaved 1F1B with per-micro-batch operation times.

A pipeline step is a fixed set of operations (forward / backward of one micro-batch on one virtual
stage) whose order on each physical stage is fixed by the schedule. Given every operation's duration, the
start time of an operation is the later of "its stage is free" and "its input has arrived". That is why
one slow micro-batch costs more than its own extra time: its delay propagates down the pipeline and
back (the paper's latency propagation chain).

The schedule's order, and a global order consistent with all dependencies, depend only on
(PP, v, micro-batches); they are computed once and cached. Timing is then one pass over the operations,
vectorised with NumPy over a batch axis (steps x DP replicas), so thousands of pipelines cost the same
Python work as one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

SCHEDULES = ("1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Op:
    """One pipeline operation.

    Attributes:
        rank: Physical pipeline stage that runs it.
        vstage: Virtual stage (model chunk index ``chunk * pp + rank``).
        mb: Micro-batch index.
        is_fwd: Forward (True) or backward (False).
    """

    rank: int
    vstage: int
    mb: int
    is_fwd: bool


def _rank_order(pp: int, v: int, m: int, rank: int) -> list[Op]:
    """The order in which physical stage ``rank`` runs its operations (Megatron's 1F1B schedules)."""
    total = m * v

    def fwd_op(i: int) -> Op:
        group, within = divmod(i, pp * v)
        chunk = within // pp
        mb = group * pp + within % pp
        return Op(rank, chunk * pp + rank, mb, True)

    def bwd_op(i: int) -> Op:
        group, within = divmod(i, pp * v)
        chunk = v - 1 - within // pp
        mb = group * pp + within % pp
        return Op(rank, chunk * pp + rank, mb, False)

    if v == 1:
        warmup = min(pp - rank - 1, m)
    else:
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [fwd_op(i) for i in range(warmup)]
    for j in range(total - warmup):
        order.append(fwd_op(warmup + j))
        order.append(bwd_op(j))
    order.extend(bwd_op(j) for j in range(total - warmup, total))
    return order


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule unrolled into arrays, in an order that respects every dependency.

    Attributes:
        pp: Physical stages.
        v: Model chunks per stage (1 for plain 1F1B).
        m: Micro-batches per step (per pipeline).
        rank: [n_ops] physical stage of each op, in topological order.
        vstage: [n_ops] virtual stage.
        mb: [n_ops] micro-batch.
        is_fwd: [n_ops] bool.
        dep: [n_ops] index (in this order) of the op whose output this op consumes from another stage,
            or -1.
        prev_same_rank: [n_ops] index of the previous op on the same stage, or -1.
    """

    pp: int
    v: int
    m: int
    rank: np.ndarray
    vstage: np.ndarray
    mb: np.ndarray
    is_fwd: np.ndarray
    dep: np.ndarray
    prev_same_rank: np.ndarray

    @property
    def n_ops(self) -> int:
        return int(self.rank.size)


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
    orders = [_rank_order(pp, v, m, r) for r in range(pp)]
    done: dict[tuple[int, int, bool], int] = {}
    pos = [0] * pp
    topo: list[Op] = []

    def input_key(op: Op) -> tuple[int, int, bool] | None:
        if op.is_fwd:
            return None if op.vstage == 0 else (op.vstage - 1, op.mb, True)
        if op.vstage == n_v - 1:
            return (op.vstage, op.mb, True)
        return (op.vstage + 1, op.mb, False)

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                key = input_key(op)
                if key is not None and key not in done:
                    break
                done[(op.vstage, op.mb, op.is_fwd)] = len(topo)
                topo.append(op)
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedules above are deadlock-free
            raise RuntimeError(f"pipeline schedule deadlocks (pp={pp}, m={m}, v={v})")

    rank = np.array([op.rank for op in topo], dtype=np.int64)
    dep = np.full(len(topo), -1, dtype=np.int64)
    prev = np.full(len(topo), -1, dtype=np.int64)
    last_on_rank = [-1] * pp
    for i, op in enumerate(topo):
        key = input_key(op)
        if key is not None:
            dep[i] = done[key]
        prev[i] = last_on_rank[op.rank]
        last_on_rank[op.rank] = i
    return Schedule(
        pp=pp,
        v=v,
        m=m,
        rank=rank,
        vstage=np.array([op.vstage for op in topo], dtype=np.int64),
        mb=np.array([op.mb for op in topo], dtype=np.int64),
        is_fwd=np.array([op.is_fwd for op in topo], dtype=bool),
        dep=dep,
        prev_same_rank=prev,
    )


@dataclass
class TimelineResult:
    """Result of timing a batch of pipelines.

    Attributes:
        makespan: [B] time from the first operation's start to the last one's end.
        busy: [B, pp] compute time of each physical stage.
        bubble_fraction: [B] 1 - sum(busy) / (pp * makespan): the share of stage-time spent idle.
        start: [B, n_ops] start time of each op (schedule's topological order).
        end: [B, n_ops] end time of each op.
    """

    makespan: np.ndarray
    busy: np.ndarray
    bubble_fraction: np.ndarray
    start: np.ndarray
    end: np.ndarray


def simulate_pipeline(
    schedule: Schedule,
    fwd: np.ndarray,
    bwd: np.ndarray,
    p2p: np.ndarray | float = 0.0,
) -> TimelineResult:
    """Time a batch of pipelines.

    Args:
        schedule: From ``build_schedule``.
        fwd: [B, pp * v, m] forward time of micro-batch j on virtual stage k (B = independent pipelines,
            e.g. steps x DP replicas).
        bwd: [B, pp * v, m] backward times.
        p2p: transfer time added when an op's input comes from another stage: a scalar or [B, m]
            (activations and their gradients have the same size).
    """
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    n_v = schedule.pp * schedule.v
    if fwd.ndim != 3 or fwd.shape[1:] != (n_v, schedule.m) or bwd.shape != fwd.shape:
        raise ValueError(
            f"fwd/bwd must have shape [B, {n_v}, {schedule.m}], got {fwd.shape} and {bwd.shape}"
        )
    batch = fwd.shape[0]
    p2p_arr = np.broadcast_to(np.asarray(p2p, dtype=np.float64), (batch, schedule.m))
    # Durations in topological order: [B, n_ops].
    dur = np.where(
        schedule.is_fwd[None, :],
        fwd[:, schedule.vstage, schedule.mb],
        bwd[:, schedule.vstage, schedule.mb],
    )
    n_v_last = n_v - 1
    # Backward of the last virtual stage consumes its own forward on the same rank: no transfer.
    needs_transfer = (schedule.dep >= 0) & ~(~schedule.is_fwd & (schedule.vstage == n_v_last))
    transfer = np.where(needs_transfer[None, :], p2p_arr[:, schedule.mb], 0.0)
    start = np.empty_like(dur)
    end = np.empty_like(dur)
    zeros = np.zeros(batch)
    dep = schedule.dep.tolist()
    prev = schedule.prev_same_rank.tolist()
    for i in range(schedule.n_ops):
        ready = zeros if prev[i] < 0 else end[:, prev[i]]
        if dep[i] >= 0:
            ready = np.maximum(ready, end[:, dep[i]] + transfer[:, i])
        start[:, i] = ready
        end[:, i] = ready + dur[:, i]
    makespan = end.max(axis=1)
    busy = np.zeros((batch, schedule.pp))
    for r in range(schedule.pp):
        busy[:, r] = dur[:, schedule.rank == r].sum(axis=1)
    bubble = 1.0 - busy.sum(axis=1) / (schedule.pp * makespan)
    return TimelineResult(
        makespan=makespan, busy=busy, bubble_fraction=bubble, start=start, end=end
    )


def ideal_makespan(pp: int, m: int, v: int, f: float, b: float) -> float:
    """Closed form for equal micro-batches without transfers: m(f+b) + (pp-1)(f+b)/v.

    ``f`` and ``b`` are one micro-batch's forward / backward time on one *physical* stage (all its
    chunks). For v = 1 this is (m + pp - 1)(f + b), the classic 1F1B bubble.
    """
    return m * (f + b) + (pp - 1) * (f + b) / v
