"""Exact min-max assignment by integer programming (HiGHS): the ``solver`` packer's placement and
the quality reference. The program, its symmetry cut and its limits: docs/packing.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from torchtitan_wlb.cost_model import CostModel


@dataclass
class SolveResult:
    """Outcome of one min-max solve."""

    assign: np.ndarray  # micro-batch of every document (int64, in input order)
    max_load: float  # workload of the heaviest micro-batch of ``assign``
    lower_bound: float  # proven bound on the optimal max workload (= max_load when optimal)
    optimal: bool  # whether HiGHS proved ``assign`` optimal within its limits
    time_limited: bool = False  # whether the time limit stopped HiGHS (then load-dependent)


def solve_minmax(
    lens: np.ndarray,
    n_bins: int,
    cap: int,
    cost_model: CostModel,
    time_limit: float,
    warm_start: np.ndarray | None = None,
    node_limit: int | None = None,
) -> SolveResult:
    """Min-max assignment of all documents to ``n_bins`` micro-batches of at most ``cap`` tokens;
    ``warm_start`` (feasible) seeds HiGHS and is kept unless beaten within the limits
    (``node_limit``: deterministic; ``time_limit``: not). No fit and no warm start: ``ValueError``.
    """
    import highspy  # only the solver needs it; the packer registry imports this module

    lens = np.asarray(lens, np.int64)
    n, nb = lens.size, n_bins
    cost = cost_model.doc_cost(lens)
    scale = float(cost.max()) if n else 1.0
    c = cost / scale
    order = np.argsort(-c, kind="stable")
    h = _highs(time_limit, node_limit)
    h.passModel(_program(c[order], lens[order], nb, cap))

    def _max_load(assign: np.ndarray) -> float:
        return float(np.bincount(assign, weights=cost, minlength=nb).max())

    warm = None
    if warm_start is not None:
        warm = np.asarray(warm_start, np.int64)
        h.setSolution(_warm_solution(warm, order, c, nb))
    h.run()
    info = h.getInfo()
    status = h.getModelStatus()
    assign = _assignment(h, order, lens, nb, cap)
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
        time_limited=status == highspy.HighsModelStatus.kTimeLimit,
    )


def _program(c: np.ndarray, lens: np.ndarray, nb: int, cap: int) -> Any:
    """The integer program of :func:`solve_minmax` (docs/packing.md). The documents come in
    descending cost order (``c``: costs scaled to at most 1, ``lens``: their lengths), so that the
    symmetry cut can restrict the i-th largest to bins ``0..i``."""
    import highspy

    n = c.size
    ncol = n * nb + 1
    # Columns: x[i, j] at i * nb + j (i in cost order), z last. Rows: one assignment row per
    # document, then the load rows (<= z) and the token rows (<= cap) of the micro-batches.
    i_idx = np.repeat(np.arange(n), nb)
    j_idx = np.tile(np.arange(nb), n)
    rows = np.stack([i_idx, n + j_idx, n + nb + j_idx], axis=1).reshape(-1)
    vals = np.stack([np.ones(n * nb), c[i_idx], lens[i_idx] / cap], axis=1)
    starts = np.arange(0, 3 * n * nb + 1, 3)
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
    lp.a_matrix_.index_ = np.concatenate([rows, np.arange(n, n + nb)]).astype(np.int32)
    lp.a_matrix_.value_ = np.concatenate([vals.reshape(-1), -np.ones(nb)])
    var = highspy.HighsVarType
    lp.integrality_ = [var.kInteger] * (n * nb) + [var.kContinuous]
    return lp


def _highs(time_limit: float, node_limit: int | None) -> Any:
    """A quiet HiGHS instance with the solve's limits; one thread and a fixed seed, so that a
    node limit bounds the same work on any machine."""
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    if node_limit is not None:
        h.setOptionValue("mip_max_nodes", int(node_limit))
    return h


def _warm_solution(warm: np.ndarray, order: np.ndarray, c: np.ndarray, nb: int) -> Any:
    """The warm start ``warm`` (a bin per document, in input order) as a HiGHS solution of the
    program. Its bins are relabelled by first use in cost order (then the unused ones): the i-th
    document then uses a bin <= i, so it satisfies the symmetry cut, which would reject it as
    given."""
    import highspy

    n = order.size
    first = dict.fromkeys(warm[order].tolist())
    first.update(dict.fromkeys(range(nb)))
    relabel = np.argsort(list(first))  # each bin's place in that order
    w = relabel[warm[order]]
    sol = highspy.HighsSolution()
    x = np.zeros(n * nb + 1)
    x[np.arange(n) * nb + w] = 1.0
    x[-1] = float(np.bincount(w, weights=c[order], minlength=nb).max())
    sol.col_value = x.tolist()
    sol.value_valid = True
    return sol


def _assignment(
    h: Any, order: np.ndarray, lens: np.ndarray, nb: int, cap: int
) -> np.ndarray | None:
    """The bin of every document (input order) in HiGHS's solution, or ``None`` when it has no
    feasible one, or when the one it has, rounded to whole documents, breaks a token cap (HiGHS
    holds its constraints within tolerances, the plan must hold them exactly)."""
    n = order.size
    if h.getInfo().primal_solution_status != 2:  # 2: a feasible solution is available
        return None
    x = np.asarray(h.getSolution().col_value[: n * nb]).reshape(n, nb)
    assign = np.empty(n, np.int64)
    assign[order] = np.argmax(x, axis=1)
    if np.bincount(assign, weights=lens, minlength=nb).max() > cap:
        return None
    return assign
