"""One CP rank's local attention on random tensors, as a whole and call by call.

``cp_bench --measure`` times each rank's local attention (its head half, tail half and whole
documents: three varlen calls); ``--call-breakdown`` also times every call alone beside the
attention table's prediction for its segments, to show where measured and predicted part: which
strategy, which call, what shape of call (segments, key rows, longest key segment).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torchtitan_wlb.cp.plan import CPPlan
    from torchtitan_wlb.cp.profile import CPProfile


def elapsed_ms(step: Callable[[], object], sync: Callable[[], None] | None) -> float:
    """One call of ``step`` in ms: this process's CPU time (``sync`` None), else wall time between
    device synchronisations (kernels run asynchronously)."""
    if sync is None:
        start = time.process_time()
        step()
        return (time.process_time() - start) * 1e3
    sync()
    start = time.perf_counter()
    step()
    sync()
    return (time.perf_counter() - start) * 1e3


def rank_tensors(
    plan: CPPlan, rank: int, heads: int, kv_heads: int, head_dim: int, device: str, dtype: str
) -> tuple[list, tuple, list[int], object]:
    """``rank``'s random q, gathered K/V and whole-document K/V (leaves), the op's index tensors
    and sizes, and a random output gradient: the inputs of its local attention."""
    import torch

    from torchtitan_wlb.cp.op import op_arguments

    s = plan.local_attention_spec(rank)
    n_local, n_gather = int(plan.local_lens[rank]), s.n_gather_tokens
    dev = torch.device(device)
    gen = torch.Generator(dev).manual_seed(rank)
    like = {"generator": gen, "device": dev, "dtype": getattr(torch, dtype)}
    gathered, whole = (plan.gathered_len, kv_heads), (n_local - n_gather, kv_heads)
    tensors = [
        torch.randn(n, h, head_dim, **like, requires_grad=True)
        for n, h in ((n_local, heads), gathered, gathered, whole, whole)
    ]
    cus, sizes = op_arguments(s, plan.max_gather_len)
    cus = tuple(torch.from_numpy(cu).to(dev) for cu in cus)
    return tensors, cus, sizes, torch.randn(n_local, heads, head_dim, **like)


def part_segments(plan: CPPlan, rank: int) -> list[np.ndarray]:
    """Segment ids of ``rank``'s three calls (``cp.op.PARTS``): gathered segments of its head
    slot, of its tail slot, and its whole (not gathered) documents."""
    gathered = plan.doc_gathered[plan.seg_doc] & (plan.seg_len > 0)
    tail_slot = 2 * plan.cp_degree - 1 - rank
    mine = (plan.seg_slot == rank) | (plan.seg_slot == tail_slot)
    return [
        np.flatnonzero(gathered & (plan.seg_slot == rank)),
        np.flatnonzero(gathered & (plan.seg_slot == tail_slot)),
        np.flatnonzero(mine & ~gathered & (plan.seg_len > 0)),
    ]


def _part_step(tensors: list, cus: tuple, sizes: list[int], grad, part: int, backend: str):
    """A closure running call ``part`` of the local attention forward + backward (as
    ``cp_bench``'s whole-rank step does: ``.sum().backward()`` on CPU, else against ``grad``);
    None when the call has no queries."""
    import torch

    from torchtitan_wlb.attention import document_attention
    from torchtitan_wlb.cp.op import local_parts

    args = local_parts(*tensors, cus, sizes)[part]
    if args[0].shape[0] == 0:
        return None
    start = (0, sizes[0], sizes[6])[part]  # the call's first local query row
    g = grad[start : start + args[0].shape[0]]

    def forward() -> torch.Tensor:
        return document_attention(*args, scale=tensors[0].shape[-1] ** -0.5, backend=backend)

    if tensors[0].device.type == "cpu":
        return lambda: forward().sum().backward()
    return lambda: torch.autograd.grad(forward(), tensors, g, allow_unused=True)


def _call_rows(plan: CPPlan, rank: int, profile: CPProfile, ms: list[float | None]) -> list[dict]:
    """One row per call of ``rank`` that has queries: its shape, measured and predicted ms."""
    from torchtitan_wlb.cp.op import PARTS

    spec = plan.local_attention_spec(rank)
    rows = []
    for part, (name, ids) in enumerate(zip(PARTS, part_segments(plan, rank), strict=True)):
        if ms[part] is None:
            continue
        seg_len, kv_len = plan.seg_len[ids], plan.seg_start[ids] + plan.seg_len[ids]
        if part < 2:
            a, b = spec.key_window[part]
            key_rows, max_k = b - a, spec.max_seqlen_k[part]
        else:
            key_rows, max_k = int(seg_len.sum()), spec.max_seqlen_whole
        rows.append(
            {
                "rank": rank,
                "part": name,
                "segments": len(ids),
                "q_tokens": int(seg_len.sum()),
                "key_rows": int(key_rows),
                "max_seqlen_k": int(max_k),
                "measured_ms": ms[part],
                "predicted_ms": float(profile.segment_seconds(seg_len, kv_len).sum() * 1e3),
            }
        )
    return rows


def call_breakdown(
    plans: dict[str, list[CPPlan]],
    profile: CPProfile,
    shape: tuple[int, int, int],
    repeats: int,
    device: str,
    dtype: str,
    backend: str,
) -> dict:
    """Every call of every rank of ``plans`` (per strategy, the measured micro-batches) timed
    alone (``repeats`` rounds after a warm-up: median on CUDA, fastest on CPU, as the
    whole-rank figures) beside its prediction; ``summary``: per strategy and call, the sums of
    measured and predicted ms and their ratio."""
    import torch

    cuda = torch.device(device).type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else None
    rows = []
    for strategy, strategy_plans in plans.items():
        for i, plan in enumerate(strategy_plans):
            for rank in range(plan.cp_degree):
                tensors, cus, sizes, grad = rank_tensors(plan, rank, *shape, device, dtype)
                ms: list[float | None] = []
                for part in range(3):
                    step = _part_step(tensors, cus, sizes, grad, part, backend)
                    if step is not None:
                        step()  # warm-up
                        times = [elapsed_ms(step, sync) for _ in range(repeats)]
                    ms.append(
                        None if step is None else float(np.median(times) if cuda else min(times))
                    )
                rows += [
                    {"strategy": strategy, "micro_batch": i} | row
                    for row in _call_rows(plan, rank, profile, ms)
                ]
    return {"calls": rows, "summary": _summary(rows)}


def _summary(rows: list[dict]) -> dict:
    """``{strategy: {part: {measured_ms, predicted_ms, measured_over_predicted, calls}}}``."""
    out: dict = {}
    for row in rows:
        entry = out.setdefault(row["strategy"], {}).setdefault(
            row["part"], {"measured_ms": 0.0, "predicted_ms": 0.0, "calls": 0}
        )
        entry["measured_ms"] += row["measured_ms"]
        entry["predicted_ms"] += row["predicted_ms"]
        entry["calls"] += 1
    for parts in out.values():
        for entry in parts.values():
            entry["measured_over_predicted"] = entry["measured_ms"] / max(
                entry["predicted_ms"], 1e-12
            )
    return out
