"""Property tests of the packers: exactly-once, caps, determinism, resume, bounded delay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing import PACKERS, PackingConfig, build_packer
from torchtitan_wlb.packing.placement import fill_rounds, water_level
from torchtitan_wlb.packing.solver import solve_minmax
from torchtitan_wlb.packing.wlb import default_thresholds

CTX = 64
COST = CostModel.from_coefficients(attn_coef=1.0 / 32, linear_coef=1.0)  # break-even 32 tokens
FAST = ("original", "fixed_greedy", "wlb", "wlb_paper")
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def make(name: str, n: int, *, smax=None, window=1, max_wait=2, queues=None, **kw) -> object:
    if smax is None and name in ("original", "fixed_greedy", "solver"):
        smax = CTX
    cfg = PackingConfig(
        micro_batches=n,
        context_len=CTX,
        smax=smax,
        window=window,
        max_wait=max_wait,
        queue_thresholds=queues,
        solver_time_limit=2.0,
        **kw,
    )
    return build_packer(name, cfg, COST)


def drive(packer, lens: np.ndarray, start: int = 0, pos: int = 0, max_steps: int = 10_000):
    """Run the documented driving protocol to the end; return (plans, positions per step)."""
    ids = np.arange(lens.size, dtype=np.int64)
    cs = np.cumsum(lens)
    plans, positions = [], []
    for _ in range(max_steps):
        budget = packer.tokens_wanted()
        end = pos
        if budget > 0 and pos < lens.size:
            base = cs[pos - 1] if pos else 0
            end = min(lens.size, int(np.searchsorted(cs, base + budget, side="left")) + 1)
        exhausted = end >= lens.size
        if pos >= lens.size and not packer.has_pending():
            break
        positions.append(pos)
        plans.append(packer.step(ids[pos:end], lens[pos:end], flush=exhausted))
        pos = end
    else:
        raise AssertionError("packer did not drain")
    return plans, positions


def cap_of(name: str, n: int) -> int:
    return make(name, n).cap


lengths_st = st.lists(st.integers(1, CTX), min_size=0, max_size=120).map(
    lambda x: np.asarray(x, np.int64)
)


@SETTINGS
@given(name=st.sampled_from(FAST), lens=lengths_st, n=st.integers(1, 5), window=st.integers(1, 3))
def test_exactly_once_and_cap(name, lens, n, window):
    packer = make(name, n, window=window)
    plans, _ = drive(packer, lens)
    emitted = np.concatenate([np.concatenate(p.doc_ids) for p in plans] or [np.zeros(0, int)])
    assert np.array_equal(np.sort(emitted), np.arange(lens.size))
    for p in plans:
        assert len(p.doc_ids) == n
        for ids, ls in zip(p.doc_ids, p.doc_lens, strict=True):
            assert np.array_equal(lens[ids], ls)
            assert ls.sum() <= packer.cap
        assert p.stats["max_tokens"] <= packer.cap
    assert not packer.has_pending()


@SETTINGS
@given(name=st.sampled_from(FAST), lens=lengths_st, n=st.integers(1, 4), data=st.data())
def test_deterministic_and_resume_from_any_step(name, lens, n, data):
    window = 2 if name == "fixed_greedy" else 1
    ref, positions = drive(make(name, n, window=window), lens)
    again, _ = drive(make(name, n, window=window), lens)
    _assert_same(ref, again)
    if not ref:
        return
    k = data.draw(st.integers(0, len(ref) - 1))
    # Run k steps, save (through JSON: the state must be plain data), restore into a new packer.
    first = make(name, n, window=window)
    head, _ = _steps(first, lens, k)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make(name, n, window=window)
    resumed.load_state_dict(state)
    tail, _ = drive(resumed, lens, pos=positions[k])
    _assert_same(ref, head + tail)


def _steps(packer, lens, k):
    """The first ``k`` steps of :func:`drive`."""
    plans, positions = [], []
    ids = np.arange(lens.size, dtype=np.int64)
    cs = np.cumsum(lens)
    pos = 0
    for _ in range(k):
        budget = packer.tokens_wanted()
        end = pos
        if budget > 0 and pos < lens.size:
            base = cs[pos - 1] if pos else 0
            end = min(lens.size, int(np.searchsorted(cs, base + budget, side="left")) + 1)
        positions.append(pos)
        plans.append(packer.step(ids[pos:end], lens[pos:end], flush=end >= lens.size))
        pos = end
    return plans, positions


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.step == y.step
        for u, v in zip(x.doc_ids, y.doc_ids, strict=True):
            assert np.array_equal(u, v)


@SETTINGS
@given(
    name=st.sampled_from(("wlb", "wlb_paper")),
    lens=st.lists(st.integers(1, CTX // 2), max_size=150).map(lambda x: np.asarray(x, np.int64)),
    n=st.integers(1, 5),
    k=st.integers(0, 4),
)
def test_bounded_delay(name, lens, n, k):
    """With room for the forced work (S_max = 4 x context), nothing waits more than max(K, 1).

    (Regular documents may be carried once even with K = 0; without the headroom, forced
    documents that exceed a step's capacity wait for the next step, oldest first.)
    """
    packer = make(
        name, n, max_wait=k, smax=4 * CTX, queues=(CTX // 8, CTX // 4), adaptive_max_wait=0
    )
    plans, _ = drive(packer, lens)
    for p in plans:
        assert p.stats["max_delay"] <= max(k, 1)


def test_wlb_balances_a_skewed_batch_better_than_original():
    rng = np.random.default_rng(0)
    lens = np.where(
        rng.random(4000) < 0.05, rng.integers(40, CTX + 1, 4000), rng.integers(1, 8, 4000)
    )
    res = {}
    for name in ("original", "wlb"):
        plans, _ = drive(make(name, 4, max_wait=8), lens)
        res[name] = np.mean([p.stats["imbalance"] for p in plans[:-3]])
    assert res["wlb"] < res["original"]
    assert res["wlb"] < 1.1


def test_queue_levels_and_flush():
    # Two long documents (queue level 1) and short ones; N = 4 so the queue never fills.
    packer = make("wlb_paper", 4, queues=(40,), max_wait=10)
    lens = np.array([50, 3, 3, 50, 3, 3], np.int64)
    plan = packer.step(np.arange(6), lens)
    assert packer.queue_depths() == [2]
    assert sorted(np.concatenate(plan.doc_ids).tolist()) == [1, 2, 4, 5]
    flushed = packer.step(np.zeros(0, np.int64), np.zeros(0, np.int64), flush=True)
    assert sorted(np.concatenate(flushed.doc_ids).tolist()) == [0, 3]
    assert flushed.stats["max_delay"] == 1
    assert not packer.has_pending()


def test_wlb_paper_full_queue_releases_one_per_microbatch():
    packer = make("wlb_paper", 2, queues=(40,), max_wait=10)
    plan = packer.step(np.arange(4), np.array([50, 60, 5, 5], np.int64))
    longs = [sorted(ls[ls >= 40].tolist()) for ls in plan.doc_lens]
    assert sorted(longs) == [[50], [60]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(micro_batches=0, context_len=8), "micro_batches"),
        (dict(micro_batches=2, context_len=8, smax=4), "below context_len"),
        (dict(micro_batches=2, context_len=8, queue_thresholds=(5, 5)), "strictly increasing"),
        (dict(micro_batches=2, context_len=8, queue_thresholds=(6, 3)), "strictly increasing"),
        (dict(micro_batches=2, context_len=8, max_wait=-1), "max_wait"),
        (dict(micro_batches=2, context_len=8, window=0), "window"),
        (dict(micro_batches=2, context_len=8, balance_target=0.5), "balance_target"),
        (dict(micro_batches=2, context_len=8, release_slack=-0.1), "release_slack"),
        (dict(micro_batches=2, context_len=8, delay_target=0.0), "delay_target"),
        (dict(micro_batches=2, context_len=8, adaptive_max_wait=-1), "adaptive_max_wait"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackingConfig(**kwargs)


@pytest.mark.parametrize("name", PACKERS)
def test_bad_lengths_rejected(name):
    packer = make(name, 2)
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        packer.step(np.arange(2), np.array([3, 0]))
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        packer.step(np.arange(1), np.array([-4]))
    with pytest.raises(ValueError, match="more than the micro-batch cap"):
        packer.step(np.arange(1), np.array([packer.cap + 1]))


def test_unknown_packer():
    with pytest.raises(ValueError, match="unknown packer 'lpt'"):
        build_packer("lpt", PackingConfig(micro_batches=1, context_len=4), COST)


def test_water_level_and_fill_rounds_balance():
    assert water_level(np.array([0.0, 0.0]), 10.0) == 5.0
    assert water_level(np.array([0.0, 8.0]), 4.0) == 4.0
    assert water_level(np.array([0.0, 2.0]), 4.0) == 3.0
    rng = np.random.default_rng(1)
    lens = rng.integers(1, 30, 500)
    costs = COST.doc_cost(lens)
    loads, tokens = np.zeros(8), np.zeros(8, np.int64)
    out = fill_rounds(loads, tokens, costs, lens, cap=10_000)
    assert (out >= 0).all()
    assert np.allclose(np.bincount(out, weights=costs, minlength=8), loads)
    assert loads.max() / loads.mean() < 1.01
    # Token cap and workload limit are respected; what does not fit stays unplaced.
    loads, tokens = np.zeros(3), np.zeros(3, np.int64)
    out = fill_rounds(loads, tokens, costs, lens, cap=100, limit=150.0)
    assert tokens.max() <= 100 and loads.max() <= 150.0
    assert (out < 0).any()


def test_solver_is_optimal_on_small_instance():
    lens = np.array([30, 20, 20, 10, 10, 10, 5, 5], np.int64)
    res = solve_minmax(lens, 3, cap=64, cost_model=COST, time_limit=5.0)
    assert res.optimal
    # Brute force over all 3^8 assignments.
    costs = COST.doc_cost(lens)
    grid = np.array(np.meshgrid(*[np.arange(3)] * lens.size, indexing="ij")).reshape(lens.size, -1)
    loads = np.stack([((grid == j) * costs[:, None]).sum(0) for j in range(3)])
    toks = np.stack([((grid == j) * lens[:, None]).sum(0) for j in range(3)])
    best = loads.max(0)[(toks <= 64).all(0)].min()
    assert res.max_load == pytest.approx(best)
    assert np.bincount(res.assign, weights=lens, minlength=3).max() <= 64


def test_solver_packer_exactly_once():
    rng = np.random.default_rng(2)
    lens = rng.integers(1, CTX + 1, 40)
    plans, _ = drive(make("solver", 2, window=2), lens)
    emitted = np.sort(np.concatenate([np.concatenate(p.doc_ids) for p in plans]))
    assert np.array_equal(emitted, np.arange(lens.size))


def test_default_thresholds_increase_and_stay_below_context():
    th = default_thresholds(COST, 1000)
    assert list(th) == sorted(set(th)) and th[-1] < 1000
    # For this model W(d) = d^2/32 + d: the first level is where W(d) = 0.5 * 1000.
    assert abs(th[0] ** 2 / 32 + th[0] - 500) < th[0] / 16 + 1


def test_tune_queues_picks_the_most_balanced_within_budget():
    from dataclasses import replace

    from torchtitan_wlb.packing import tune_queues
    from torchtitan_wlb.packing.tuning import simulate

    rng = np.random.default_rng(3)
    n = 2500
    lens = np.where(rng.random(n) < 0.05, rng.integers(40, CTX + 1, n), rng.integers(1, 8, n))
    cfg = PackingConfig(micro_batches=2, context_len=CTX)  # the sample holds > 100 batches
    waits, levels = (1, 4, 16), (1, 2)
    steps = 25
    table = {}
    for k_levels in levels:
        th = default_thresholds(COST, CTX, k_levels)
        for k in waits:
            c = replace(cfg, queue_thresholds=th, max_wait=k)
            table[(th, k)] = simulate("wlb", lens, c, COST, steps)
    budget = float(np.median([d for _, d in table.values()]))
    res = tune_queues(lens, cfg, COST, delay_budget=budget, waits=waits, levels=levels, steps=steps)
    within = {key: v for key, v in table.items() if v[1] <= budget}
    lowest = min(v[0] for v in within.values())
    near = {key: v for key, v in within.items() if v[0] <= lowest + 0.005}
    best = min(near, key=lambda key: (near[key][1], near[key][0]))
    assert (res.queue_thresholds, res.max_wait) == best
    assert res.mean_delay <= budget
    # An impossible budget falls back to the least delay.
    low = tune_queues(lens, cfg, COST, delay_budget=0.0, waits=waits, levels=levels, steps=steps)
    assert low.mean_delay == min(d for _, d in table.values())
    with pytest.raises(ValueError, match="non-empty sample"):
        tune_queues(np.zeros(0, np.int64), cfg, COST)


def test_adaptive_wait_grows_when_delay_is_low_and_bounds_the_wait():
    """Rare outliers: the delay stays low, so K grows from max_wait towards adaptive_max_wait
    (and never past it); without adaptivity K stays put."""
    rng = np.random.default_rng(4)
    n_docs = 6000
    lens = np.where(
        rng.random(n_docs) < 0.01, rng.integers(48, CTX + 1, n_docs), rng.integers(1, 6, n_docs)
    )
    adaptive = make("wlb", 4, max_wait=2, adaptive_max_wait=10)
    plans, _ = drive(adaptive, lens)
    assert 2 < max(p.stats["max_delay"] for p in plans) <= 10
    state = adaptive.state_dict()
    assert 2 <= state["k_eff"] <= 10
    fixed = make("wlb", 4, max_wait=2, adaptive_max_wait=0)
    plans, _ = drive(fixed, lens)
    assert max(p.stats["max_delay"] for p in plans) <= 2
    assert fixed.state_dict()["k_eff"] == 2


def _skewed(n_docs: int, seed: int, p_long: float = 0.08) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.where(
        rng.random(n_docs) < p_long, rng.integers(40, CTX + 1, n_docs), rng.integers(1, 10, n_docs)
    ).astype(np.int64)


def test_back_pressure_hands_back_a_stream_suffix_of_regular_documents():
    """When a released outlier group fills a step, the fresh regular documents that do not fit
    are handed back as a suffix of the stream: no regular document emitted or carried at that
    step comes after a handed-back one, and the handed-back ones are offered first next step."""
    lens = _skewed(3000, 5)
    packer = make("wlb", 8, max_wait=6)
    threshold = int(packer.thresholds[0])
    ids = np.arange(lens.size, dtype=np.int64)
    cs = np.cumsum(lens)
    pos, handed_back_steps = 0, 0
    while pos < lens.size or packer.has_pending():
        budget = packer.tokens_wanted()
        end = pos
        if budget > 0 and pos < lens.size:
            base = cs[pos - 1] if pos else 0
            end = min(lens.size, int(np.searchsorted(cs, base + budget, side="left")) + 1)
        before = packer.backlog.ids.copy()
        plan = packer.step(ids[pos:end], lens[pos:end], flush=end >= lens.size)
        pos = end
        emitted = np.concatenate(plan.doc_ids)
        if before.size:  # last step's hand-back precedes this step's pull in the stream
            assert before.max() < pos
        back = packer.backlog.ids
        if back.size == 0:
            continue
        handed_back_steps += 1
        assert np.array_equal(back, np.sort(back))
        assert (lens[back] < threshold).all()
        regular_emitted = emitted[lens[emitted] < threshold]
        assert not (regular_emitted > back.min()).any()
        assert not (packer.carry.ids > back.min()).any()
        assert (packer.backlog.pulled <= packer._step - 1).all()
    assert handed_back_steps > 0  # the scenario exercises back-pressure


def test_back_pressure_keeps_exact_resume_and_old_states_load():
    lens = _skewed(1500, 6)
    ref, positions = drive(make("wlb", 8, max_wait=6), lens)
    # Resume at every step whose state holds handed-back documents.
    checked = 0
    for k in range(1, len(ref)):
        packer = make("wlb", 8, max_wait=6)
        head, _ = _steps(packer, lens, k)
        if len(packer.backlog) == 0:
            continue
        state = json.loads(json.dumps(packer.state_dict()))
        resumed = make("wlb", 8, max_wait=6)
        resumed.load_state_dict(state)
        tail, _ = drive(resumed, lens, pos=positions[k])
        _assert_same(ref, head + tail)
        checked += 1
        if checked == 3:
            break
    assert checked > 0
    # A state written before hand-back existed (no "backlog", no "pulled") still loads.
    packer = make("wlb", 8, max_wait=6)
    _steps(packer, lens, 3)
    state = packer.state_dict()
    state.pop("backlog")
    for pool in ("carry", "queue"):
        state[pool].pop("pulled")
    legacy = make("wlb", 8, max_wait=6)
    legacy.load_state_dict(state)
    assert np.array_equal(legacy.carry.pulled, legacy.carry.arrival)
    assert len(legacy.backlog) == 0
