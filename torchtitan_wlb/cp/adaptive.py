"""Choosing a micro-batch's CP sharding: a fixed strategy, or adaptive selection by predicted time
(docs/context_parallel.md). It sits above both the plan and the profile, so neither needs the other.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from torchtitan_wlb.cp.plan import (
    FIXED_STRATEGIES,
    CPPlan,
    ShardingDraft,
    causal_pairs,
    draft_sharding,
    validate_doc_lens,
)
from torchtitan_wlb.cp.profile import CPProfile, resolve_profile

STRATEGIES = (*FIXED_STRATEGIES, "adaptive")
ADAPTIVE_CANDIDATES = FIXED_STRATEGIES
"""The fixed strategies adaptive selection chooses among (ties keep the earlier one)."""

DEFAULT_CP_BANDWIDTH_GBPS = 50.0
"""Default per-GPU bandwidth of the CP collectives, GB/s (``[wlb] cp_bandwidth_gbps``): one 400 Gb/s
NIC per GPU, what a CP group crosses when TP fills each node (docs/context_parallel.md)."""


def adaptive_candidates(sequence_parallel: bool) -> tuple[str, ...]:
    """The candidates of ``"adaptive"``: without hybrid under sequence-parallel TP, which needs
    local lengths equal across CP ranks and hybrid does not guarantee them."""
    return tuple(c for c in ADAPTIVE_CANDIDATES if not (sequence_parallel and c == "hybrid"))


_TRANSFERS_PER_LAYER = 3.0  # forward all-gather + backward re-gather + dK/dV reduce-scatter


def _dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``"bfloat16"`` -> 2, ``"float32"`` -> 4)."""
    match = re.search(r"(\d+)$", dtype)
    if match is None:
        raise ValueError(f"profile dtype {dtype!r} does not end in its bit width (e.g. 'bfloat16')")
    return max(1, int(match.group(1)) // 8)


def predicted_seconds(
    draft: ShardingDraft, profile: CPProfile, bandwidth_gbps: float
) -> tuple[float, float]:
    """``(compute, communication)`` seconds of one layer's attention under ``draft``: the slowest
    rank's forward + backward from ``profile``, and 3 x its gathered K/V over ``bandwidth_gbps``."""
    compute = float(draft.rank_totals(profile.segment_seconds(draft.q_len, draft.kv_len)).max())
    gathered = draft.kv_gather_bytes(
        profile.n_kv_heads, profile.head_dim, _dtype_bytes(profile.dtype)
    )
    return compute, _TRANSFERS_PER_LAYER * gathered / (bandwidth_gbps * 1e9)


def _numbers(values: object) -> bool:
    """Whether ``values`` is a sequence of real numbers (bools excluded)."""
    if not isinstance(values, (tuple, list)):
        return False
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def fitted_seconds(draft: ShardingDraft, coefficients: tuple[float, float, float]) -> float:
    """The slowest rank's time under ``draft`` by the online fit's per-rank model ``(a, b, g)``:
    ``a * Σd² * (its share of the attention pairs) + b * local tokens + g * gathered tokens`` (the
    trainer's fit features, docs/cost_model.md; the fixed cost per micro-batch is the same for
    every candidate and left out)."""
    a, b, g = coefficients
    q_len = draft.q_len
    pairs = draft.rank_totals(causal_pairs(q_len, draft.kv_len))
    tokens = draft.rank_totals(q_len)
    gathered = tokens
    if draft.strategy == "hybrid":
        gathered = draft.rank_totals(np.where(draft.doc_gathered[draft.table[0]], q_len, 0))
    d = draft.doc_lens.astype(np.float64)
    share = pairs / max(float(pairs.sum()), 1.0)
    return float((a * float(d @ d) * share + b * (tokens - gathered) + g * gathered).max())


def build_cp_plan(
    doc_lens: np.ndarray,
    cp_degree: int,
    strategy: str = "per_document",
    profile: CPProfile | str | Path | None = None,
    *,
    seq_len: int | None = None,
    hybrid_max_len: int = 0,
    bandwidth_gbps: float = DEFAULT_CP_BANDWIDTH_GBPS,
    candidates: tuple[str, ...] = ADAPTIVE_CANDIDATES,
    coefficients: tuple[float, float, float] | None = None,
) -> CPPlan:
    """The CP plan of one packed micro-batch of ``doc_lens`` by ``strategy`` (``[wlb] cp_*``
    fields). ``"adaptive"`` picks among ``candidates`` by their predicted seconds on ``profile``
    (None: the packaged CPU table), or, given the online fit's per-rank ``coefficients`` ``(a,
    b, g)``, by :func:`fitted_seconds` (the machine's measured costs, linear layers and gathers
    included); kept in the plan's ``estimated_seconds``; ties: the earlier. Hybrid plans, chosen
    or fixed, balance the ranks by ``coefficients`` when given (:func:`draft_sharding`)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"CP strategy {strategy!r} is not one of {STRATEGIES}")
    lens = validate_doc_lens(doc_lens, cp_degree, seq_len)
    if coefficients is not None:
        coef = np.asarray(coefficients, dtype=np.float64) if _numbers(coefficients) else None
        if coef is None or coef.shape != (3,) or not np.all(np.isfinite(coef) & (coef >= 0)):
            raise ValueError(
                f"coefficients must be three finite numbers >= 0, (a, b, g) in seconds; got "
                f"{coefficients!r}"
            )
    if strategy != "adaptive":
        fixed = draft_sharding(
            lens, cp_degree, strategy, max_len=hybrid_max_len, costs=coefficients
        )
        return fixed.plan()
    if isinstance(bandwidth_gbps, bool) or not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth_gbps must be a number > 0 (GB/s); got {bandwidth_gbps!r}")
    if not candidates or any(name not in FIXED_STRATEGIES for name in candidates):
        raise ValueError(f"adaptive candidates {candidates!r} must be among {FIXED_STRATEGIES}")
    drafts = {
        name: draft_sharding(lens, cp_degree, name, max_len=hybrid_max_len, costs=coefficients)
        for name in candidates
    }
    if coefficients is not None:
        estimates = {name: fitted_seconds(d, coefficients) for name, d in drafts.items()}
    else:
        table = resolve_profile(profile)
        estimates = {
            name: sum(predicted_seconds(d, table, bandwidth_gbps)) for name, d in drafts.items()
        }
    chosen = drafts[min(estimates, key=estimates.get)].plan(requested=strategy)
    chosen.estimated_seconds.update(estimates)
    return chosen
