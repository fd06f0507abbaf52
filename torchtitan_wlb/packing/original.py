"""``original``: TorchTitan-style sequential fill of fixed-length sequences (Plain-4D baseline).

Documents are taken in stream order and appended to the current sequence until the next one does
not fit in ``context_len`` tokens; then the next sequence starts. The first ``N`` sequences form
the step; documents that did not fit are carried, in order, to the next step. Documents are never
split (TorchTitan cuts them at sequence boundaries; here the loader has already split long
documents, and keeping them whole keeps the "every document exactly once" accounting simple).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchtitan_wlb.packing.base import DocPool, Packer

__all__ = ["OriginalPacker"]


class OriginalPacker(Packer):
    """Sequential next-fit into ``N`` sequences of ``context_len`` tokens (workload-blind)."""

    name = "original"

    def __init__(self, config, cost_model) -> None:
        super().__init__(config, cost_model)
        self.carry = DocPool()

    @property
    def cap(self) -> int:
        return self.config.context_len

    def tokens_wanted(self) -> int:
        return max(0, self.n * self.config.context_len - int(self.carry.lens.sum()))

    def has_pending(self) -> bool:
        return len(self.carry) > 0

    def pending(self) -> DocPool:
        return self.carry.subset(np.arange(len(self.carry)))

    def _plan(self, ids, lens, flush):
        pool = DocPool.concat([self.carry, _new(ids, lens, self._step)])
        cs = np.cumsum(pool.lens)
        mb = np.full(len(pool), -1, np.int64)
        start = 0
        cap = self.config.context_len
        for j in range(self.n):  # one iteration per sequence, not per document
            if start >= len(pool):
                break
            base = cs[start - 1] if start else 0
            end = int(np.searchsorted(cs, base + cap, side="right"))
            mb[start:end] = j
            start = end
        placed = mb >= 0
        self.carry = pool.subset(np.flatnonzero(~placed))
        return pool.subset(np.flatnonzero(placed)), mb[placed]

    def _extra_state(self) -> dict[str, Any]:
        return {"carry": self.carry.state()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.carry = DocPool.from_state(state["carry"])


def _new(ids: np.ndarray, lens: np.ndarray, step: int) -> DocPool:
    pool = DocPool()
    pool.add(ids, lens, step, 0)
    return pool
