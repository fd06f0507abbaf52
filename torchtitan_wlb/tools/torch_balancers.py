"""torch's own CP load balancers measured by the tokens each rank ends up with (what torch's code
does, not what it is meant to do), beside this project's plans: cp_bench's baselines,
docs/benchmarks_cp.md."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from torchtitan_wlb.cp.plan import ATTENTION_TILE, CPPlan

TORCH_BALANCERS = ("torch_head_tail", "torch_per_document", "torch_ptrr")
SMALL_CHUNK = ATTENTION_TILE  # also flex-attention's default block


@dataclass(frozen=True)
class Assignment:
    """Which CP rank holds each token of a (possibly padded) micro-batch."""

    doc_lens: np.ndarray  # [D] documents as sharded, padding included (a document, or per document)
    real_docs: np.ndarray  # [D] False for a padding-only document
    rank: np.ndarray  # [T] CP rank of every token, in packed order
    cp_degree: int  # CP ranks c
    allgather_rows: int  # K/V rows every rank receives from the other ranks
    plan_ms: float  # time to compute the assignment (see torch_assignment)
    pad_tokens: int = 0  # tokens added to meet the balancer's divisibility rule


def assignment_stats(
    a: Assignment, kv_bytes_per_token: float, small: int = SMALL_CHUNK, short_doc_len: int = 0
) -> dict:
    """FLOPs / token imbalance, K/V bytes received per rank and chunks (runs of a cut document on
    one rank) under ``small`` tokens (``short_doc_len``: hybrid's threshold); docs/benchmarks_cp.md."""
    lens, c = a.doc_lens, a.cp_degree
    doc = np.repeat(np.arange(lens.size), lens)
    pos = np.arange(doc.size) - (np.cumsum(lens) - lens)[doc]  # within its document
    flops = np.bincount(a.rank, weights=pos + 1.0, minlength=c)
    tokens = np.bincount(a.rank, minlength=c).astype(np.float64)
    new_run = np.ones(doc.size, dtype=bool)
    new_run[1:] = (doc[1:] != doc[:-1]) | (a.rank[1:] != a.rank[:-1])
    run_start = np.flatnonzero(new_run)
    run_len = np.diff(np.append(run_start, doc.size))
    run_doc = doc[run_start]
    runs_per_doc = np.bincount(run_doc, minlength=lens.size)
    cut = (runs_per_doc[run_doc] > 1) & a.real_docs[run_doc]
    small_runs = cut & (run_len < small)
    return {
        "flops_imbalance": float(flops.max() / flops.mean()),
        "token_imbalance": float(tokens.max() / tokens.mean()),
        "kv_gather_tokens": int(a.allgather_rows),
        "kv_gather_bytes": float(a.allgather_rows * kv_bytes_per_token),
        "small_chunks": int(small_runs.sum()),
        "small_chunks_short_docs": int((small_runs & (lens[run_doc] <= short_doc_len)).sum()),
        "small_chunk_docs_max_len": int(lens[run_doc[small_runs]].max()) if small_runs.any() else 0,
        "pad_tokens": a.pad_tokens,
        "plan_ms": a.plan_ms,
    }


def ptrr_block_counts(doc_lens: np.ndarray, block: int) -> np.ndarray:
    """``[T / block]`` KV blocks each query block ``i`` touches under a document-causal mask,
    ``i - block(its document's start) + 1``: ``create_block_mask``'s count, without the mask."""
    cu = np.concatenate([[0], np.cumsum(doc_lens)])
    first = np.arange(0, int(cu[-1]), block)
    doc_start = cu[np.searchsorted(cu, first, side="right") - 1]
    return np.arange(first.size) - doc_start // block + 1


def _padded(lens: np.ndarray, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """``lens`` with a padding document making the total a multiple of ``multiple``."""
    pad = -int(lens.sum()) % multiple
    padded = np.append(lens, pad) if pad else lens
    return padded, np.arange(padded.size) < lens.size


def _balancer(name: str, lens: np.ndarray, c: int, block: int):
    """torch's balancer for ``lens``, padded as it requires; returns (balancer, doc_lens, real)."""
    from torch.distributed.tensor.experimental._context_parallel import (
        _HeadTailLoadBalancer,
        _PerDocumentHeadTailLoadBalancer,
        _PTRRLoadBalancer,
    )

    if name == "torch_head_tail":
        lens, real = _padded(lens, 2 * c)
        return _HeadTailLoadBalancer(int(lens.sum()), c, "cpu"), lens, real
    if name == "torch_per_document":
        lens = lens + (-lens % (2 * c))
        lb = _PerDocumentHeadTailLoadBalancer([lens.tolist()], c, "cpu")
        return lb, lens, np.ones(lens.size, dtype=bool)
    if name == "torch_ptrr":
        from torch.nn.attention.flex_attention import BlockMask

        lens, real = _padded(lens, block * c)
        counts = ptrr_block_counts(lens, block)
        n = counts.size
        first = np.arange(n) - counts + 1
        kv_idx = np.minimum(first[:, None] + np.arange(n)[None, :], n - 1)
        mask = BlockMask.from_kv_blocks(
            torch.from_numpy(counts.astype(np.int32)).view(1, 1, n),
            torch.from_numpy(kv_idx.astype(np.int32)).view(1, 1, n, n),
            BLOCK_SIZE=block,
            seq_lengths=(n * block, n * block),
            compute_q_blocks=False,
        )
        return _PTRRLoadBalancer(mask, c), lens, real
    raise ValueError(f"torch load balancer {name!r} is not one of {TORCH_BALANCERS}")


def torch_assignment(
    name: str, doc_lens: np.ndarray, cp_degree: int, block: int = SMALL_CHUNK, repeats: int = 1
) -> Assignment:
    """The token-to-rank assignment torch's balancer ``name`` gives one micro-batch; ``plan_ms``:
    median over ``repeats`` of its rearrange plus restore indices (PTRR's BlockMask not timed)."""
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    lb, lens, real = _balancer(name, doc_lens, cp_degree, block)
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        order = lb._generate_indices(restore=False)
        lb._generate_indices(restore=True)
        times.append((time.perf_counter() - start) * 1e3)
    order = order.reshape(-1).numpy()
    total = int(lens.sum())
    if order.size != total or np.unique(order).size != total:
        raise AssertionError(f"{name} returned {order.size} indices for {total} tokens")
    piece = total // cp_degree  # every balancer above makes the total a multiple of c
    rank = np.argsort(order) // piece  # order is a permutation: its inverse, cut in c pieces
    pad = total - int(doc_lens.sum())
    rows = (cp_degree - 1) * piece
    return Assignment(lens, real, rank, cp_degree, rows, float(np.median(times)), pad)


def plan_assignment(plan: CPPlan, plan_ms: float = 0.0) -> Assignment:
    """The assignment of one of this project's CP plans (no padding; the op's all-gather moves
    ``c`` buffers of the most gathered tokens on one rank)."""
    rank = np.empty(plan.seq_len, dtype=np.int64)
    for r in range(plan.cp_degree):  # CP ranks, not documents
        rank[plan.token_indices(r)] = r
    real = np.ones(plan.doc_lens.size, dtype=bool)
    rows = (plan.cp_degree - 1) * plan.max_gather_len
    return Assignment(plan.doc_lens, real, rank, plan.cp_degree, rows, plan_ms)
