"""``original``: TorchTitan-style sequential fill of fixed-length sequences (Plain-4D baseline).

Documents in stream order fill a sequence of ``context_len`` tokens until the next one does not
fit; the first ``N`` sequences form the step and the rest is carried, in order. Documents are
never split here: the loader has already split long ones, and whole documents keep the "every
document exactly once" accounting simple.
"""

from __future__ import annotations

import numpy as np

from torchtitan_wlb.packing.base import DocPool, Packer


class OriginalPacker(Packer):
    """Sequential next-fit into ``N`` sequences of ``context_len`` tokens (workload-blind)."""

    name = "original"

    def _plan(self, ids, lens, flush):
        pool = DocPool.concat([self.carry, DocPool(ids, lens, self._step)])
        cs = np.cumsum(pool.lens)
        mb = np.full(len(pool), -1, np.int64)
        start = 0
        for j in range(self.n):  # one iteration per sequence, not per document
            if start >= len(pool):
                break
            base = cs[start - 1] if start else 0
            end = int(np.searchsorted(cs, base + self.cap, side="right"))
            mb[start:end] = j
            start = end
        placed = mb >= 0
        self.carry = pool.subset(np.flatnonzero(~placed))
        return pool.subset(np.flatnonzero(placed)), mb[placed]
