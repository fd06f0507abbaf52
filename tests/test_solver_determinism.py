"""The ``solver`` packer's plans are a pure function of the data and the config on every rank.

Each DP rank computes the global plan itself and keeps its slice, so two ranks must compute the
same plan whatever their load. With a node limit (what training uses) HiGHS does the same work
everywhere; a time limit reached first stops the run instead of handing out a load-dependent plan.
"""

import subprocess
import sys

import numpy as np
import pytest

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing import LengthStream, PackingConfig, build_packer, drive
from torchtitan_wlb.packing.solver import solve_minmax

COST = CostModel.from_coefficients(attn_coef=1.0 / 32, linear_coef=1.0)
CTX = 512


def _lens(seed=0, n=120):
    # Mid-sized documents: hard instances, where the node limit (not optimality) stops HiGHS.
    return np.random.default_rng(seed).integers(CTX // 20, CTX // 3, n)


def _plans(node_limit, time_limit=60.0):
    config = PackingConfig(
        micro_batches=4,
        context_len=CTX,
        packing_window=1,
        solver_time_limit_s=time_limit,
        solver_node_limit=node_limit,
    )
    packer = build_packer("solver", config, COST)
    return [[ids.tolist() for ids in p.doc_ids] for p in drive(packer, LengthStream(_lens()), 2)]


def test_node_limit_stops_the_solve_before_optimality():
    """The instance is hard enough that the deterministic limit is what stops HiGHS."""
    lens = _lens()[:18]
    res = solve_minmax(lens, 4, CTX, COST, time_limit=60.0, node_limit=20)
    assert not res.optimal and not res.time_limited
    assert res.lower_bound < res.max_load


def test_plans_are_the_same_under_load():
    quiet = _plans(node_limit=20)
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)
    ]  # another rank's machine: every core busy with other work
    try:
        loaded = _plans(node_limit=20)
    finally:
        for p in burners:
            p.kill()
            p.wait()
    assert loaded == quiet
    assert sum(len(ids) for plan in quiet for ids in plan) > 0


def test_time_limit_reached_first_stops_the_packer():
    with pytest.raises(RuntimeError, match="solver_time_limit_s = 0.001 before the node limit"):
        _plans(node_limit=1_000_000, time_limit=0.001)
