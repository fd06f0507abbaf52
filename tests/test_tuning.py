"""The one recommender's rule (``packing.tuning.choose``), which ``pack_bench --tune`` and
``wlb-analyze`` share: pure Python on hand-made trials."""

import pytest

from torchtitan_wlb.packing.tuning import TuneResult, choose


def _trial(th, wait, imbalance, delay, smax=100):
    return TuneResult(tuple(th), wait, imbalance, delay, smax=smax, steps=10)


def test_smaller_smax_then_least_delay_win_among_the_near_best():
    trials = [
        _trial([5], 4, 1.010, 0.20, smax=150),  # the best imbalance, larger S_max
        _trial([5], 4, 1.013, 0.40, smax=125),  # within 0.005: the smaller S_max wins
        _trial([5, 9], 4, 1.014, 0.30, smax=125),  # same S_max, less delay: wins
        _trial([5], 8, 1.016, 0.10, smax=100),  # 0.006 off the best: not a tie
        _trial([5], 16, 1.000, 0.60, smax=100),  # over the delay budget
    ]
    assert choose(trials, delay_budget=0.5) == trials[2]
    assert choose(trials, delay_budget=0.5, tolerance=0.0) == trials[0]


def test_exact_ties_go_to_fewer_queues_then_the_smaller_wait():
    same = dict(imbalance=1.02, delay=0.3)
    trials = [_trial([5, 9], 2, **same), _trial([5], 8, **same), _trial([5], 4, **same)]
    assert choose(trials) == trials[2]


def test_no_trial_within_the_budget_gives_the_least_delay():
    trials = [_trial([5], 4, 1.00, 0.9), _trial([5], 2, 1.30, 0.7), _trial([5, 9], 2, 1.2, 0.8)]
    assert choose(trials, delay_budget=0.5) == trials[1]
    with pytest.raises(ValueError, match="delay_budget must be >= 0 steps, got -1"):
        choose(trials, delay_budget=-1)
