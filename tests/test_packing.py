"""Property tests of the packers: exactly-once, caps, determinism, resume, bounded delay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing import (
    PACKERS,
    LengthStream,
    PackingConfig,
    build_packer,
    drain,
    drive,
    next_plan,
)
from torchtitan_wlb.packing.driver import pull_until, take_until
from torchtitan_wlb.packing.placement import fill_rounds, water_level
from torchtitan_wlb.packing.solver import solve_minmax
from torchtitan_wlb.packing.wlb import default_thresholds

CTX = 64
COST = CostModel.from_coefficients(attn_coef=1.0 / 32, linear_coef=1.0)  # break-even 32 tokens
FAST = ("original", "fixed_greedy", "wlb", "wlb_paper")
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def make(
    name: str, n: int, *, smax=None, packing_window=1, max_delay_steps=2, queues=None, **kw
) -> object:
    if smax is None and name in ("original", "fixed_greedy", "solver"):
        smax = CTX
    cfg = PackingConfig(
        micro_batches=n,
        context_len=CTX,
        smax=smax,
        packing_window=packing_window,
        max_delay_steps=max_delay_steps,
        queue_thresholds=queues,
        solver_time_limit_s=2.0,
        **kw,
    )
    return build_packer(name, cfg, COST)


def run(packer, lens: np.ndarray | LengthStream) -> list:
    """The driving protocol (the package's driver) to the end of the data, its flush included."""
    stream = lens if isinstance(lens, LengthStream) else LengthStream(lens)
    plans = list(drive(packer, stream, 10_000))
    assert stream.remaining == 0 and not packer.has_pending(), "packer did not drain"
    return plans


def head(packer, lens: np.ndarray, k: int) -> tuple[list, LengthStream]:
    """The first ``k`` steps of :func:`run`, and a stream that resumes where they stopped."""
    stream = LengthStream(lens)
    plans = list(drive(packer, stream, k))
    return plans, LengthStream(lens, pos=stream.pos, exhausted=stream.exhausted)


def cap_of(name: str, n: int) -> int:
    return make(name, n).cap


lengths_st = st.lists(st.integers(1, CTX), min_size=0, max_size=120).map(
    lambda x: np.asarray(x, np.int64)
)


@SETTINGS
@given(
    name=st.sampled_from(FAST),
    lens=lengths_st,
    n=st.integers(1, 5),
    packing_window=st.integers(1, 3),
)
def test_exactly_once_and_cap(name, lens, n, packing_window):
    packer = make(name, n, packing_window=packing_window)
    plans = run(packer, lens)
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
    packing_window = 2 if name == "fixed_greedy" else 1
    ref = run(make(name, n, packing_window=packing_window), lens)
    again = run(make(name, n, packing_window=packing_window), lens)
    _assert_same(ref, again)
    if not ref:
        return
    k = data.draw(st.integers(0, len(ref) - 1))
    # Run k steps, save (through JSON: the state must be plain data), restore into a new packer.
    first = make(name, n, packing_window=packing_window)
    first_plans, rest = head(first, lens, k)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make(name, n, packing_window=packing_window)
    resumed.load_state_dict(state)
    tail = run(resumed, rest)
    _assert_same(ref, first_plans + tail)


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
        name,
        n,
        max_delay_steps=k,
        smax=4 * CTX,
        queues=(CTX // 8, CTX // 4),
        adaptive_max_delay_steps=0,
    )
    plans = run(packer, lens)
    for p in plans:
        assert p.stats["max_delay"] <= max(k, 1)


def test_wlb_balances_a_skewed_batch_better_than_original():
    rng = np.random.default_rng(0)
    lens = np.where(
        rng.random(4000) < 0.05, rng.integers(40, CTX + 1, 4000), rng.integers(1, 8, 4000)
    )
    res = {}
    for name in ("original", "wlb"):
        plans = run(make(name, 4, max_delay_steps=8), lens)
        res[name] = np.mean([p.stats["imbalance"] for p in plans[:-3]])
    assert res["wlb"] < res["original"]
    assert res["wlb"] < 1.1


def test_queue_levels_and_flush():
    # Two long documents (queue level 1) and short ones; N = 4 so the queue never fills.
    packer = make("wlb_paper", 4, queues=(40,), max_delay_steps=10)
    lens = np.array([50, 3, 3, 50, 3, 3], np.int64)
    plan = packer.step(np.arange(6), lens)
    assert packer.queue_depths() == [2]
    assert sorted(np.concatenate(plan.doc_ids).tolist()) == [1, 2, 4, 5]
    flushed = packer.step(np.zeros(0, np.int64), np.zeros(0, np.int64), flush=True)
    assert sorted(np.concatenate(flushed.doc_ids).tolist()) == [0, 3]
    assert flushed.stats["max_delay"] == 1
    assert not packer.has_pending()


def test_wlb_paper_full_queue_releases_one_per_microbatch():
    packer = make("wlb_paper", 2, queues=(40,), max_delay_steps=10)
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
        (dict(micro_batches=2, context_len=8, max_delay_steps=-1), "max_delay_steps"),
        (dict(micro_batches=2, context_len=8, packing_window=0), "packing_window"),
        (dict(micro_batches=2, context_len=8, balance_target=0.5), "balance_target"),
        (dict(micro_batches=2, context_len=8, release_slack=-0.1), "release_slack"),
        (dict(micro_batches=2, context_len=8, delay_target=0.0), "delay_target"),
        (
            dict(micro_batches=2, context_len=8, adaptive_max_delay_steps=-1),
            "adaptive_max_delay_steps",
        ),
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


@pytest.mark.parametrize("deal", [False, True])
def test_water_level_and_fill_rounds_balance(deal):
    assert water_level(np.array([0.0, 0.0]), 10.0) == 5.0
    assert water_level(np.array([0.0, 8.0]), 4.0) == 4.0
    assert water_level(np.array([0.0, 2.0]), 4.0) == 3.0
    rng = np.random.default_rng(1)
    lens = rng.integers(1, 30, 500)
    costs = COST.doc_cost(lens)
    loads, tokens = np.zeros(8), np.zeros(8, np.int64)
    out = fill_rounds(loads, tokens, costs, lens, cap=10_000, deal=deal)
    assert (out >= 0).all()
    assert np.allclose(np.bincount(out, weights=costs, minlength=8), loads)
    assert np.array_equal(np.bincount(out, weights=lens, minlength=8), tokens)
    assert loads.max() / loads.mean() < 1.01
    # Token cap and workload limit are respected; what does not fit stays unplaced.
    loads, tokens = np.zeros(3), np.zeros(3, np.int64)
    out = fill_rounds(loads, tokens, costs, lens, cap=100, limit=150.0, deal=deal)
    assert tokens.max() <= 100 and loads.max() <= 150.0
    assert (out < 0).any()
    placed = out >= 0
    assert np.array_equal(np.bincount(out[placed], weights=lens[placed], minlength=3), tokens)


def test_fill_rounds_deals_the_largest_documents_one_per_micro_batch():
    """Four long documents among many short ones: runs of neighbours give one micro-batch three
    of them (under CP, whole documents that cannot be split evenly over the ranks); dealt, each
    micro-batch gets one. Both balance the loads exactly."""
    lens = np.array([400] * 4 + [50] * 64)
    costs = lens.astype(np.float64)
    per_bin = {}
    for deal in (False, True):
        loads, tokens = np.zeros(4), np.zeros(4, np.int64)
        out = fill_rounds(loads, tokens, costs, lens, cap=10_000, deal=deal)
        assert (out >= 0).all() and np.allclose(loads, 1200.0)
        per_bin[deal] = np.bincount(out[:4], minlength=4)
    assert per_bin[False].max() == 3
    assert per_bin[True].tolist() == [1, 1, 1, 1]


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
    plans = run(make("solver", 2, packing_window=2), lens)
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
    from torchtitan_wlb.packing.tuning import run_sample

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
            c = replace(cfg, queue_thresholds=th, max_delay_steps=k)
            run = run_sample("wlb", lens, c, COST, steps)
            table[(th, k)] = (run.imbalance, run.mean_delay)
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
    """Rare outliers: the delay stays low, so K grows from max_delay_steps towards
    adaptive_max_delay_steps (and never past it); without adaptivity K stays put."""
    rng = np.random.default_rng(4)
    n_docs = 6000
    lens = np.where(
        rng.random(n_docs) < 0.01, rng.integers(48, CTX + 1, n_docs), rng.integers(1, 6, n_docs)
    )
    adaptive = make("wlb", 4, max_delay_steps=2, adaptive_max_delay_steps=10)
    plans = run(adaptive, lens)
    assert 2 < max(p.stats["max_delay"] for p in plans) <= 10
    state = adaptive.state_dict()
    assert 2 <= state["k_eff"] <= 10
    fixed = make("wlb", 4, max_delay_steps=2, adaptive_max_delay_steps=0)
    plans = run(fixed, lens)
    assert max(p.stats["max_delay"] for p in plans) <= 2
    assert fixed.state_dict()["k_eff"] == 2


def test_adaptive_wait_spends_large_delay_headroom_faster():
    """While the running delay is under half its target (nothing held is being paid for), K
    rises faster than one ``_WAIT_STEP`` a step, up to ``_MAX_RISE`` of them; with the running
    delay above half the target the rise is the plain ``_WAIT_STEP``."""
    packer = make("wlb", 4, max_delay_steps=2, adaptive_max_delay_steps=60)
    step, most = packer._WAIT_STEP, packer._WAIT_STEP * packer._MAX_RISE
    stream = LengthStream(np.full(2000, 4, np.int64), end_of_data=False)  # regular: no delay
    ks = [packer.k_eff]
    for plan in drive(packer, stream, 20):
        assert plan.stats["mean_delay"] == 0.0
        ks.append(packer.k_eff)
    rises = np.diff(ks)
    assert (rises <= most + 1e-9).all()
    assert rises.max() > step  # faster than the linear ramp once the delay is far under target
    assert len(ks) == 21 and ks[-1] > 2 + step * 20
    # Above half the target: the plain step.
    slow = make("wlb", 4, max_delay_steps=2, adaptive_max_delay_steps=60)
    slow.delay_ema = 0.8 * slow.config.delay_target
    before = slow.k_eff
    list(drive(slow, LengthStream(np.full(40, 4, np.int64), end_of_data=False), 1))
    assert slow.k_eff == before + step


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
    packer = make("wlb", 8, max_delay_steps=6)
    threshold = int(packer.thresholds[0])
    stream = LengthStream(lens)
    handed_back_steps = 0
    before = np.zeros(0, np.int64)  # the hand-back before each step
    for plan in drive(packer, stream):
        pos = stream.pos  # after this step's pull
        emitted = np.concatenate(plan.doc_ids)
        if before.size:  # last step's hand-back precedes this step's pull in the stream
            assert before.max() < pos
        back = before = packer.backlog.ids.copy()
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


def test_back_pressure_keeps_exact_resume():
    lens = _skewed(1500, 6)
    ref = run(make("wlb", 8, max_delay_steps=6), lens)
    # Resume at every step whose state holds handed-back documents.
    checked = 0
    for k in range(1, len(ref)):
        packer = make("wlb", 8, max_delay_steps=6)
        first_plans, rest = head(packer, lens, k)
        if len(packer.backlog) == 0:
            continue
        state = json.loads(json.dumps(packer.state_dict()))
        resumed = make("wlb", 8, max_delay_steps=6)
        resumed.load_state_dict(state)
        tail = run(resumed, rest)
        _assert_same(ref, first_plans + tail)
        checked += 1
        if checked == 3:
            break
    assert checked > 0


# ---------------------------------------------------------------------- the driver
def test_take_until_budget_rule():
    cum = np.cumsum(np.array([5, 3, 7, 2], np.int64))  # 5 8 15 17
    assert take_until(0, cum, 0) == (0, False)  # budget 0: nothing, even at the start
    assert take_until(0, cum, 2) == (2, False)
    assert take_until(-3, cum, 1) == (1, False)
    assert take_until(1, cum, 0) == (1, False)  # the crossing document is included
    assert take_until(5, cum, 0) == (1, False)  # reached exactly: no more
    assert take_until(6, cum, 0) == (2, False)
    assert take_until(4, cum, 1) == (3, False)  # from position 1: 3 + 7 crosses 4
    assert take_until(9, cum, 2) == (4, False)  # 7 + 2 reaches 9 exactly at the end
    assert take_until(10, cum, 2) == (4, True)  # the stream ends before the budget
    assert take_until(1, cum, 4) == (4, True)
    assert take_until(1, np.zeros(0, np.int64), 0) == (0, True)


def test_pull_until_matches_take_until():
    lens = [5, 3, 7, 2]
    for budget in range(-1, 20):
        for start in range(len(lens) + 1):
            it = iter(lens[start:])
            calls = []

            def pull(it=it, calls=calls):
                n = next(it, None)
                calls.append(n)
                return n

            ran_out = pull_until(budget, pull)
            pulled = len([c for c in calls if c is not None])
            end, expect = take_until(budget, np.cumsum(lens), start)
            assert (start + pulled, ran_out) == (end, expect)
            if budget <= 0:
                assert calls == []  # budget 0 pulls nothing


def test_driver_pulls_nothing_when_the_budget_is_zero():
    """fixed_greedy with G = 2 plans two steps at once; the second asks for 0 tokens."""
    lens = np.full(40, 16, np.int64)
    packer = make("fixed_greedy", 2, packing_window=2)
    stream = LengthStream(lens)
    assert next_plan(packer, stream) is not None
    pos = stream.pos
    assert pos > 0 and packer.tokens_wanted() == 0
    plan = next_plan(packer, stream)
    assert stream.pos == pos and plan.stats["num_docs"] > 0


def test_driver_flushes_from_the_end_of_the_data():
    """The step whose pull runs out is planned with flush=True, and so is every later one; the
    queued outliers come out and nothing is lost. A stream that is only a sample is not flushed."""
    lens = np.array([3] * 30 + [50, 50, 3, 3], np.int64)
    flushes = []

    class Spy:
        def __init__(self, packer):
            self.packer = packer

        def __getattr__(self, name):
            return getattr(self.packer, name)

        def step(self, ids, lens, *, flush=False):
            flushes.append(flush)
            return self.packer.step(ids, lens, flush=flush)

    packer = Spy(make("wlb_paper", 4, queues=(40,), max_delay_steps=20, adaptive_max_delay_steps=0))
    stream = LengthStream(lens)
    plans = run(packer, stream)
    assert stream.exhausted and flushes[-1] and not packer.has_pending()
    first = flushes.index(True)
    assert all(flushes[first:]) and stream.pos == lens.size
    emitted = np.sort(np.concatenate([np.concatenate(p.doc_ids) for p in plans]))
    assert np.array_equal(emitted, np.arange(lens.size))
    # A sample: no flush, the queued outliers stay queued once the sample is used up.
    flushes.clear()
    sample = Spy(make("wlb_paper", 4, queues=(40,), max_delay_steps=20, adaptive_max_delay_steps=0))
    for _ in drive(sample, LengthStream(lens, end_of_data=False), 3):
        pass
    assert not any(flushes) and sample.has_pending()
    # drain() flushes what a run that stops early still holds.
    rest = list(drain(sample))
    assert rest and not sample.has_pending()


def test_drive_stops_after_steps_and_resumes():
    lens = _skewed(400, 7)
    whole = run(make("wlb", 4, max_delay_steps=3), lens)
    packer = make("wlb", 4, max_delay_steps=3)
    stream = LengthStream(lens)
    first = list(drive(packer, stream, 5))
    assert len(first) == 5
    _assert_same(whole, first + run(packer, stream))


def test_forced_step_pulls_enough_to_balance_its_outlier():
    """A step that must force an outlier out (it waited K steps) pulls more than one global batch,
    up to the step's token capacity, so its other micro-batches come closer to the outlier's cost;
    without that the outlier sits beside one global batch of short documents."""
    from torchtitan_wlb.packing.wlb import WLBPacker, _QueuedPacker

    lens = np.concatenate([[CTX], np.full(1000, 2)]).astype(np.int64)  # one outlier, then short

    def forced_step(packer):
        stream = LengthStream(lens)
        for plan in drive(packer, stream):
            if 0 in np.concatenate(plan.doc_ids):
                return plan, stream
        raise AssertionError("the outlier was never emitted")

    packer = make("wlb", 4, smax=2 * CTX, adaptive_max_delay_steps=0)
    stream = LengthStream(lens)
    next_plan(packer, stream)
    next_plan(packer, stream)  # the outlier is due at the next step
    assert len(packer.queue) == 1
    held = int(packer.carry.lens.sum()) + int(packer.backlog.lens.sum())
    assert packer.tokens_wanted() > 4 * CTX - held
    assert packer.tokens_wanted() <= 0.98 * 4 * packer.cap - CTX

    plan, _ = forced_step(make("wlb", 4, smax=2 * CTX, adaptive_max_delay_steps=0))

    class BaseRule(WLBPacker):
        tokens_wanted = _QueuedPacker.tokens_wanted

    base_plan, _ = forced_step(
        BaseRule(make("wlb", 4, smax=2 * CTX, adaptive_max_delay_steps=0).config, COST)
    )
    assert plan.stats["tokens"] > base_plan.stats["tokens"]
    assert plan.stats["imbalance"] < base_plan.stats["imbalance"]
    assert plan.stats["max_tokens"] <= packer.cap
    # Exactly once to the end of the data, the forced steps' surplus handed back, not lost.
    plans = run(make("wlb", 4, smax=2 * CTX, adaptive_max_delay_steps=0), lens)
    ids = np.sort(np.concatenate([np.concatenate(p.doc_ids) for p in plans]))
    assert np.array_equal(ids, np.arange(lens.size))


def test_forced_step_pull_follows_the_cost_model_in_use():
    """The online cost model swaps the packer's model between steps (seconds, not FLOPs): the
    forced step's pull must be the same under any rescaled model, not mix two models' units."""
    lens = np.concatenate([[CTX], np.full(1000, 2)]).astype(np.int64)
    packer = make("wlb", 4, smax=2 * CTX, adaptive_max_delay_steps=0)
    stream = LengthStream(lens)
    next_plan(packer, stream)
    next_plan(packer, stream)  # the outlier is due at the next step
    wanted = packer.tokens_wanted()
    packer.cost_model = CostModel(COST.attn_coef * 2.0**-50, COST.linear_coef * 2.0**-50, "seconds")
    assert packer.tokens_wanted() == wanted


@pytest.mark.parametrize("name", ["wlb", "wlb_paper"])
def test_derived_queue_thresholds_follow_the_cost_model_in_use(name):
    """Thresholds left to the cost model are the current model's (the online refit prices
    attention apart from the initial model; docs/cost_model.md), so a packer handed a new model
    queues exactly as one built with it; configured thresholds stay as configured."""
    pricier = CostModel(COST.attn_coef * 1.5, COST.linear_coef, "flops")
    lens = _skewed(2000, 3)
    swapped = make(name, 8)
    built = build_packer(name, swapped.config, pricier)
    assert not np.array_equal(swapped.thresholds, built.thresholds)
    swapped.cost_model = pricier
    assert np.array_equal(swapped.thresholds, built.thresholds)
    got = [p.doc_ids for p in run(swapped, lens)]
    want = [p.doc_ids for p in run(built, lens)]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    fixed = make(name, 8, queues=(10, 30))
    fixed.cost_model = pricier
    assert fixed.thresholds.tolist() == [10, 30]
