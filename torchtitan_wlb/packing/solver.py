"""``solver``: exact min-max assignment by integer programming (HiGHS), the quality reference.

For a set of documents with workloads ``c_i`` and lengths ``l_i`` and ``B`` micro-batches of at most
``cap`` tokens, minimise ``z`` subject to ``sum_j x_ij = 1``, ``sum_i c_i x_ij <= z`` and
``sum_i l_i x_ij <= cap`` with binary ``x_ij``. Micro-batches are interchangeable, so the ``i``-th
most expensive document is restricted to micro-batches ``0..i`` (a standard symmetry cut). HiGHS
runs with a time limit, starting from the greedy solution; the best solution found and the proven
lower bound are both reported, so a window the solver does not finish still gives a gap bound.

The ``solver`` packer is ``fixed_greedy`` with this exact placement: the greedy decides which
documents fit the window (the rest is carried), the integer program places them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing.base import DocPool
from torchtitan_wlb.packing.fixed_greedy import WindowedPacker, greedy_window

__all__ = ["SolveResult", "solve_minmax", "SolverPacker"]


@dataclass
class SolveResult:
    """Outcome of one min-max solve."""

    assign: np.ndarray
    """Micro-batch of every document (int64, same order as the input)."""
    max_load: float
    """Workload of the heaviest micro-batch in the returned assignment."""
    lower_bound: float
    """Proven lower bound on the optimal max workload (equals ``max_load`` when optimal)."""
    optimal: bool
    """Whether HiGHS proved the assignment optimal within the time limit."""
    seconds: float
    """Wall time of the solve."""


def solve_minmax(
    lens: np.ndarray,
    n_bins: int,
    cap: int,
    cost_model: CostModel,
    time_limit: float,
    warm_start: np.ndarray | None = None,
) -> SolveResult:
    """Min-max assignment of all documents to ``n_bins`` micro-batches of at most ``cap`` tokens.

    ``warm_start`` (a feasible assignment) seeds HiGHS; if the solver finds nothing better (or
    nothing at all) within ``time_limit`` seconds, it is returned. Raises ``ValueError`` if the
    documents cannot fit and no warm start is given.
    """
    import highspy  # only the solver needs it; the packer registry imports this module

    t0 = time.perf_counter()
    lens = np.asarray(lens, np.int64)
    n = lens.size
    cost = cost_model.doc_cost(lens)
    scale = float(cost.max()) if n else 1.0
    c = cost / scale
    order = np.argsort(-c, kind="stable")
    nb = n_bins
    ncol = n * nb + 1
    # Columns: x[i, j] at i * nb + j (i in cost order), z last.
    i_idx = np.repeat(np.arange(n), nb)
    j_idx = np.tile(np.arange(nb), n)
    rows = np.stack([i_idx, n + j_idx, n + nb + j_idx], axis=1).reshape(-1)
    vals = np.stack([np.ones(n * nb), c[order][i_idx], lens[order][i_idx] / cap], axis=1).reshape(
        -1
    )
    starts = np.arange(0, 3 * n * nb + 1, 3)
    z_rows = np.arange(n, n + nb)
    lp = highspy.HighsLp()
    lp.num_col_ = ncol
    lp.num_row_ = n + 2 * nb
    lp.col_cost_ = np.concatenate([np.zeros(n * nb), [1.0]])
    upper = np.ones(n * nb)
    upper[j_idx > i_idx] = 0.0  # symmetry cut: the i-th largest uses bins 0..i only
    lp.col_lower_ = np.zeros(ncol)
    lp.col_upper_ = np.concatenate([upper, [highspy.kHighsInf]])
    lp.row_lower_ = np.concatenate([np.ones(n), np.full(nb, -highspy.kHighsInf), np.zeros(nb)])
    lp.row_upper_ = np.concatenate([np.ones(n), np.zeros(nb), np.ones(nb)])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.concatenate([starts, [starts[-1] + nb]]).astype(np.int32)
    lp.a_matrix_.index_ = np.concatenate([rows, z_rows]).astype(np.int32)
    lp.a_matrix_.value_ = np.concatenate([vals, -np.ones(nb)])
    lp.integrality_ = [highspy.HighsVarType.kInteger] * (n * nb) + [
        highspy.HighsVarType.kContinuous
    ]
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.passModel(lp)

    def _max_load(assign: np.ndarray) -> float:
        return float(np.bincount(assign, weights=cost, minlength=nb).max())

    warm = None
    if warm_start is not None:
        warm = np.asarray(warm_start, np.int64)
        # Relabel the warm start's bins so that it satisfies the symmetry cut.
        first = {}
        relabel = np.empty(nb, np.int64)
        for b in warm[order].tolist():
            first.setdefault(b, len(first))
        unused = [b for b in range(nb) if b not in first]
        for b in unused:
            first[b] = len(first)
        for b, k in first.items():
            relabel[b] = k
        w = relabel[warm[order]]
        if np.all(w <= np.arange(n)):
            sol = highspy.HighsSolution()
            x = np.zeros(ncol)
            x[np.arange(n) * nb + w] = 1.0
            x[-1] = float(np.bincount(w, weights=c[order], minlength=nb).max())
            sol.col_value = x.tolist()
            sol.value_valid = True
            h.setSolution(sol)
    h.run()
    info = h.getInfo()
    status = h.getModelStatus()
    assign = None
    if info.primal_solution_status == 2:  # feasible solution available
        x = np.asarray(h.getSolution().col_value[: n * nb]).reshape(n, nb)
        a_sorted = np.argmax(x, axis=1)
        assign = np.empty(n, np.int64)
        assign[order] = a_sorted
        tokens = np.bincount(assign, weights=lens, minlength=nb)
        if tokens.max() > cap:
            assign = None
    if assign is None or (warm is not None and _max_load(warm) < _max_load(assign)):
        if warm is None:
            raise ValueError(
                f"solver found no assignment of {n} documents into {nb} micro-batches of {cap} "
                f"tokens within {time_limit} s"
            )
        assign = warm
    best = _max_load(assign)
    optimal = status == highspy.HighsModelStatus.kOptimal
    bound = best if optimal else max(float(info.mip_dual_bound) * scale, cost.sum() / nb)
    return SolveResult(
        assign=assign,
        max_load=best,
        lower_bound=min(bound, best),
        optimal=bool(optimal),
        seconds=time.perf_counter() - t0,
    )


class SolverPacker(WindowedPacker):
    """Fixed-length packing over ``G`` global batches, placed by the exact integer program."""

    name = "solver"

    def _assign(self, pool: DocPool) -> np.ndarray:
        nb = self.g * self.n
        cap = self.config.context_len
        greedy = greedy_window(pool, nb, cap, self.cost_model, self._step)
        placed = np.flatnonzero(greedy >= 0)
        out = np.full(len(pool), -1, np.int64)
        if placed.size:
            res = solve_minmax(
                pool.lens[placed],
                nb,
                cap,
                self.cost_model,
                self.config.solver_time_limit,
                warm_start=greedy[placed],
            )
            out[placed] = res.assign
        return out
