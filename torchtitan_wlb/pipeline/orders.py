"""Every rank's compute actions of a torch pipeline schedule, in the order the rank runs them, for
timing models (``torchtitan_wlb.sim.pp_schedules``) that compare schedules without running them.

The multi-stage schedules execute exactly their ``pipeline_order``, so that order is read from the
torch class itself, built around stand-ins that carry only the stage attributes its constructor
reads. 1F1B and GPipe run hand-written loops instead, whose order is written out here as those
loops run it (torch's printed order for 1F1B does not match its loop).
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
from typing import NamedTuple

from torchtitan_wlb.pipeline.schedule_check import VARLEN_SCHEDULES, check_pp_microbatches

# Action kinds: forward, full backward, backward for the input only, backward for the weights.
KINDS = ("F", "B", "I", "W")


class Action(NamedTuple):
    """One compute action: its kind (:data:`KINDS`), stage index and micro-batch."""

    kind: str
    stage: int
    mb: int


def canonical_name(schedule: str) -> str:
    """torch's spelling of a schedule name matched case-insensitively (as torch matches it)."""
    names = {name.lower(): name for name in VARLEN_SCHEDULES}
    return names.get(str(schedule).lower(), str(schedule))


def stages_of_rank(schedule: str, pp: int, rank: int, stages_per_rank: int) -> list[int]:
    """The stage indices ``rank`` holds: r, r + pp, ... (looped), or r and 2 pp - 1 - r (V)."""
    if VARLEN_SCHEDULES[canonical_name(schedule)] == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(stages_per_rank)]


def _single_stage_order(name: str, pp: int, m: int, rank: int) -> list[Action]:
    """Schedule1F1B's loop: min(m, pp - rank) forwards, then one backward and one forward each
    until the forwards run out, then the backwards; ScheduleGPipe: all forwards, then all
    backwards."""
    fwd = [Action("F", rank, i) for i in range(m)]
    bwd = [Action("B", rank, i) for i in range(m)]
    if name == "GPipe":
        return fwd + bwd
    warmup = min(m, pp - rank)
    order = fwd[:warmup]
    for i in range(m - warmup):
        order += [bwd[i], fwd[warmup + i]]
    return order + bwd[m - warmup :]


def _torch_order(name: str, pp: int, m: int, stages_per_rank: int) -> list[list[Action]]:
    """The ``pipeline_order`` of torch's multi-stage schedule class, compute actions only."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    n_stages = pp * stages_per_rank
    stand_ins = [
        SimpleNamespace(
            group_size=pp,
            group_rank=0,
            num_stages=n_stages,
            stage_index=s,
            is_first=s == 0,
            is_last=s == n_stages - 1,
            submod=None,
        )
        for s in stages_of_rank(name, pp, 0, stages_per_rank)
    ]
    cls = get_schedule_class(name)
    schedule = cls(stand_ins, m, loss_fn=lambda out, target: out, scale_grads=False)
    orders = []
    for rank in range(pp):
        actions = []
        for a in schedule.pipeline_order[rank]:
            kind = getattr(a, "computation_type", None)
            if a is not None and str(getattr(kind, "value", kind)) in KINDS:
                actions.append(Action(str(kind.value), int(a.stage_index), int(a.microbatch_index)))
        orders.append(actions)
    return orders


@lru_cache(maxsize=64)
def schedule_actions(
    schedule: str, pp: int, n_microbatches: int, stages_per_rank: int | None = None
) -> tuple[tuple[Action, ...], ...]:
    """Per rank, the compute actions of ``schedule`` (a :data:`VARLEN_SCHEDULES` name) on ``pp``
    ranks with ``n_microbatches`` micro-batches, in run order; ``ValueError`` (as the start-up
    check) for a combination the schedule cannot run."""
    check_pp_microbatches(schedule, n_microbatches, pp, stages_per_rank)
    name = canonical_name(schedule)
    if VARLEN_SCHEDULES[name] == "single":
        orders = [_single_stage_order(name, pp, n_microbatches, r) for r in range(pp)]
    else:
        orders = _torch_order(name, pp, n_microbatches, stages_per_rank or 2)
    return tuple(tuple(order) for order in orders)
