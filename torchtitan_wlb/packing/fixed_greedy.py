"""``fixed_greedy``: workload-aware greedy over G global batches with a fixed length cap.

Table 2's "fixed-length greedy" remedy: collect ``G`` global batches of documents, place them
(largest workload first) into ``G * N`` sequences of at most ``context_len`` tokens, each to the
least-loaded sequence with room; sort the sequences by workload and emit ``N`` consecutive ones per
step, so that expensive sequences share a step. A larger ``G`` balances better but reorders (and
delays) documents by up to ``G - 1`` steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchtitan_wlb.packing.base import DocPool, Packer
from torchtitan_wlb.packing.placement import fill_rounds

__all__ = ["FixedGreedyPacker", "WindowedPacker", "greedy_window"]


class WindowedPacker(Packer):
    """Shared machinery of the packers that plan ``G`` steps at once (greedy and solver).

    ``planned`` holds the documents of the window's remaining steps; ``tag`` is the global
    micro-batch index ``step_offset * N + j``. ``carry`` holds what did not fit in the window.
    """

    def __init__(self, config, cost_model) -> None:
        super().__init__(config, cost_model)
        self.g = config.window
        self.carry = DocPool()
        self.planned = DocPool()
        self.window_pos = 0  # steps of the current window already emitted

    @property
    def cap(self) -> int:
        return self.config.context_len

    def _window_open(self) -> bool:
        return self.window_pos < self.g and len(self.planned) > 0

    def tokens_wanted(self) -> int:
        if self._window_open():
            return 0
        budget = self.g * self.n * self.config.context_len
        return max(0, budget - int(self.carry.lens.sum()))

    def has_pending(self) -> bool:
        return len(self.carry) > 0 or len(self.planned) > 0

    def pending(self) -> DocPool:
        return DocPool.concat([self.carry, self.planned])

    def _assign(self, pool: DocPool) -> np.ndarray:
        """Global micro-batch (0 .. G*N-1) of every document of ``pool``; -1 = carry."""
        raise NotImplementedError

    def _plan(self, ids, lens, flush):
        if not self._window_open():
            new = DocPool()
            new.add(ids, lens, self._step, 0)
            pool = DocPool.concat([self.carry, new])
            mb = self._assign(pool)
            nb = self.g * self.n
            loads = np.bincount(
                mb[mb >= 0], weights=self.cost_model.doc_cost(pool.lens[mb >= 0]), minlength=nb
            )
            rank = np.empty(nb, np.int64)
            rank[np.argsort(-loads, kind="stable")] = np.arange(nb)
            self.carry = pool.subset(np.flatnonzero(mb < 0))
            self.planned = pool.subset(np.flatnonzero(mb >= 0))
            self.planned.tag = rank[mb[mb >= 0]]
            self.window_pos = 0
        elif ids.size:
            raise ValueError("documents given while a planned window is being emitted")
        now = self.planned.tag // self.n == self.window_pos
        out = self.planned.take(np.flatnonzero(now))
        self.window_pos += 1
        if len(self.planned) == 0:
            self.window_pos = self.g
        return out, out.tag % self.n

    def _extra_state(self) -> dict[str, Any]:
        return {
            "carry": self.carry.state(),
            "planned": self.planned.state(),
            "window_pos": self.window_pos,
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.carry = DocPool.from_state(state["carry"])
        self.planned = DocPool.from_state(state["planned"])
        self.window_pos = int(state["window_pos"])


class FixedGreedyPacker(WindowedPacker):
    """Attention-aware greedy over ``G`` global batches, cap ``context_len`` per sequence."""

    name = "fixed_greedy"

    def _assign(self, pool: DocPool) -> np.ndarray:
        return greedy_window(
            pool, self.g * self.n, self.config.context_len, self.cost_model, self._step
        )


def greedy_window(pool: DocPool, n_bins: int, cap: int, cost_model, step: int) -> np.ndarray:
    """Greedy placement of a window's documents; carried ones first, so none is carried twice
    in a row while the new ones still have room (no starvation of a document that keeps not
    fitting at the end of a window)."""
    loads = np.zeros(n_bins)
    tokens = np.zeros(n_bins, np.int64)
    costs = cost_model.doc_cost(pool.lens)
    out = np.full(len(pool), -1, np.int64)
    for group in (pool.arrival < step, pool.arrival >= step):
        idx = np.flatnonzero(group)
        if idx.size:
            out[idx] = fill_rounds(loads, tokens, costs[idx], pool.lens[idx], cap)
    return out
