"""The online cost model's fit, guard rails and schedule, and the CP features the trainer fits on
(pure NumPy, no process group)."""

import threading

import numpy as np
import pytest

from torchtitan_wlb.cost_fit import (
    Coefficients,
    CostModelSchedule,
    FitStats,
    OnlineFitConfig,
    OnlineFitter,
    fit_nnls,
    refit,
    stage_sums,
)
from torchtitan_wlb.cost_model import CostModel

TRUE = Coefficients(a=2.0e-9, b=3.0e-6, c=4.0e-3)


def _micro_batches(rng, n, max_docs=8, max_len=2048):
    """``n`` micro-batches of random documents: their Σd² and Σd."""
    counts = rng.integers(1, max_docs + 1, n)
    lens = rng.integers(16, max_len, counts.sum())
    owner = np.repeat(np.arange(n), counts)
    return np.bincount(owner, lens.astype(float) ** 2, n), np.bincount(owner, lens, n)


def test_synthetic_timings_recover_the_coefficients_within_2_percent():
    rng = np.random.default_rng(0)
    sq, lin = _micro_batches(rng, 64)
    t = TRUE.predict(sq, lin) * (1 + rng.normal(0, 0.002, sq.size))  # 0.2 % timing noise
    # Split over "steps" and summed back: the statistics add up.
    parts = [FitStats.from_samples(sq[i::4], lin[i::4], t[i::4]) for i in range(4)]
    total = parts[0] + parts[1] + parts[2] + parts[3]
    coef, why = fit_nnls(total)
    assert why == ""
    np.testing.assert_allclose(coef[[0, 1, 3]], [TRUE.a, TRUE.b, TRUE.c], rtol=0.02)
    assert coef[2] == 0.0  # no gathered tokens (no CP): their term is left out
    round_trip = FitStats.from_vector(total.to_vector())
    assert np.array_equal(round_trip.to_vector(), total.to_vector())


def test_gathered_tokens_get_their_own_coefficient_in_the_packers_cost():
    """Under CP the plan mixes tokens whose K/V are gathered (dearer) with ones kept local, per
    micro-batch: the fit recovers both per-token costs, and hands the packer their mix."""
    rng = np.random.default_rng(5)
    sq, lin = _micro_batches(rng, 64)
    gathered = lin * rng.uniform(
        0.0, 1.0, lin.size
    )  # the plan's choice, micro-batch by micro-batch
    local = lin - gathered
    truth = Coefficients(a=2.0e-9, b=3.0e-6, c=4.0e-3, g=5.0e-6)
    t = truth.predict(sq, local, gathered) * (1 + rng.normal(0, 0.002, sq.size))
    stats = FitStats.from_samples(sq, local, t, sum_gathered=gathered)
    coef, why = fit_nnls(stats)
    assert why == ""
    np.testing.assert_allclose(coef, truth.as_array(), rtol=0.02)
    result = refit(stats, stats, Coefficients.of(CostModel(1.0, 100.0, "flops")))
    assert result.adopted and result.candidate.g == pytest.approx(5.0e-6, rel=0.02)
    share = result.candidate.gathered_share
    assert 0.3 < share < 0.7
    # The packer prices documents the plan keeps whole (<= whole_max_len) at b, longer ones at g.
    model = result.candidate.cost_model(whole_max_len=512)
    assert model.linear_coef == pytest.approx(coef[1]) and model.gathered_coef == coef[2]
    np.testing.assert_allclose(
        model.doc_cost(np.array([512, 513])),
        [coef[0] * 512**2 + coef[1] * 512, coef[0] * 513**2 + coef[2] * 513],
    )
    # A seen kind fitted at 0 (here local tokens, on a model with no attention term): one mixed
    # cost, no split pricing, so adaptive CP keeps choosing by the profile.
    zero_b = Coefficients(a=0.0, b=0.0, c=1e-3, g=4e-6, gathered_share=0.25).cost_model(512)
    assert zero_b.gathered_coef is None and zero_b.linear_coef == pytest.approx(1e-6)
    # Sharding that gathers every document (whole_max_len 0): every token at g.
    assert result.candidate.cost_model().doc_cost(np.array([100]))[0] == pytest.approx(
        coef[0] * 100**2 + coef[2] * 100
    )
    # Every document split (per_document sharding: no local tokens) or no CP (no gathered
    # tokens): the absent kind's term drops out instead of making the window degenerate.
    only_gathered = FitStats.from_samples(sq, np.zeros_like(lin), truth.predict(sq, 0, lin), lin)
    coef, why = fit_nnls(only_gathered)
    assert why == "" and coef[1] == 0.0 and coef[2] == pytest.approx(truth.g, rel=1e-6)
    result = refit(only_gathered, only_gathered, Coefficients.of(CostModel(1.0, 100.0, "flops")))
    assert result.candidate.gathered_share == 1.0
    assert result.candidate.cost_model().linear_coef == pytest.approx(truth.g, rel=1e-6)
    coef, why = fit_nnls(FitStats.from_samples(sq, lin, TRUE.predict(sq, lin)))
    assert why == "" and coef[2] == 0.0 and coef[1] == pytest.approx(TRUE.b, rel=1e-6)


def test_coefficients_stay_non_negative():
    rng = np.random.default_rng(1)
    sq, lin = _micro_batches(rng, 40)
    t = 1e-6 * lin + 1e-9 * sq - 1e-4  # the best unconstrained c is negative
    coef, why = fit_nnls(FitStats.from_samples(sq, lin, np.maximum(t, 1e-5)))
    assert why == "" and np.all(coef >= 0) and coef[0] > 0 and coef[1] > 0


def test_degenerate_window_is_rejected_with_a_reason():
    rng = np.random.default_rng(2)
    n = 32
    sq, lin = np.full(n, 3 * 512.0**2), np.full(n, 3 * 512.0)  # all the same micro-batch
    t = 0.05 * (1 + rng.normal(0, 0.02, n))  # noise only
    stats = FitStats.from_samples(sq, lin, t)
    coef, why = fit_nnls(stats)
    assert coef is None and "degenerate" in why
    result = refit(stats, stats, Coefficients.of(CostModel(1.0, 100.0, "flops")))
    assert not result.adopted and "degenerate" in result.reason


def test_refit_that_predicts_the_holdout_worse_is_not_adopted():
    rng = np.random.default_rng(3)
    sq, lin = _micro_batches(rng, 48)
    t = TRUE.predict(sq, lin)
    fit_part = FitStats.from_samples(sq[:32], lin[:32], t[:32])
    holdout = FitStats.from_samples(sq[32:], lin[32:], t[32:])
    # The model in use is already right (at another scale): the refit cannot beat it.
    scaled = Coefficients(TRUE.a * 7, TRUE.b * 7, TRUE.c * 7, unit="flops")
    result = refit(fit_part, holdout, scaled)
    assert not result.adopted and "no better" in result.reason
    # A wrong model in use (attention 20x too cheap) is replaced.
    wrong = Coefficients(TRUE.a / 20, TRUE.b, 0.0)
    result = refit(fit_part, holdout, wrong)
    assert result.adopted and result.candidate_error < 0.01 < result.incumbent_error


def test_bad_timings_and_config_are_refused():
    with pytest.raises(ValueError, match="finite and > 0"):
        FitStats.from_samples([1.0], [1.0], [0.0])
    with pytest.raises(ValueError, match="holdout_steps"):
        OnlineFitConfig(window_steps=2, holdout_steps=2)
    with pytest.raises(ValueError, match="apply_lag_steps"):
        OnlineFitConfig(apply_lag_steps=0)


def test_stage_sums_give_each_whole_micro_batch_once_in_key_order():
    # (step, mb) keys: micro-batch (1, 0) through stages 0 and 1, (0, 1) too (records out of
    # order), (2, 0) only through stage 1, so its sum is not its time and it is left out.
    keys = [(1, 0), (0, 1), (1, 0), (2, 0), (0, 1)]
    stages = [0, 1, 1, 1, 0]
    times = [[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [5.0, 50.0]]
    done, sums = stage_sums(keys, stages, times)
    assert done == [(0, 1), (1, 0)]
    assert sums.tolist() == [[7.0, 70.0], [4.0, 40.0]]
    done, sums = stage_sums([], [], np.zeros((0, 2)))
    assert done == [] and sums.shape == (0, 2)


def test_schedule_is_deterministic_whatever_the_reader_timing():
    cfg = OnlineFitConfig(
        warmup_steps=1, window_steps=4, holdout_steps=1, interval_steps=2, apply_lag_steps=2
    )
    initial = CostModel(1e-3, 1.0, "flops")
    schedule = CostModelSchedule(initial, cfg)
    fitter = OnlineFitter(schedule)
    rng = np.random.default_rng(4)
    got: dict[int, CostModel] = {}

    def node():  # the packing node, running ahead in its own thread
        for step in range(1, 12):
            got[step] = schedule.model_for_step(step)

    reader = threading.Thread(target=node)
    reader.start()
    truth = Coefficients(a=5e-9, b=1e-6, c=1e-3)
    records = {}
    for step in range(1, 12):
        sq, lin = _micro_batches(rng, 8)
        vec = FitStats.from_samples(sq, lin, truth.predict(sq, lin)).to_vector()
        records[step] = fitter.observe(step, vec)
    reader.join(timeout=30)
    assert not reader.is_alive()
    # 8 rows a step, 3 coefficients seen (no gathered tokens): the fitted steps never hold 8 rows
    # per coefficient before the window is full (step 5).
    assert [s for s, r in records.items() if r is not None] == [5, 7, 9, 11]
    assert records[5]["adopted"] and records[5]["effective_step"] == 7
    assert all(got[s] is initial for s in range(1, 7))
    adopted = got[7]
    assert adopted.unit == "seconds"
    np.testing.assert_allclose([adopted.attn_coef, adopted.linear_coef], [5e-9, 1e-6], rtol=0.02)

    # A restored fitter (as from a checkpoint after step 6) answers the same for every step.
    again = OnlineFitter(CostModelSchedule(initial, cfg))
    state = fitter.state_dict()
    again.load_state_dict(state)
    for step in range(1, 12):
        assert again.schedule.model_for_step(step) == got[step]


class _AsleepCondition(threading.Condition):
    """A condition whose ``asleep`` event is set each time a waiter goes to sleep on it (with its
    lock held, so a caller that then takes the lock knows the waiter is asleep)."""

    def __init__(self) -> None:
        super().__init__()
        self.asleep = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.asleep.set()
        return super().wait(timeout)


def test_a_decision_held_back_reaches_the_node_only_when_released():
    """The trainer decides at a step's end and releases at the next step's forward: until then
    the node waits, whatever was decided; a restored schedule has released what it decided."""
    cfg = OnlineFitConfig(
        warmup_steps=1, window_steps=4, holdout_steps=1, interval_steps=2, apply_lag_steps=2
    )
    initial, fitted = CostModel(1e-3, 1.0, "flops"), CostModel(2e-3, 1.0, "seconds")
    schedule = CostModelSchedule(initial, cfg)
    schedule._cond = cond = _AsleepCondition()
    got: list[CostModel] = []

    def node_packs():
        try:
            got.append(schedule.model_for_step(5))  # needs step 3 decided and released
        finally:
            cond.asleep.set()  # a node that returns ends the test's wait as well

    node = threading.Thread(target=node_packs)
    node.start()
    assert cond.asleep.wait(timeout=30) and not got, "the node did not wait"
    assert schedule.decide(2, None, release=False) == 4
    assert schedule.decide(3, fitted, release=False) == 5
    with cond:  # wake the node: it looks at the decisions and, nothing released, waits again
        cond.asleep.clear()
        cond.notify_all()
    assert cond.asleep.wait(timeout=30)
    assert node.is_alive() and not got  # decided through step 3, nothing released
    schedule.release()
    node.join(timeout=30)
    assert not node.is_alive() and got == [fitted]
    again = CostModelSchedule(initial, cfg)
    again.restore([(5, fitted)], decided_through=3)
    assert again.model_for_step(5) is fitted  # would wait for ever were it not released


def test_with_a_lag_of_one_step_a_decision_reaches_the_node_at_once():
    """apply_lag_steps = 1: step s + 1 is packed from step s's decision, and its first
    micro-batch is fetched before its forward, where a held-back decision would be released: the
    node gets it at once (a run with lag 1 waited for ever after its first step)."""
    cfg = OnlineFitConfig(
        warmup_steps=1, window_steps=4, holdout_steps=1, interval_steps=2, apply_lag_steps=1
    )
    initial, fitted = CostModel(1e-3, 1.0, "flops"), CostModel(2e-3, 1.0, "seconds")
    schedule = CostModelSchedule(initial, cfg)
    assert schedule.decide(1, None, release=False) == 2
    assert schedule.decide(2, fitted, release=False) == 3
    got: list[CostModel] = []
    node = threading.Thread(target=lambda: got.append(schedule.model_for_step(3)), daemon=True)
    node.start()
    node.join(timeout=30)
    assert not node.is_alive() and got == [fitted]


def test_first_refit_comes_once_the_fitted_steps_hold_enough_rows():
    # 20 micro-batch rows a step (e.g. 10 micro-batches on 2 CP ranks), 3 coefficients seen: the
    # fitted part holds 8 rows per coefficient after 2 steps past the warm-up, so the first refit
    # follows step 2 + 2 + 1 = 5 (not the full window's 2 + 8 = 10), then every 3 steps; a fitter
    # restored from any step's checkpoint keeps the same refit steps.
    from torchtitan_wlb.cost_fit import FIRST_FIT_ROWS_PER_TERM

    assert FIRST_FIT_ROWS_PER_TERM == 8
    cfg = OnlineFitConfig(
        warmup_steps=2, window_steps=8, holdout_steps=1, interval_steps=3, apply_lag_steps=2
    )
    # The rows needed scale with the coefficients the window can see: 24 for a, b, c; 32 once
    # gathered tokens (CP) add g.
    assert cfg.is_refit_step(5, None, 24, terms=3) and not cfg.is_refit_step(5, None, 24, terms=4)
    assert cfg.is_refit_step(5, None, 32, terms=4) and not cfg.is_refit_step(3, None, 99, terms=3)
    truth = Coefficients(a=5e-9, b=1e-6, c=1e-3)
    rng = np.random.default_rng(7)
    vectors = []
    for _ in range(16):
        sq, lin = _micro_batches(rng, 20)
        vectors.append(FitStats.from_samples(sq, lin, truth.predict(sq, lin)).to_vector())

    def refits(fitter, steps):
        return [s for s in steps if fitter.observe(s, vectors[s - 1]) is not None]

    initial = CostModel(1e-3, 1.0, "flops")
    fitter = OnlineFitter(CostModelSchedule(initial, cfg))
    assert refits(fitter, range(1, 17)) == [5, 8, 11, 14]
    assert fitter.first_adopted == 5
    for cut in (3, 5, 6):
        before = OnlineFitter(CostModelSchedule(initial, cfg))
        refits(before, range(1, cut + 1))
        again = OnlineFitter(CostModelSchedule(initial, cfg))
        again.load_state_dict(before.state_dict())
        assert refits(again, range(cut + 1, 17)) == [s for s in (5, 8, 11, 14) if s > cut]


def test_a_rejected_first_refit_is_tried_again_every_step_until_the_window_is_full():
    """The initial model is a guess: until a refit is adopted, every step refits with one more
    step of rows; if none is adopted while the window fills, refits follow every interval_steps
    from the full window. Here every micro-batch is the same (timing noise only), so each refit
    is rejected as degenerate."""
    cfg = OnlineFitConfig(
        warmup_steps=2, window_steps=8, holdout_steps=1, interval_steps=3, apply_lag_steps=2
    )
    tried = [s for s in range(1, 20) if cfg.is_refit_step(s, None, 99)]
    assert tried == [*range(4, 11), 13, 16, 19]
    initial = CostModel(1e-3, 1.0, "flops")
    rng = np.random.default_rng(3)
    fitter = OnlineFitter(CostModelSchedule(initial, cfg))
    records = {}
    sq, lin = np.full(20, 1024.0**2), np.full(20, 1024.0)
    for step in range(1, 17):
        noisy = 0.01 * rng.normal(1.0, 0.05, sq.size)
        records[step] = fitter.observe(step, FitStats.from_samples(sq, lin, noisy).to_vector())
    done = {s: r for s, r in records.items() if r is not None}
    assert list(done) == [5, 6, 7, 8, 9, 10, 13, 16]
    assert all("degenerate" in r["reason"] for r in done.values())
    assert not any(r["adopted"] for r in done.values()) and fitter.first_adopted is None
    assert all(fitter.schedule.model_for_step(s) is initial for s in range(1, 19))


def test_cp_fit_features_split_each_ranks_tokens_by_sharding():
    """Under CP the fit reads what each rank runs: split documents' tokens are gathered, hybrid's
    whole ones local; over the ranks the terms add up to the micro-batch's Σd² and tokens."""
    from torchtitan_wlb.cp.adaptive import build_cp_plan
    from torchtitan_wlb.online_fit import cp_fit_features

    lens = np.array([900, 40, 30, 20, 10, 24], np.int64)
    for strategy in ("per_sequence", "per_document", "hybrid"):
        plan = build_cp_plan(lens, 2, strategy, hybrid_max_len=64)
        sq, local, gathered = np.array([cp_fit_features(plan, r) for r in range(2)]).T
        assert sq.sum() == pytest.approx(float(lens @ lens))
        assert local.sum() + gathered.sum() == lens.sum()
        assert (local.sum() > 0) == (strategy == "hybrid"), strategy
        assert local.sum() == (lens[1:].sum() if strategy == "hybrid" else 0)


def test_offline_fits_take_every_row_and_may_leave_out_the_fixed_cost():
    """The simulator's calibration and the imbalance report fit with the same function, without
    the online model's checks: a handful of exact rows is fitted as it is, and so are terms that
    move together (their share split by the least-norm solution, the predictions exact)."""
    sq, lin = np.array([1e5, 2.5e3, 1.6e5]), np.array([400.0, 50.0, 400.0])
    t = TRUE.predict(sq, lin)
    stats = FitStats.from_samples(sq, lin, t)
    coef, why = fit_nnls(stats)
    assert coef is None and "too few micro-batches" in why
    coef, why = fit_nnls(stats, online_checks=False)
    assert why == ""
    np.testing.assert_allclose(coef[[0, 1, 3]], [TRUE.a, TRUE.b, TRUE.c], rtol=1e-6)
    # Without the constant: c is 0 and the per-token costs absorb it.
    coef, why = fit_nnls(stats, constant=False, online_checks=False)
    assert why == "" and coef[3] == 0.0 and coef[0] + coef[1] > 0
    # Gathered tokens a fixed share of Σd² (collinear): rejected online, fitted offline.
    sq = np.array([1e5, 2e5, 3e5, 4e5, 5e5])
    gathered, local = 190.0 + sq * 1e-4, np.array([100.0, 150.0, 100.0, 150.0, 100.0])
    truth = Coefficients(a=1e-7, b=1e-5, c=1e-3, g=3e-5)
    t = truth.predict(sq, local, gathered)
    stats = FitStats.from_samples(sq, local, t, gathered)
    assert "degenerate" in fit_nnls(stats)[1]
    coef, why = fit_nnls(stats, online_checks=False)
    assert why == "" and np.all(coef >= 0)
    fitted = Coefficients(coef[0], coef[1], coef[3], g=coef[2]).predict(sq, local, gathered)
    np.testing.assert_allclose(fitted, t, rtol=1e-9)
