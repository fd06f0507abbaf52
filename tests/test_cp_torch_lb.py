"""torch's own CP load balancers as cp_bench measures them (pure index arithmetic, one process)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from torchtitan_wlb.cp import build_cp_plan
from torchtitan_wlb.tools.torch_balancers import (
    TORCH_BALANCERS,
    assignment_stats,
    plan_assignment,
    ptrr_block_counts,
    torch_assignment,
)

LENS = np.array([300, 1000, 37, 5000, 20, 7, 900, 1])


def _dense_pairs(doc_lens: np.ndarray, rank: np.ndarray, c: int) -> np.ndarray:
    """Per-rank (query, key) pairs of a document-causal mask, from the dense mask."""
    doc = np.repeat(np.arange(doc_lens.size), doc_lens)
    idx = np.arange(doc.size)
    mask = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    return np.bincount(rank, weights=mask.sum(axis=1), minlength=c)


def test_ptrr_block_counts_match_the_dense_mask():
    lens = np.array([100, 300, 50, 1, 400, 173, 1024])
    doc = np.repeat(np.arange(lens.size), lens)
    idx = np.arange(doc.size)
    mask = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    n = doc.size // 128
    blocks = mask.reshape(n, 128, n, 128).any(axis=(1, 3)).sum(axis=1)
    np.testing.assert_array_equal(ptrr_block_counts(lens, 128), blocks)


@pytest.mark.parametrize("name", TORCH_BALANCERS)
def test_torch_balancer_assignment_is_a_partition_with_exact_flops(name):
    c = 2
    a = torch_assignment(name, LENS, c, block=32)
    total = int(a.doc_lens.sum())
    assert total >= LENS.sum() and a.pad_tokens == total - LENS.sum()
    assert total % (2 * c if name != "torch_ptrr" else 32 * c) == 0
    counts = np.bincount(a.rank, minlength=c)
    assert np.all(counts == total // c)  # _context_parallel_shard: equal contiguous pieces
    if name == "torch_per_document":
        assert np.all(a.doc_lens % (2 * c) == 0) and np.all(a.doc_lens - LENS < 2 * c)
    stats = assignment_stats(a, kv_bytes_per_token=10.0)
    pairs = _dense_pairs(a.doc_lens, a.rank, c)
    assert stats["flops_imbalance"] == pytest.approx(pairs.max() / pairs.mean())
    assert stats["kv_gather_bytes"] == 10.0 * (c - 1) * total // c


@pytest.mark.parametrize("strategy", ["per_sequence", "per_document", "hybrid"])
def test_plan_assignment_agrees_with_the_plan(strategy):
    plan = build_cp_plan(LENS, 4, strategy)
    stats = assignment_stats(plan_assignment(plan), kv_bytes_per_token=1.0)
    assert stats["flops_imbalance"] == pytest.approx(plan.flops_imbalance())
    pairs = _dense_pairs(LENS, plan_assignment(plan).rank, 4)
    np.testing.assert_allclose(pairs, plan.rank_attention_pairs())
    assert stats["kv_gather_tokens"] == 3 * plan.max_gather_len and stats["pad_tokens"] == 0
    assert stats["kv_gather_bytes"] == plan.kv_gather_bytes(1, 1, 1) / 2  # 1 byte per token
    if strategy == "hybrid":  # documents up to 2 * 4 * 128 tokens whole: only 5000 is cut
        assert stats["small_chunks"] == 0 and plan.max_gather_len < plan.max_local_len
    if strategy == "per_document":
        # every document is cut into 8 chunks; those of documents under 8 * 128 tokens are small
        assert stats["small_chunks"] > 0 and stats["small_chunk_docs_max_len"] == 1000


def test_small_chunks_count_only_cut_documents():
    from torchtitan_wlb.tools.torch_balancers import Assignment

    lens = np.array([5, 300, 4])
    rank = np.repeat([0, 1, 0, 1, 1], [5, 100, 150, 50, 4])  # doc 1 cut into 100 / 150 / 50
    a = Assignment(lens, np.ones(3, dtype=bool), rank, 2, 0, 0.0)
    stats = assignment_stats(a, 1.0)
    assert stats["small_chunks"] == 2 and stats["small_chunk_docs_max_len"] == 300
    assert stats["token_imbalance"] == pytest.approx(155 / 154.5)


def test_cp_bench_reports_torch_balancers(capsys):
    from torchtitan_wlb.tools import cp_bench

    args = ["--generator", "short", "--context-len", "1024", "--cp", "2", "--micro-batches", "2"]
    assert cp_bench.main([*args, "--plan-repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    keys = {"flops_imbalance", "token_imbalance", "kv_gather_bytes", "small_chunks", "plan_ms"}
    for name in (*cp_bench.STRATEGY_NAMES, *TORCH_BALANCERS):
        assert keys <= set(result[name]), name
    # per-document cuts every short document into 2c chunks; per-sequence cuts at most 2c - 1
    assert result["per_document"]["small_chunks"] > result["per_sequence"]["small_chunks"]


# ---------------------------------------------------------------- our plans via torch's interface
WORLD = 2
# name -> (rows of document lengths, strategy, hybrid's whole-document threshold)
ADAPTER_CASES: dict[str, tuple[list[list[int]], str, int]] = {
    "one_document": ([[36]], "per_document", 0),
    "mixed_documents": ([[13, 6, 2, 1, 30]], "per_document", 0),
    "not_divisible": ([[13, 6, 2]], "per_document", 0),  # local lengths differ: padded pieces
    "shorter_than_cp": ([[1, 1, 1, 1, 1, 3]], "per_document", 0),
    "two_rows": ([[20, 4], [1, 2, 3, 18]], "per_document", 0),
    "per_sequence": ([[13, 6, 2, 1, 30]], "per_sequence", 0),
    "hybrid": ([[13, 6, 2, 1, 30, 3, 3]], "hybrid", 8),  # 13 and 30 split, the rest whole
    "hybrid_all_whole": ([[13, 6, 2, 1, 30, 3, 3]], "hybrid", 0),
    "hybrid_two_rows": ([[40, 5, 9], [3, 1, 50]], "hybrid", 8),
}


def _adapter_case(name: str, rank: int, mesh) -> dict:
    import torch
    from torch.distributed.tensor.experimental._context_parallel import (
        _context_parallel_shard,
        context_parallel_unshard,
    )

    from torchtitan_wlb.cp.local import shard_tensor
    from torchtitan_wlb.cp.torch_lb import PlanLoadBalancer

    rows, strategy, max_len = ADAPTER_CASES[name]
    kwargs = {"max_len": max_len} if strategy == "hybrid" else {}
    lb = PlanLoadBalancer(rows, WORLD, "cpu", strategy=strategy, **kwargs)
    total, padded, piece = sum(rows[0]), lb.seq_length, lb.seq_length // WORLD
    # padded buffers: [B, padded] token ids (seq dim 1), [padded, 3] features (seq dim 0)
    tokens = torch.arange(len(rows) * padded).view(len(rows), padded) * 10 + 7
    feats = torch.randn(padded, 3, generator=torch.Generator().manual_seed(total))
    if len(rows) == 1:
        local_tokens, local_feats = _context_parallel_shard(mesh, [tokens, feats], [1, 0], lb)
    else:  # per-row balancing: the indices vary within the batch, so dim-0 buffers cannot use it
        (local_tokens,) = _context_parallel_shard(mesh, [tokens], [1], lb)
        local_feats = None
    ok = local_tokens.shape[1] == piece
    for b, plan in enumerate(lb.plans):  # torch's shard = this project's shard, then padding
        n = int(plan.local_lens[rank])
        ok &= torch.equal(local_tokens[b, :n], shard_tensor(plan, rank, tokens[b, :total]))
        ok &= bool(torch.isin(local_tokens[b, n:], tokens[b, total:]).all())
        if local_feats is not None:
            ok &= torch.equal(local_feats[:n], shard_tensor(plan, rank, feats[:total], dim=0))
    (restored,) = context_parallel_unshard(mesh, [local_tokens], [1], lb)
    return {"shard_matches_plan": bool(ok), "round_trip": bool(torch.equal(restored, tokens))}


def _adapter_cases(rank: int) -> dict[str, dict]:
    """Every case on this rank, through a CP mesh that lives only here (it holds the group)."""
    import traceback

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    results: dict[str, dict] = {}
    for name in ADAPTER_CASES:
        try:
            results[name] = _adapter_case(name, rank, mesh)
        except Exception:  # report, keep the other rank's collectives in step
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return results


def _adapter_worker(rank: int, out_dir: str) -> None:
    import os
    import weakref

    import torch
    import torch.distributed as dist

    # Imported before the process group exists, not by the first distribute_tensor (through
    # torch._dynamo): its functions take ``group=group.WORLD`` as a default, bound at import, and
    # bound to a live group they would keep it past destroy_process_group. Gloo's worker threads
    # would then live on into interpreter finalization, where one still dropping a collective's
    # tensors takes the GIL, is made to exit and aborts the rank (SIGABRT, "terminate called
    # without an active exception").
    import torch.distributed.nn.functional  # noqa: F401

    torch.set_num_threads(1)
    # A file store: a TCP store on a port probed beforehand can lose it to another process
    # between the probe and the bind.
    init = f"file://{os.path.join(out_dir, 'store')}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    world = weakref.ref(dist.group.WORLD)
    results: dict[str, dict] = {}
    try:
        results = _adapter_cases(rank)
    finally:
        dist.destroy_process_group()
        # Freed here, the group has joined its worker threads: none is left for finalization.
        results["teardown"] = {"group_freed": world() is None}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def adapter_results(tmp_path_factory):
    import os

    import torch.multiprocessing as mp

    out_dir = str(tmp_path_factory.mktemp("torch_lb"))
    mp.spawn(_adapter_worker, args=(out_dir,), nprocs=WORLD, join=True)
    out = []
    for rank in range(WORLD):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.mark.parametrize("name", ADAPTER_CASES)
def test_plan_load_balancer_round_trips_through_torch(adapter_results, name):
    for rank, res in enumerate(adapter_results):
        assert "error" not in res[name], f"rank {rank}: {res[name].get('error')}"
        assert res[name] == {"shard_matches_plan": True, "round_trip": True}, f"rank {rank}"


def test_torch_balancer_ranks_free_their_process_group(adapter_results):
    """destroy_process_group frees the group (and so joins gloo's worker threads) in every rank:
    no reference left to it keeps those threads running into interpreter finalization."""
    assert [res["teardown"] for res in adapter_results] == [{"group_freed": True}] * WORLD


def test_plan_load_balancer_indices_invert_and_pad_unequal_ranks():
    from torchtitan_wlb.cp.torch_lb import PlanLoadBalancer

    lb = PlanLoadBalancer([[5, 9, 2]], 2)  # 16 tokens, divisible by 2c: no padding
    fwd, back = lb._generate_indices(), lb._generate_indices(restore=True)
    assert lb.seq_length == 16 and fwd.shape == (1, 16) and fwd.dtype == back.dtype
    np.testing.assert_array_equal(fwd[0][back[0]].numpy(), np.arange(16))
    np.testing.assert_array_equal(fwd[0, :8].numpy(), lb.plans[0].token_indices(0))
    lb = PlanLoadBalancer([[3, 4]], 2)  # ranks hold 3 and 4 tokens: one padding row
    assert lb.plans[0].local_lens.tolist() == [3, 4] and lb.seq_length == 8
    fwd = lb._generate_indices()[0].numpy()
    np.testing.assert_array_equal(fwd[:3], lb.plans[0].token_indices(0))
    assert fwd[3] == 7 and sorted(fwd) == list(range(8))
    with pytest.raises(ValueError, match="same tokens"):
        PlanLoadBalancer([[4], [2, 4]], 2)
