"""The driving protocol of every packer, used by the data node, the packing benchmark, tuning and
the simulator: the budget rule, the end of the data seen early (the packer's read-ahead;
docs/packing.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from torchtitan_wlb.packing.base import PackedStep, Packer


def take_until(budget: int, cum: np.ndarray, start: int) -> tuple[int, bool]:
    """The budget rule over cumulative lengths ``cum`` from position ``start``: ``(end,
    ran_out)``, documents ``start .. end - 1`` taken; ``ran_out`` when the stream ends first."""
    if budget <= 0:
        return start, False
    base = int(cum[start - 1]) if start else 0
    end = int(np.searchsorted(cum, base + budget, side="left")) + 1
    if end > cum.size:
        return int(cum.size), True
    return end, False


def pull_until(budget: int, pull: Callable[[], int | None]) -> bool:
    """The budget rule over an iterator: call ``pull`` (one document's length, None at the end)
    until the pulled tokens reach ``budget``. Returns whether the stream ran out first."""
    got = 0
    while got < budget:
        n = pull()
        if n is None:
            return True
        got += n
    return False


class DocumentStream(Protocol):
    """What :func:`next_plan` pulls from (:class:`LengthStream`, the data node). ``pull``: ids and
    lengths (int64) of the next documents by the budget rule, or everything left when fewer than
    ``horizon`` tokens would remain; ``exhausted``: the data has ended (flush from then on)."""

    @property
    def exhausted(self) -> bool: ...

    def pull(self, budget: int, horizon: int) -> tuple[np.ndarray, np.ndarray]: ...


def next_plan(packer: Packer, stream: DocumentStream) -> PackedStep | None:
    """One step of the protocol: pull the packer's budget, plan the step (flushing once the data
    has ended). None when the stream gave nothing and the packer holds nothing: the data is done."""
    ids, lens = stream.pull(packer.tokens_wanted(), packer.read_ahead_tokens())
    if ids.size == 0 and not packer.has_pending():
        return None
    return packer.step(ids, lens, flush=stream.exhausted)


class LengthStream:
    """Document lengths in stream order, pulled by the budget rule; document ``i`` has id ``i``.
    ``pos`` and ``exhausted`` resume a stream part-way; ``end_of_data=False``: a sample (tuning,
    the simulator's window), whose end is not the data's, so the packer is never flushed."""

    def __init__(
        self,
        lengths: np.ndarray,
        *,
        pos: int = 0,
        exhausted: bool = False,
        end_of_data: bool = True,
    ) -> None:
        self.lengths = np.asarray(lengths, np.int64).reshape(-1)
        self.ids = np.arange(self.lengths.size, dtype=np.int64)
        self.pos = pos
        self.end_of_data = end_of_data
        self._cum = np.cumsum(self.lengths)
        self._ran_out = exhausted

    @property
    def exhausted(self) -> bool:
        return self._ran_out and self.end_of_data

    @property
    def remaining(self) -> int:
        """Documents not pulled yet."""
        return int(self.lengths.size - self.pos)

    def pull(self, budget: int, horizon: int = 0) -> tuple[np.ndarray, np.ndarray]:
        start = self.pos
        self.pos, ran_out = take_until(budget, self._cum, start)
        if self.end_of_data and self.pos > start:
            left = int(self._cum[-1] - self._cum[self.pos - 1])
            if left < horizon:
                self.pos, ran_out = self._cum.size, True  # less than a step left: take it now
        self._ran_out = self._ran_out or ran_out
        return self.ids[start : self.pos], self.lengths[start : self.pos]


def drive(packer: Packer, stream: LengthStream, steps: int | None = None) -> Iterator[PackedStep]:
    """The plans of ``packer`` over ``stream``: at most ``steps`` of them (None: to the end of the
    data, its final flush included), fewer if the stream and the packer run empty first."""
    for _ in itertools.count() if steps is None else range(steps):
        plan = next_plan(packer, stream)
        if plan is None:
            return
        yield plan


def drain(packer: Packer) -> Iterator[PackedStep]:
    """Flush steps (no new documents) while ``packer`` holds documents: what a run that stops
    before the end of its data still owes."""
    empty = np.zeros(0, np.int64)
    # Every flush step emits something; the bound only turns a packer bug into an error.
    for _ in range(10 * (len(packer.pending()) + 1)):
        if not packer.has_pending():
            return
        yield packer.step(empty, empty, flush=True)
    if packer.has_pending():
        raise RuntimeError(f"packer {packer.name!r} still holds documents after the flush steps")
