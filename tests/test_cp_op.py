"""CP attention op on CPU/gloo against single-device document-masked causal attention.

One 4-process launch serves the whole module: CP = 4 runs on the world group, CP = 2 on the two halves
of a (dp=2, cp=2) DeviceMesh, so every case runs for both degrees. Every rank writes the worst error of
every case to a JSON file; the tests below assert on those numbers.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import varlen_kernels

WORLD = 4
TOLERANCE = 1e-5  # max |error| / max |reference|, fp32 op vs float64 reference

# name -> (doc_lens, strategy, n_heads, n_kv_heads, use_dtensor[, hybrid_max_len])
CASES: dict[str, tuple] = {
    "one_document": ([37], "per_document", 4, 4, False),
    "one_document_per_sequence": ([37], "per_sequence", 4, 4, False),
    "random_documents": ("random", "per_document", 4, 4, False),
    "random_documents_per_sequence": ("random", "per_sequence", 4, 4, False),
    "random_documents_adaptive": ("random", "adaptive", 4, 4, False),
    "short_documents_len1": ([1, 3, 1, 2, 7, 1, 5, 1], "per_document", 2, 2, False),
    "total_not_divisible": ([13, 6, 2], "per_document", 2, 2, False),
    "one_token_per_rank": ("one_per_rank", "per_document", 2, 2, False),
    "gqa_2_to_1": ("random", "per_document", 4, 2, False),
    "gqa_4_to_1_per_sequence": ([9, 30, 1, 17], "per_sequence", 4, 1, False),
    "dtensor_inputs": ([11, 25, 3], "per_document", 4, 2, True),
    # hybrid: documents <= max_len whole on one rank (local K/V only), longer ones split.
    "hybrid_all_short": ("random", "hybrid", 4, 2, False, 0),  # nothing gathered at all
    "hybrid_all_long": ([37, 25, 11, 9], "hybrid", 4, 4, False, 8),  # == per-document
    "hybrid_one_document": ([37], "hybrid", 4, 4, False, 0),  # kept whole: split to fill ranks
    "hybrid_shorter_than_cp": ([1, 3, 1, 2, 7, 1, 5, 1, 2], "hybrid", 2, 2, False, 2),
    "hybrid_mix_gqa_dtensor": ([30, 2, 17, 5, 9, 40, 3, 12], "hybrid", 4, 1, True, 10),
}
# The CUDA backends' path through the op, at CP = 2 only: flash-attn and torch's varlen_attn are
# stood in for by CPU references of their documented contracts (tests/varlen_kernels.py).
# name -> (doc_lens, strategy, n_heads, n_kv_heads, hybrid_max_len, backend)
BACKEND_CASES: dict[str, tuple] = {
    f"{backend}_{strategy}": ([30, 2, 17, 5, 9, 40, 3, 12], strategy, 4, 2, 10, backend)
    for backend in ("flash", "torch_varlen")
    for strategy in ("hybrid", "per_document")
}


def _doc_lens(spec, cp: int) -> np.ndarray:
    if spec == "random":
        rng = np.random.default_rng(7)
        return rng.integers(1, 40, size=9)
    if spec == "one_per_rank":
        return np.ones(cp, dtype=np.int64)
    return np.asarray(spec, dtype=np.int64)


def _reference(q, k, v, doc_lens, grad_out):
    """Dense float64 attention with a block-diagonal causal mask over the unsharded micro-batch."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.as_tensor(doc_lens))
    pos = torch.arange(len(doc))
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, kk) / q.shape[-1] ** 0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, vv)
    out.backward(grad_out.double())
    return out.detach(), q.grad, k.grad, v.grad


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item() or 1.0
    return (got.double() - want).abs().max().item() / scale


def _run_case(name, cp, mesh_or_group, rank_in_group):
    from torch.distributed.tensor import DTensor, Shard

    from torchtitan_wlb.attention import DocumentAttentionMetadata, attention_from_metadata
    from torchtitan_wlb.cp import build_cp_plan
    from torchtitan_wlb.cp.local import build_cp_attention_metadata, shard_tensor

    if name in BACKEND_CASES:
        spec, strategy, n_heads, n_kv, *max_len, backend = BACKEND_CASES[name]
        use_dtensor = False
    else:
        spec, strategy, n_heads, n_kv, use_dtensor, *max_len = CASES[name]
        backend = "cpu"
    doc_lens = _doc_lens(spec, cp)
    total = int(doc_lens.sum())
    gen = torch.Generator().manual_seed(total * 31 + n_kv)
    q = torch.randn(total, n_heads, 8, generator=gen)
    k = torch.randn(total, n_kv, 8, generator=gen)
    v = torch.randn(total, n_kv, 8, generator=gen)
    grad_out = torch.randn(total, n_heads, 8, generator=gen)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, doc_lens, grad_out)

    plan = build_cp_plan(doc_lens, cp, strategy, hybrid_max_len=max_len[0] if max_len else 0)
    idx = torch.from_numpy(plan.token_indices(rank_in_group))
    ql, kl, vl = (
        shard_tensor(plan, rank_in_group, t, dim=0).requires_grad_(True) for t in (q, k, v)
    )
    cp_meta = build_cp_attention_metadata(plan, rank_in_group, mesh_or_group)
    meta = DocumentAttentionMetadata(
        cu_seqlens=torch.zeros(1, dtype=torch.int32), max_seqlen=0, backend=backend, cp=cp_meta
    )
    calls_before = sum(varlen_kernels.calls.values())
    if use_dtensor:
        mesh = mesh_or_group

        def wrap(t):
            shape = (total,) + tuple(t.shape[1:])
            stride = torch.empty(shape).stride()
            return DTensor.from_local(
                t, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
            )

        out_d = attention_from_metadata(wrap(ql), wrap(kl), wrap(vl), meta)
        assert isinstance(out_d, DTensor), type(out_d)
        out = out_d.to_local()
    else:
        out = attention_from_metadata(ql, kl, vl, meta)
    out.backward(grad_out[idx])
    return {
        "kernel_calls": sum(varlen_kernels.calls.values()) - calls_before,
        "tokens": int(len(idx)),
        "gathered_share": plan.gathered_len / total,
        "out": _rel(out.detach(), ref_out[idx]),
        "dq": _rel(ql.grad, ref_dq[idx]),
        "dk": _rel(kl.grad, ref_dk[idx]),
        "dv": _rel(vl.grad, ref_dv[idx]),
    }


def _run_shard_helper(cp, mesh, rank_in_group):
    """The trainer's CP sharding of a [1, T] micro-batch (``WLBTrainer._shard_for_cp``): local
    inputs/labels/per-document positions agree with the plan; its metadata runs."""
    from torchtitan_wlb.attention import DocumentAttentionMetadata, attention_from_metadata
    from torchtitan_wlb.cp import build_cp_plan
    from torchtitan_wlb.cp.local import build_cp_attention_metadata, shard_tensor

    doc_lens = np.array([7, 1, 12, 3])
    inputs = torch.arange(23)[None, :] + 100
    labels = torch.arange(23)[None, :] + 200
    starts = np.repeat(np.cumsum(doc_lens) - doc_lens, doc_lens)
    positions = torch.from_numpy(np.arange(23) - starts)[None, :]
    plan = build_cp_plan(doc_lens, cp, "per_document")
    rank = mesh.get_local_rank()
    local = [shard_tensor(plan, rank, t, dim=1) for t in (inputs, labels, positions)]
    masks = DocumentAttentionMetadata(
        cu_seqlens=torch.zeros(0, dtype=torch.int32),
        max_seqlen=0,
        backend="cpu",
        cp=build_cp_attention_metadata(plan, rank, mesh, device=inputs.device),
    )
    idx, pos = plan.rank_indices(rank_in_group)
    ok = (
        local[0][0].tolist() == (idx + 100).tolist()
        and local[1][0].tolist() == (idx + 200).tolist()
        and local[2][0].tolist() == pos.tolist()
        and plan.seq_len == 23
    )
    q = torch.randn(len(idx), 2, 4)
    out = attention_from_metadata(q, q, q, masks)
    return {
        "tokens": len(idx),
        "out": 0.0 if ok and out.shape == q.shape else 1.0,
        "dq": 0.0,
        "dk": 0.0,
        "dv": 0.0,
    }


def _run_opcheck(group, rank_in_group) -> dict:
    """``torch.library.opcheck`` of the CP forward and backward ops (schema, fake kernels,
    autograd registration, AOT dispatch with dynamic shapes) on a hybrid plan: gathered and
    whole documents, GQA. Every rank runs the same checks, so the collectives stay in step."""
    from torchtitan_wlb.cp import build_cp_plan
    from torchtitan_wlb.cp.local import build_cp_attention_metadata, shard_tensor
    from torchtitan_wlb.cp.op import cp_attention_bwd, cp_attention_fwd

    doc_lens = np.array([30, 2, 17, 5, 9, 40, 3, 12])
    plan = build_cp_plan(doc_lens, 2, "hybrid", hybrid_max_len=10)
    meta = build_cp_attention_metadata(plan, rank_in_group, group)
    gen = torch.Generator().manual_seed(5)
    total = int(doc_lens.sum())
    q, k, v = (torch.randn(total, h, 8, generator=gen) for h in (4, 2, 2))
    q, k, v = (shard_tensor(plan, rank_in_group, t, dim=0) for t in (q, k, v))
    index = (meta.kv_order, *meta.op_cus, meta.op_sizes, meta.group_name, 8**-0.5, "cpu")
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(cp_attention_fwd, (*leaves, *index))
    torch.library.opcheck(cp_attention_bwd, (torch.randn_like(q), q, k, v, *index))
    return {"opcheck": "passed"}


def _worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    # A file store, not a TCP one on a port probed beforehand: another process may take that port
    # between the probe and the bind.
    init = f"file://{os.path.join(out_dir, 'store')}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    varlen_kernels.install(pytest.MonkeyPatch())  # this process only; "cpu" cases unaffected
    results: dict[str, dict] = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        mesh_1d = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
        setups = {
            2: (mesh_2d["cp"], mesh_2d["cp"].get_local_rank()),
            4: (mesh_1d, rank),
        }
        for cp, (mesh, cp_rank) in setups.items():
            for name, case in CASES.items():
                # Plain-tensor cases use the ProcessGroup; DTensor cases need the mesh itself.
                target = mesh if case[4] or cp == 2 else mesh.get_group()
                key = f"{name}@cp{cp}"
                try:
                    results[key] = _run_case(name, cp, target, cp_rank)
                except Exception:  # report, keep the collectives of the other ranks in step
                    results[key] = {"error": traceback.format_exc()}
                dist.barrier()
            for name in BACKEND_CASES if cp == 2 else ():
                key = f"{name}@cp{cp}"
                try:
                    results[key] = _run_case(name, cp, mesh.get_group(), cp_rank)
                except Exception:
                    results[key] = {"error": traceback.format_exc()}
                dist.barrier()
            if cp == 2 and rank < 2:  # one CP group is enough (the other waits at the barrier)
                try:
                    results["opcheck@cp2"] = _run_opcheck(mesh.get_group(), cp_rank)
                except Exception:
                    results["opcheck@cp2"] = {"error": traceback.format_exc()}
            if cp == 2:
                dist.barrier()
            try:
                results[f"shard_helper@cp{cp}"] = _run_shard_helper(cp, mesh, cp_rank)
            except Exception:
                results[f"shard_helper@cp{cp}"] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("cp_op"))
    # The ranks fork from a server that imported torch and the CP op once (as in
    # test_pipeline_varlen.py), instead of each importing them anew: seconds of CPU per rank.
    multiprocessing.set_forkserver_preload(
        [
            "torch",
            "torch.distributed.tensor",
            "torchtitan_wlb.attention",
            "torchtitan_wlb.cp.local",
            "torch._dynamo",
            "torch._functorch.aot_autograd",
        ]  # (the last two: opcheck's)
    )
    mp.start_processes(_worker, args=(out_dir,), nprocs=WORLD, join=True, start_method="forkserver")
    merged = {}
    for rank in range(WORLD):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            for key, value in json.load(f).items():
                merged.setdefault(key, []).append(value)
    return merged


def _check_ranks(per_rank: list[dict]) -> None:
    assert len(per_rank) == WORLD
    for rank, res in enumerate(per_rank):
        assert "error" not in res, f"rank {rank}: {res.get('error')}"
        assert res["tokens"] >= 1, f"rank {rank} holds no token"
        for field in ("out", "dq", "dk", "dv"):
            assert res[field] <= TOLERANCE, f"rank {rank} {field} rel error {res[field]:.3e}"


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", [*CASES, "shard_helper"])
def test_cp_attention_matches_single_device(results, name, cp):
    _check_ranks(results[f"{name}@cp{cp}"])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BACKEND_CASES))
def test_cuda_backends_path_matches_single_device(results, name):
    """flash / torch_varlen inside the op (stand-in kernels): values and gradients, GQA, and for
    hybrid a mix of whole and split documents; every rank called the stand-in kernel."""
    per_rank = results[f"{name}@cp2"]
    _check_ranks(per_rank)
    assert all(res["kernel_calls"] >= 2 for res in per_rank), per_rank  # forward + backward
    share = per_rank[0]["gathered_share"]
    assert 0.0 < share < 1.0 if name.endswith("hybrid") else share == 1.0, share


@pytest.mark.slow
def test_cp_ops_pass_opcheck(results):
    assert len(results["opcheck@cp2"]) == 2
    for rank, res in enumerate(results["opcheck@cp2"]):
        assert res == {"opcheck": "passed"}, f"rank {rank}: {res.get('error')}"


# Hybrid cases cover what their names say: share of tokens whose K/V are gathered.
HYBRID_GATHERED = {
    "hybrid_all_short": lambda share: share == 0.0,
    "hybrid_all_long": lambda share: share == 1.0,
    "hybrid_one_document": lambda share: share == 1.0,
    "hybrid_shorter_than_cp": lambda share: 0.0 < share < 1.0,
    "hybrid_mix_gqa_dtensor": lambda share: 0.0 < share < 1.0,
}


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", sorted(HYBRID_GATHERED))
def test_hybrid_cases_gather_what_they_claim(results, name, cp):
    share = results[f"{name}@cp{cp}"][0]["gathered_share"]
    assert HYBRID_GATHERED[name](share), f"{name}@cp{cp}: gathered share {share}"


def test_shape_errors_name_the_values():
    from torchtitan_wlb.cp.op import CPAttentionMetadata, cp_attention

    meta = CPAttentionMetadata(
        group_name="unused",
        cp_rank=0,
        cp_degree=2,
        local_len=4,
        max_gather_len=4,
        kv_order=torch.arange(8),
        n_head_tokens=2,
        n_gather_tokens=4,
        cu_seqlens_q=(torch.zeros(2, dtype=torch.int32),) * 2,
        cu_seqlens_k=(torch.zeros(2, dtype=torch.int32),) * 2,
        max_seqlen_q=(2, 2),
        max_seqlen_k=(8, 8),
        cu_seqlens_whole=torch.zeros(1, dtype=torch.int32),
        max_seqlen_whole=0,
        key_window=((0, 8), (0, 8)),
    )
    q = torch.randn(4, 4, 8)
    with pytest.raises(ValueError, match=r"k=\(4, 2, 8\), v=\(3, 2, 8\)"):
        cp_attention(q, torch.randn(4, 2, 8), torch.randn(3, 2, 8), meta)
    with pytest.raises(ValueError, match="multiple of n_kv_heads=3"):
        cp_attention(q, torch.randn(4, 3, 8), torch.randn(4, 3, 8), meta)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        cp_attention(torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8), meta)


def test_resolve_group_rejects_other_objects():
    from torchtitan_wlb.cp.local import resolve_cp_group

    with pytest.raises(ValueError, match="ProcessGroup or DeviceMesh"):
        resolve_cp_group("cp")
