"""``fixed_greedy``, Table 2's "fixed-length greedy" remedy: ``G`` global batches placed, largest
workload first, into ``G * N`` sequences of at most ``context_len`` tokens, sorted by workload and
emitted ``N`` per step, so that expensive sequences share a step (and documents wait up to G - 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchtitan_wlb.packing.base import DocPool, Packer
from torchtitan_wlb.packing.placement import fill_rounds


class FixedGreedyPacker(Packer):
    """Attention-aware greedy over ``G`` global batches, cap ``context_len`` per sequence; the
    base of ``solver``, which places the same documents exactly.

    ``planned`` holds the window's remaining documents, ``tag`` their global micro-batch
    ``step_offset * N + j``; ``carry`` what did not fit in the window.
    """

    name = "fixed_greedy"
    _pools = ("carry", "planned")

    def __init__(self, config, cost_model) -> None:
        super().__init__(config, cost_model)
        self.g = config.window
        self.planned = DocPool()
        self.window_pos = 0  # steps of the current window already emitted

    def _window_open(self) -> bool:
        return self.window_pos < self.g and len(self.planned) > 0

    def tokens_wanted(self) -> int:
        if self._window_open():
            return 0
        return max(0, self.g * self.n * self.config.context_len - int(self.carry.lens.sum()))

    def _assign(self, pool: DocPool) -> np.ndarray:
        """Global micro-batch (0 .. G*N-1) of every document of ``pool``; -1 = carry.

        Carried documents (arrived before this step) are placed first: none is carried twice in
        a row while new ones still have room (no starvation).
        """
        loads = np.zeros(self.g * self.n)
        tokens = np.zeros(self.g * self.n, np.int64)
        costs = self.cost_model.doc_cost(pool.lens)
        out = np.full(len(pool), -1, np.int64)
        for group in (pool.arrival < self._step, pool.arrival >= self._step):
            idx = np.flatnonzero(group)
            if idx.size:
                out[idx] = fill_rounds(loads, tokens, costs[idx], pool.lens[idx], self.cap)
        return out

    def _plan(self, ids, lens, flush):
        if not self._window_open():
            pool = DocPool.concat([self.carry, DocPool(ids, lens, self._step)])
            mb = self._assign(pool)
            nb = self.g * self.n
            placed = mb >= 0
            loads = np.bincount(
                mb[placed], weights=self.cost_model.doc_cost(pool.lens[placed]), minlength=nb
            )
            rank = np.empty(nb, np.int64)
            rank[np.argsort(-loads, kind="stable")] = np.arange(nb)
            self.carry = pool.subset(np.flatnonzero(~placed))
            self.planned = pool.subset(np.flatnonzero(placed))
            self.planned.tag = rank[mb[placed]]
            self.window_pos = 0
        elif ids.size:
            raise ValueError("documents given while a planned window is being emitted")
        out = self.planned.take(np.flatnonzero(self.planned.tag // self.n == self.window_pos))
        self.window_pos += 1
        if len(self.planned) == 0:
            self.window_pos = self.g
        return out, out.tag % self.n

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "window_pos": self.window_pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.window_pos = int(state["window_pos"])
