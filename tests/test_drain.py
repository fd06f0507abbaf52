"""The end of the data: balanced drain of held documents, and filler micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchtitan.components.loss import IGNORE_INDEX

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.data.collate import collate_micro_batch
from torchtitan_wlb.packing import PackingConfig, build_packer
from torchtitan_wlb.packing.end_of_data import plan_drain

COST = CostModel.from_coefficients(attn_coef=1.0 / 32, linear_coef=1.0)
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@SETTINGS
@given(
    lens=st.lists(st.integers(1, 80), min_size=1, max_size=200).map(np.asarray),
    n=st.integers(1, 6),
)
def test_drain_places_every_document_once_under_the_cap(lens, n):
    cap = 80
    plan = plan_drain(COST.doc_cost(lens), lens, n, cap)
    assert plan.step.min() == 0 and plan.step.max() == plan.steps - 1
    assert ((plan.micro_batch >= 0) & (plan.micro_batch < n)).all()
    slot = plan.step * n + plan.micro_batch
    tokens = np.bincount(slot, weights=lens, minlength=plan.steps * n)
    assert tokens.max() <= cap
    loads = np.bincount(slot, weights=COST.doc_cost(lens), minlength=plan.steps * n)
    per_step_max = loads.reshape(plan.steps, n).max(axis=1)
    assert plan.predicted_time == pytest.approx(per_step_max.sum())
    # The first step is the heaviest: it is emitted first, the rest is planned again.
    assert per_step_max[0] == pytest.approx(per_step_max.max())


def test_drain_groups_long_documents_and_fills_beside_them():
    # Four long documents and many short ones, N = 4: one step of the four long ones, each
    # beside nothing but each other, is the balanced drain; the short ones make their own step.
    lens = np.array([60] * 4 + [4] * 40)
    plan = plan_drain(COST.doc_cost(lens), lens, 4, 100)
    long_steps = plan.step[:4]
    assert np.unique(long_steps).size == 1
    assert np.unique(plan.micro_batch[:4]).size == 4
    slot = plan.step * 4 + plan.micro_batch
    loads = np.bincount(slot, weights=COST.doc_cost(lens), minlength=plan.steps * 4)
    per_step = loads.reshape(plan.steps, 4)
    assert (per_step.max(axis=1) / per_step.mean(axis=1)).max() < 1.15


def test_drain_of_nothing_and_of_one_document():
    empty = plan_drain(np.zeros(0), np.zeros(0, np.int64), 4, 10)
    assert empty.steps == 0 and empty.step.size == 0
    one = plan_drain(np.array([5.0]), np.array([3]), 4, 10)
    assert one.steps == 1 and one.step.tolist() == [0]


def _run_to_end(packer, lens):
    """Feed everything at once as the last pull, then flush until nothing is held."""
    ids = np.arange(lens.size)
    plans = [packer.step(ids, lens, flush=True)]
    while packer.has_pending():
        plans.append(packer.step(np.zeros(0, np.int64), np.zeros(0, np.int64), flush=True))
        assert len(plans) < 1000
    return plans


@pytest.mark.parametrize("seed", [0, 1])
def test_wlb_drains_a_full_queue_over_balanced_steps_not_at_once(seed):
    # Outliers wait in the queue (long max wait, strict release), so that ~20 of them are held
    # when the data ends; released together they would make the final steps 1.3-2x unbalanced.
    cfg = PackingConfig(
        micro_batches=4,
        context_len=64,
        queue_thresholds=(40,),
        max_wait=50,
        adaptive_max_wait=0,
        balance_target=1.0001,
        release_slack=0.0,
    )
    packer = build_packer("wlb", cfg, COST)
    rng = np.random.default_rng(seed)
    lens = np.where(rng.random(600) < 0.06, rng.integers(48, 80, 600), rng.integers(1, 9, 600))
    ids = np.arange(lens.size)
    pos, plans = 0, []
    while pos < lens.size:
        budget = packer.tokens_wanted()
        end = min(lens.size, int(np.searchsorted(np.cumsum(lens[pos:]), budget)) + 1 + pos)
        plans.append(packer.step(ids[pos:end], lens[pos:end], flush=end >= lens.size))
        pos = end
    last_pull = len(plans) - 1
    assert sum(packer.queue_depths()) >= 15
    while packer.has_pending():
        plans.append(packer.step(np.zeros(0, np.int64), np.zeros(0, np.int64), flush=True))
    emitted = np.sort(np.concatenate([np.concatenate(p.doc_ids) for p in plans]))
    assert np.array_equal(emitted, ids)
    assert all(p.stats["tokens"] > 0 for p in plans)
    assert max(p.stats["max_tokens"] for p in plans) <= packer.cap
    # The drain (every step from the last pull on, but the final one, which holds what is left
    # over) is balanced as a whole: its time is close to its work spread over N.
    drain = plans[last_pull:-1]
    time_weighted = sum(p.stats["max_workload"] for p in drain) / sum(
        p.stats["mean_workload"] for p in drain
    )
    assert time_weighted < 1.1


@pytest.mark.parametrize("name", ["original", "fixed_greedy", "wlb", "wlb_paper"])
@pytest.mark.parametrize("lens", [[5], [3, 7], [64, 64, 64]], ids=["one", "two", "long"])
def test_fewer_documents_than_micro_batches_end_cleanly(name, lens):
    lens = np.asarray(lens, np.int64)
    smax = 64 if name in ("original", "fixed_greedy") else None
    cfg = PackingConfig(micro_batches=4, context_len=64, smax=smax)
    plans = _run_to_end(build_packer(name, cfg, COST), lens)
    emitted = np.sort(np.concatenate([np.concatenate(p.doc_ids) for p in plans]))
    assert np.array_equal(emitted, np.arange(lens.size))
    for p in plans:
        assert len(p.doc_ids) == 4
        assert p.stats["tokens"] > 0  # no step is made of fillers only


def test_filler_micro_batch_trains_nothing():
    input_dict, labels = collate_micro_batch(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert input_dict["input"].shape == (1, 1)
    assert input_dict["doc_lens"].tolist() == [1]
    assert labels.tolist() == [[IGNORE_INDEX]]
    assert (labels != IGNORE_INDEX).sum() == 0
    logits = torch.randn(1, 1, 11, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    loss.backward()
    assert loss.item() == 0 and logits.grad.abs().sum() == 0


def test_malformed_micro_batch_still_rejected():
    with pytest.raises(ValueError, match="do not describe"):
        collate_micro_batch(np.zeros(3, np.int64), np.zeros(0, np.int64))
