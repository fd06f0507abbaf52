"""The fixed-length packers (micro-batches capped at ``context_len``): ``original``,
``fixed_greedy`` and ``solver``. What each does and the solver's program: docs/packing.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchtitan_wlb.packing.base import DocPool, Packer
from torchtitan_wlb.packing.placement import fill_rounds
from torchtitan_wlb.packing.solver import solve_minmax


class OriginalPacker(Packer):
    """TorchTitan-style sequential next-fit (the workload-blind Plain-4D baseline). Documents are
    never split here: the loader has split long ones, so every document is emitted exactly once."""

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


class FixedGreedyPacker(Packer):
    """Table 2's remedy: ``G`` global batches placed greedily into ``G * N`` sequences, emitted
    ``N`` per step heaviest first, so that expensive sequences share a step.

    ``planned`` holds the window's remaining documents, ``tag`` their global micro-batch
    ``step_offset * N + j``; ``carry`` what did not fit in the window.
    """

    name = "fixed_greedy"
    _pools = ("carry", "planned")

    def __init__(self, config, cost_model) -> None:
        super().__init__(config, cost_model)
        self.g = config.packing_window
        self.planned = DocPool()
        self.window_pos = 0  # steps of the current window already emitted (G once it is empty)

    def tokens_wanted(self) -> int:
        if len(self.planned):  # a window is being emitted (then window_pos < G)
            return 0
        return max(0, self.g * self.n * self.config.context_len - int(self.carry.lens.sum()))

    def _assign(self, pool: DocPool) -> np.ndarray:
        """Global micro-batch (0 .. G*N-1) of every document of ``pool``; -1 = carry. Carried
        documents are placed first: none is carried twice while new ones have room (no starvation).
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
        if not len(self.planned):
            pool = DocPool.concat([self.carry, DocPool(ids, lens, self._step)])
            mb = self._assign(pool)
            nb = self.g * self.n
            placed = mb >= 0
            loads = np.bincount(
                mb[placed], weights=self.cost_model.doc_cost(pool.lens[placed]), minlength=nb
            )
            rank = np.argsort(np.argsort(-loads, kind="stable"))  # 0: the heaviest micro-batch
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


class SolverPacker(FixedGreedyPacker):
    """``fixed_greedy``'s windows placed by the exact integer program. With a node limit (training
    sets one) a plan cut by the time limit is an error: other ranks might not share it."""

    name = "solver"

    def _assign(self, pool: DocPool) -> np.ndarray:
        greedy = super()._assign(pool)
        placed = np.flatnonzero(greedy >= 0)
        out = np.full(len(pool), -1, np.int64)
        if placed.size:
            cfg = self.config
            res = solve_minmax(
                pool.lens[placed],
                self.g * self.n,
                self.cap,
                self.cost_model,
                cfg.solver_time_limit_s,
                warm_start=greedy[placed],
                node_limit=cfg.solver_node_limit,
            )
            if res.time_limited and cfg.solver_node_limit is not None:
                raise RuntimeError(
                    f"solver: packing window {self._step // self.g} ({placed.size} documents) hit "
                    f"the time limit solver_time_limit_s = {cfg.solver_time_limit_s} before "
                    f"the node limit solver_node_limit = {cfg.solver_node_limit}; a plan cut by "
                    "time depends on this machine's load and other ranks could train other "
                    "documents. Lower [wlb] solver_node_limit or raise [wlb] solver_time_limit_s"
                )
            out[placed] = res.assign
        return out
