"""The simulator's hybrid CP: segments and gathered K/V from the planner, and the modes using it."""

from __future__ import annotations

import numpy as np
import pytest

from torchtitan_wlb.cp import build_cp_plan
from torchtitan_wlb.models.catalogue import get_model
from torchtitan_wlb.sim.config import MODES, SimConfig
from torchtitan_wlb.sim.engine import cp_shards, shard_costs, simulate_mode
from torchtitan_wlb.sim.hardware import Layout

CFG = SimConfig(
    model=get_model("550M"),
    layout=Layout(tp=1, cp=2, pp=2, dp=1),
    context_len=8192,
    steps=3,
    warmup_steps=0,
)
MBS = [np.array([3000, 40, 700, 5, 1200, 90]), np.array([200] * 20), np.array([8000])]


def test_hybrid_shards_gather_only_split_documents():
    shards = cp_shards(MBS, CFG, "hybrid")
    doc = cp_shards(MBS, CFG, "per_document")
    for i, lens in enumerate(MBS):
        plan = build_cp_plan(lens, 2, "hybrid")
        assert shards.gathered_tokens[i] == plan.gathered_len
        assert doc.gathered_tokens[i] == lens.sum()  # per-document gathers the micro-batch
    assert shards.gathered_tokens[1] == 0 and shards.chose_hybrid.all()
    # The same work either way; the CP all-gather moves only the gathered tokens' K/V.
    np.testing.assert_array_equal(shards.local_tokens.sum(axis=1), doc.local_tokens.sum(axis=1))
    hybrid_comm, doc_comm = shard_costs(shards, CFG).comm_fwd, shard_costs(doc, CFG).comm_fwd
    assert hybrid_comm[1] < doc_comm[1] and hybrid_comm[2] == pytest.approx(doc_comm[2])


def test_hybrid_modes_simulate_and_report_their_share():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300), 0.8, 1500), 1, 8192).astype(np.int64)
    fixed = simulate_mode(MODES["hybrid_cp"], lengths, CFG)
    assert fixed.hybrid_share == 1.0 and fixed.summary()["cp_strategy"] == "hybrid"
    paper = simulate_mode(MODES["adaptive_cp"], lengths, CFG)
    assert paper.hybrid_share == 0.0  # the paper's adaptive chooses between its two
    wlb = simulate_mode(MODES["wlb_hybrid"], lengths, CFG)
    assert 0.0 < wlb.hybrid_share <= 1.0 and np.all(wlb.step_time_s > 0)
