"""The packing node's token store: documents held by id in sorted arrays (any id order), and the
node over a source whose ids do not grow: same plans as the in-memory driver, exact resume."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from torchdata.nodes import IterableWrapper

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.data.token_store import TokenStore
from torchtitan_wlb.data.wlb_node import WLBPackingNode
from torchtitan_wlb.packing import LengthStream, PackingConfig, build_packer, drive

CTX = 64
COST = CostModel.from_coefficients(attn_coef=1.0 / 32, linear_coef=1.0)


def _arrays(ids):
    return [np.full(3, i, np.int32) for i in ids.tolist()]


def test_take_returns_the_stored_arrays_and_pulls_in_the_asked_order():
    store = TokenStore()
    first = np.array([10, 11, 12], np.int64)  # growing ids: appended
    a1 = _arrays(first)
    store.put(first, a1, pull=0)
    second = np.array([5, 30, 7, 13], np.int64)  # below the held ones, unordered: merged
    a2 = _arrays(second)
    store.put(second, a2, pull=1)
    assert store.ids.tolist() == [5, 7, 10, 11, 12, 13, 30]
    tokens, pulls = store.take(np.array([13, 10, 5], np.int64))
    assert all(t is a for t, a in zip(tokens, [a2[3], a1[0], a2[0]], strict=True))
    assert pulls.tolist() == [1, 0, 1]
    assert store.ids.tolist() == [7, 11, 12, 30] and len(store) == 4
    tokens, pulls = store.take(np.array([30, 7, 12, 11], np.int64))
    assert [int(t[0]) for t in tokens] == [30, 7, 12, 11] and pulls.tolist() == [1, 1, 0, 0]
    assert len(store) == 0
    assert store.take(np.zeros(0, np.int64))[0].size == 0


@pytest.mark.parametrize(
    "held, new, twice",
    [
        ([], [4, 9, 4], 4),  # repeated within one pull
        ([3, 8], [9, 8, 1], 8),  # already held (new ids not above the held ones)
        ([3, 8], [2, 3], 3),
    ],
)
def test_repeated_id_is_an_error_naming_it(held, new, twice):
    store = TokenStore()
    store.put(np.array(held, np.int64), _arrays(np.array(held, np.int64)), pull=0)
    with pytest.raises(ValueError, match=f"document id {twice} appears twice"):
        store.put(np.array(new, np.int64), _arrays(np.array(new, np.int64)), pull=1)
    assert store.ids.tolist() == sorted(held)  # unchanged


def test_taking_a_document_not_held_is_an_error():
    store = TokenStore()
    store.put(np.array([1, 2], np.int64), _arrays(np.array([1, 2])), pull=0)
    with pytest.raises(RuntimeError, match="document 7 was emitted"):
        store.take(np.array([2, 7], np.int64))


def _shuffled_docs(n_docs, seed):
    """Documents in stream order with ids in a random order; tokens encode the id."""
    rng = np.random.default_rng(seed)
    lens = np.where(rng.random(n_docs) < 0.1, rng.integers(30, CTX + 1, n_docs),
                    rng.integers(1, 10, n_docs))  # fmt: skip
    ids = rng.permutation(np.arange(n_docs) * 7 + 3)
    items = [
        {"doc_id": int(i), "tokens": int(i) * 1000 + np.arange(n, dtype=np.int64)}
        for i, n in zip(ids, lens, strict=True)
    ]
    return items, ids, lens


def _node(items):
    config = PackingConfig(micro_batches=4, context_len=CTX, max_wait=3)
    return WLBPackingNode(IterableWrapper(items), build_packer("wlb", config, COST))


def _run(node):
    out = []
    while (step := next(node, None)) is not None:
        out.append(step)
    return out


def test_node_with_unordered_ids_plans_as_the_driver_and_resumes_exactly():
    items, ids, lens = _shuffled_docs(240, 3)
    ref = _run(_node(items))
    packer = _node(items).packer
    plans = list(drive(packer, LengthStream(lens)))
    assert len(ref) == len(plans)
    for step, plan in zip(ref, plans, strict=True):
        for mb, want in zip(step["micro_batches"], plan.doc_ids, strict=True):
            assert mb["doc_ids"].tolist() == ids[want].tolist()
            pairs = zip(mb["doc_ids"], mb["doc_lens"], strict=True)
            expect = [i * 1000 + np.arange(n) for i, n in pairs]
            assert np.array_equal(mb["tokens"], np.concatenate(expect or [np.zeros(0)]))
    for k in (1, len(ref) // 2, len(ref) - 1):
        node = _node(items)
        head = [next(node) for _ in range(k)]
        restored = _node(items)
        restored.reset(pickle.loads(pickle.dumps(node.state_dict())))
        rest = _run(restored)
        assert len(head) + len(rest) == len(ref)
        for got, want in zip(head + rest, ref, strict=True):
            for u, v in zip(got["micro_batches"], want["micro_batches"], strict=True):
                assert np.array_equal(u["tokens"], v["tokens"])
                assert np.array_equal(u["doc_ids"], v["doc_ids"])
