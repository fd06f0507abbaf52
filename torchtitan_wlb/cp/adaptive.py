"""Choosing a micro-batch's CP sharding: a fixed strategy, or adaptive selection by estimated latency.

``adaptive`` drafts per-sequence and per-document sharding (:mod:`torchtitan_wlb.cp.plan`; the
``hybrid`` plan is available as a fixed strategy), estimates the slowest
rank of each with the measured throughput table (:mod:`torchtitan_wlb.cp.profile`) and keeps the
faster one: per-document chunks are small and run at a lower achieved throughput, which can outweigh
their better balance. Only the winner's local layout is built.

This module sits above both the plan (pure index arithmetic) and the profile (a measured table), so
that neither depends on the other's concerns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from torchtitan_wlb.cp.plan import FIXED_STRATEGIES, CPPlan, draft_sharding, validate_doc_lens
from torchtitan_wlb.cp.profile import CPProfile, resolve_profile

__all__ = ["ADAPTIVE_CANDIDATES", "STRATEGIES", "build_cp_plan"]

STRATEGIES = (*FIXED_STRATEGIES, "adaptive")
ADAPTIVE_CANDIDATES = ("per_sequence", "per_document")
"""The fixed strategies adaptive selection chooses between."""


def build_cp_plan(
    doc_lens: np.ndarray,
    cp_degree: int,
    strategy: str = "per_document",
    profile: CPProfile | str | Path | None = None,
    *,
    seq_len: int | None = None,
    hybrid_max_len: int = 0,
) -> CPPlan:
    """Plan the CP split of one packed micro-batch (``[wlb] cp_sharding``).

    Args:
        doc_lens: 1-D document lengths (each >= 1), in packed order.
        cp_degree: CP ranks ``c`` (``1 <= c <= sum(doc_lens)``).
        strategy: ``"per_sequence" | "per_document" | "hybrid" | "adaptive"``.
        profile: throughput table for ``"adaptive"`` (a :class:`CPProfile` or a JSON path);
            ``None`` loads the packaged CPU default.
        seq_len: if given, the packed length the lengths must sum to.
        hybrid_max_len: ``"hybrid"``'s whole-document threshold in tokens (``[wlb]
            cp_hybrid_max_len``); 0: ``2 * cp_degree * 128`` (``plan.default_hybrid_max_len``).

    With ``"adaptive"`` the plan records ``requested="adaptive"`` and both estimates in
    ``estimated_seconds``; a tie keeps per-sequence.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"CP strategy {strategy!r} is not one of {STRATEGIES}")
    lens = validate_doc_lens(doc_lens, cp_degree, seq_len)
    if strategy != "adaptive":
        return draft_sharding(lens, cp_degree, strategy, max_len=hybrid_max_len).plan()
    table = resolve_profile(profile)
    drafts = {name: draft_sharding(lens, cp_degree, name) for name in ADAPTIVE_CANDIDATES}
    estimates = {
        name: float(draft.rank_totals(table.segment_seconds(draft.q_len, draft.kv_len)).max())
        for name, draft in drafts.items()
    }
    best = (
        "per_document" if estimates["per_document"] < estimates["per_sequence"] else "per_sequence"
    )
    chosen = drafts[best].plan(requested=strategy)
    chosen.estimated_seconds.update(estimates)
    return chosen
