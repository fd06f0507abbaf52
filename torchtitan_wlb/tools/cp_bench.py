"""Compare CP sharding strategies on packed micro-batches.

    python -m torchtitan_wlb.tools.cp_bench --generator longtail_scaled --context-len 131072 \\
        --cp 8 --micro-batches 16 --json
    python -m torchtitan_wlb.tools.cp_bench --generator short --context-len 8192 --cp 2 \\
        --micro-batches 4 --measure --json

Packs ``M`` micro-batches of at most ``L`` tokens from the document lengths (TorchTitan's sequential
"original" fill, documents longer than ``L`` split into ``L``-token pieces first), plans each one with
``per_sequence``, ``per_document``, ``hybrid`` and ``adaptive``, runs torch's own load balancers
(``torch_head_tail``, ``torch_per_document``, ``torch_ptrr``: :mod:`torchtitan_wlb.cp.torch_lb`) on
the same micro-batches, and prints, last, one JSON object::

    {"per_sequence": {...}, "per_document": {...}, "hybrid": {...}, "adaptive": {...},
     "torch_head_tail": {...}, "torch_per_document": {...}, "torch_ptrr": {...}, "config": {...}}

Each strategy reports ``flops_imbalance`` (mean over micro-batches of max/mean per-rank attention
FLOPs, document-masked), ``token_imbalance`` (the same for tokens), ``kv_gather_bytes`` (K/V bytes
each rank receives in one layer's forward all-gather, for ``--kv-heads`` x ``--head-dim`` x
``--kv-dtype-bytes``; ``kv_gather_tokens`` the rows), ``small_chunks`` (mean per micro-batch of the
pieces under 128 tokens cut out of documents: runs of one document's tokens on one rank, whole
documents not counted; ``small_chunks_short_docs`` the total from documents up to hybrid's threshold
of the micro-batch),
``plan_ms`` (median time to build one micro-batch's plan plus one rank's index arrays and attention
metadata arrays; for torch's balancers, their rearrange and restore indices), and adaptive the shares
of micro-batches that chose per-document and hybrid. torch's balancers get the padding they require
(``pad_tokens``).
``--measure`` also runs every rank's local attention (forward + backward, CPU backend, one thread)
and reports the measured max/mean per-rank CPU time. ``--lengths FILE`` reads your own document
lengths (the same files as every tool: :func:`torchtitan_wlb.workloads.load_lengths`). Without
``--lengths``, ``--generator NAME``
synthesises the lengths with one of :data:`torchtitan_wlb.workloads.GENERATORS` (default
``longtail_scaled``, a long-tailed stream; ``short``: about 1,000 documents per 128K micro-batch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.cp.adaptive import build_cp_plan
from torchtitan_wlb.cp.plan import CPPlan
from torchtitan_wlb.cp.profile import resolve_profile
from torchtitan_wlb.cp.torch_lb import (
    SMALL_CHUNK,
    TORCH_BALANCERS,
    assignment_stats,
    plan_assignment,
    torch_assignment,
)
from torchtitan_wlb.packing import OriginalPacker, PackingConfig
from torchtitan_wlb.tools.cli import ToolParser
from torchtitan_wlb.workloads import GENERATORS, generate, load_lengths, split_long

STRATEGY_NAMES = ("per_sequence", "per_document", "hybrid", "adaptive")


def pack_micro_batches(lens: np.ndarray, context_len: int, micro_batches: int) -> list[np.ndarray]:
    """``micro_batches`` micro-batches with the packing engineer's "original" packer."""
    lens = split_long(lens, context_len)
    packer = OriginalPacker(
        PackingConfig(micro_batches=micro_batches, context_len=context_len),
        CostModel.from_coefficients(1.0, 1.0),
    )
    need = packer.tokens_wanted()
    take = int(np.searchsorted(np.cumsum(lens), need)) + 1
    if take > len(lens):
        raise ValueError(
            f"{int(lens.sum())} tokens of documents cannot fill {micro_batches} micro-batches of "
            f"{context_len} tokens"
        )
    step = packer.step(np.arange(take), lens[:take])
    return [np.asarray(x) for x in step.doc_lens if len(x)]


def plan_and_index(
    doc_lens: np.ndarray, cp: int, strategy: str, profile, hybrid_max_len: int = 0
) -> CPPlan:
    """What a rank does per micro-batch: the plan, its own index arrays, the op's index arrays."""
    plan = build_cp_plan(doc_lens, cp, strategy, profile, hybrid_max_len=hybrid_max_len)
    plan.rank_indices(0)
    plan.kv_order()
    plan.local_attention_spec(0)
    return plan


def _rank_step(plan: CPPlan, rank: int, heads: int, kv_heads: int, head_dim: int):
    """A closure running ``rank``'s local attention (both halves against the gathered keys, and
    hybrid's whole documents against their own keys), forward + backward."""
    import torch

    from torchtitan_wlb.attention import document_attention

    spec = plan.local_attention_spec(rank)
    n_local = int(plan.local_lens[rank])
    n_gather, n_whole = spec.n_gather_tokens, n_local - spec.n_gather_tokens
    gen = torch.Generator().manual_seed(rank)

    def rand(n: int, h: int):
        return torch.randn(n, h, head_dim, generator=gen, requires_grad=True)

    q = rand(n_local, heads)
    k, v = rand(plan.gathered_len, kv_heads), rand(plan.gathered_len, kv_heads)
    k_whole, v_whole = rand(n_whole, kv_heads), rand(n_whole, kv_heads)
    calls = [
        (q[: spec.n_head_tokens], k, v, spec.cu_seqlens_q[0], spec.cu_seqlens_k[0],
         spec.max_seqlen_q[0], spec.max_seqlen_k[0]),
        (q[spec.n_head_tokens : n_gather], k, v, spec.cu_seqlens_q[1], spec.cu_seqlens_k[1],
         spec.max_seqlen_q[1], spec.max_seqlen_k[1]),
    ]  # fmt: skip
    if n_whole:
        cu = spec.cu_seqlens_whole
        calls.append((q[n_gather:], k_whole, v_whole, cu, cu, spec.max_seqlen_whole, spec.max_seqlen_whole))  # fmt: skip

    def step():
        outs = []
        for qs, ks, vs, cq, ck, mq, mk in calls:
            if qs.shape[0]:
                cq, ck = torch.from_numpy(cq), torch.from_numpy(ck)
                outs.append(document_attention(qs, ks, vs, cq, ck, mq, mk, backend="cpu"))
        torch.cat(outs).sum().backward()

    return step


def measure_ranks_ms(plan: CPPlan, heads: int, kv_heads: int, head_dim: int, repeats: int):
    """Per-rank forward + backward time (ms) of the local attention, on this machine.

    Ranks run one after another in round-robin over ``repeats`` rounds and each keeps its fastest
    round. Time is this process's CPU time (``time.process_time``; torch runs one thread here), not
    wall-clock time, so that other processes competing for the cores (shared machines) do not
    inflate one rank's time: the figure is the work the kernel did.
    """
    steps = [_rank_step(plan, r, heads, kv_heads, head_dim) for r in range(plan.cp_degree)]
    for step in steps:
        step()  # warm-up
    best = np.full(len(steps), np.inf)
    for _ in range(repeats):
        for r, step in enumerate(steps):
            start = time.process_time()
            step()
            best[r] = min(best[r], (time.process_time() - start) * 1e3)
    return best


def run(args: argparse.Namespace) -> dict:
    if args.lengths:
        lens = load_lengths(args.lengths)
    else:
        need = args.micro_batches * args.context_len
        lens = generate(args.generator, 4096, args.context_len, seed=args.seed)
        while lens.sum() < need * 1.5:
            more = generate(args.generator, 4096, args.context_len, seed=args.seed + len(lens))
            lens = np.concatenate([lens, more])
    micro_batches = pack_micro_batches(lens, args.context_len, args.micro_batches)
    profile = resolve_profile(args.profile)
    results: dict = {}
    kv_bytes = 2 * args.kv_heads * args.head_dim * args.kv_dtype_bytes  # K and V, one layer
    # hybrid's whole-document threshold of every micro-batch (automatic per micro-batch unless
    # --hybrid-max-len): small chunks of documents up to it are what hybrid avoids
    short = [
        build_cp_plan(m, args.cp, "hybrid", hybrid_max_len=args.hybrid_max_len).max_len
        for m in micro_batches
    ]
    for strategy in STRATEGY_NAMES:
        extra = []
        imb, plan_ms, plan_ms_min, chose_doc, est = [], [], [], [], []
        chose_hybrid = []
        meas_imb, meas_max, meas_mean = [], [], []
        for i, doc_lens in enumerate(micro_batches):
            times = []
            for _ in range(args.plan_repeats):
                start = time.perf_counter()
                plan = plan_and_index(doc_lens, args.cp, strategy, profile, args.hybrid_max_len)
                times.append((time.perf_counter() - start) * 1e3)
            plan_ms.append(float(np.median(times)))
            plan_ms_min.append(float(np.min(times)))
            imb.append(plan.flops_imbalance())
            extra.append(assignment_stats(plan_assignment(plan), kv_bytes, short_doc_len=short[i]))
            chose_doc.append(plan.strategy == "per_document")
            chose_hybrid.append(plan.strategy == "hybrid")
            est.append(profile.estimate_plan_seconds(plan) * 1e3)
            if args.measure and i < args.measure_micro_batches:
                rank_ms = measure_ranks_ms(
                    plan, args.heads, args.kv_heads, args.head_dim, args.measure_repeats
                )
                meas_imb.append(float(rank_ms.max() / rank_ms.mean()))
                meas_max.append(float(rank_ms.max()))
                meas_mean.append(float(rank_ms.mean()))
        entry = {
            "flops_imbalance": float(np.mean(imb)),
            "flops_imbalance_max": float(np.max(imb)),
            "plan_ms": float(np.median(plan_ms)),
            "plan_ms_max": float(np.max(plan_ms)),
            "plan_ms_min": float(np.min(plan_ms_min)),
            "estimated_max_rank_ms": float(np.mean(est)),
            **_mean_stats(extra),
        }
        if strategy == "adaptive":
            entry["per_document_share"] = float(np.mean(chose_doc))
            entry["hybrid_share"] = float(np.mean(chose_hybrid))
        if args.measure:
            n_meas = len(meas_imb)
            entry["measured_micro_batches"] = n_meas
            entry["measured_max_ms"] = float(np.mean(meas_max))
            entry["measured_mean_ms"] = float(np.mean(meas_mean))
            entry["measured_imbalance"] = float(np.mean(meas_imb))
            entry["flops_imbalance_measured_subset"] = float(np.mean(imb[:n_meas]))
        results[strategy] = entry
    if args.torch_balancers:
        for name in TORCH_BALANCERS:
            stats = [
                assignment_stats(
                    torch_assignment(name, m, args.cp, repeats=args.plan_repeats),
                    kv_bytes,
                    short_doc_len=max_len,
                )
                for m, max_len in zip(micro_batches, short, strict=True)
            ]
            results[name] = _mean_stats(stats, with_flops=True)
    results["config"] = {
        "lengths": args.lengths or f"generator:{args.generator}(seed={args.seed})",
        "context_len": args.context_len,
        "cp": args.cp,
        "micro_batches": len(micro_batches),
        "docs_per_micro_batch_mean": float(np.mean([len(m) for m in micro_batches])),
        "docs_per_micro_batch_max": int(max(len(m) for m in micro_batches)),
        "tokens_per_micro_batch_mean": float(np.mean([m.sum() for m in micro_batches])),
        "profile": profile.device + "/" + profile.backend,
        "kv_bytes_per_token": kv_bytes,
        "small_chunk_tokens": SMALL_CHUNK,
        "hybrid_max_len_mean": float(np.mean(short)),
    }
    return results


def _mean_stats(stats: list[dict], with_flops: bool = False) -> dict:
    """Per-micro-batch :func:`assignment_stats` summarised: means, the worst micro-batch and the
    small-chunk total. ``with_flops``: also the FLOPs / plan-time keys (for torch's balancers;
    this project's plans report those from the plan itself)."""
    col = {k: np.array([s[k] for s in stats], dtype=np.float64) for k in stats[0]}
    out = {
        "token_imbalance": float(col["token_imbalance"].mean()),
        "token_imbalance_max": float(col["token_imbalance"].max()),
        "kv_gather_bytes": float(col["kv_gather_bytes"].mean()),
        "kv_gather_tokens": float(col["kv_gather_tokens"].mean()),
        "small_chunks": float(col["small_chunks"].mean()),
        "small_chunks_total": int(col["small_chunks"].sum()),
        "small_chunks_short_docs": int(col["small_chunks_short_docs"].sum()),
        "small_chunk_docs_max_len": int(col["small_chunk_docs_max_len"].max()),
        "pad_tokens": float(col["pad_tokens"].mean()),
    }
    if with_flops:
        out = {
            "flops_imbalance": float(col["flops_imbalance"].mean()),
            "flops_imbalance_max": float(col["flops_imbalance"].max()),
            "plan_ms": float(np.median(col["plan_ms"])),
            "plan_ms_max": float(col["plan_ms"].max()),
            **out,
        }
    return out


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.cp_bench", __doc__)
    p.add_argument(
        "--lengths", default=None, help="JSON list / .npy / one integer per line of doc lengths"
    )
    p.add_argument(
        "--generator",
        default="longtail_scaled",
        choices=list(GENERATORS),
        help="synthetic lengths when --lengths is not given",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-len", type=int, default=131072)
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument(
        "--hybrid-max-len",
        type=int,
        default=0,
        help="hybrid: longest document kept whole on one rank (0: chosen per micro-batch)",
    )
    p.add_argument("--profile", default=None, help="CP profile JSON (default: packaged CPU table)")
    p.add_argument("--plan-repeats", type=int, default=5, help="timings per micro-batch plan")
    p.add_argument("--measure", action="store_true", help="time every rank's local attention")
    p.add_argument("--measure-micro-batches", type=int, default=4, help="micro-batches measured")
    p.add_argument("--measure-repeats", type=int, default=5, help="rounds per rank (fastest kept)")
    p.add_argument("--heads", type=int, default=2, help="query heads for --measure")
    p.add_argument(
        "--kv-heads", type=int, default=1, help="KV heads for --measure and kv_gather_bytes"
    )
    p.add_argument(
        "--head-dim", type=int, default=16, help="head dim for --measure and kv_gather_bytes"
    )
    p.add_argument(
        "--kv-dtype-bytes", type=int, default=2, help="bytes per K/V element (kv_gather_bytes)"
    )
    p.add_argument(
        "--no-torch-balancers",
        dest="torch_balancers",
        action="store_false",
        help="skip the rows of torch's own load balancers",
    )
    p.add_argument("--json", action="store_true", help="print the JSON result last")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    for name in ("context_len", "cp", "micro_batches", "plan_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} = {getattr(args, name)} must be >= 1")
    if args.hybrid_max_len < 0:
        p.error(f"--hybrid-max-len = {args.hybrid_max_len} must be >= 0 (0: automatic)")
    import torch

    threads = torch.get_num_threads()
    if args.measure:
        torch.set_num_threads(1)  # CPU time of one thread = the kernel's work
    try:
        results = run(args)
    except (ValueError, OSError) as exc:  # a bad lengths or profile file: one line
        p.error(str(exc))
    finally:
        torch.set_num_threads(threads)
    for strategy in (*STRATEGY_NAMES, *(TORCH_BALANCERS if args.torch_balancers else ())):
        r = results[strategy]
        line = (
            f"{strategy:18s} flops_imbalance={r['flops_imbalance']:.4f} "
            f"tokens={r['token_imbalance']:.4f} kv_gather_MB={r['kv_gather_bytes'] / 1e6:.2f} "
            f"small_chunks={r['small_chunks']:.1f} plan_ms={r['plan_ms']:.3f}"
        )
        if "per_document_share" in r:
            line += f" per_document_share={r['per_document_share']:.2f}"
            line += f" hybrid_share={r['hybrid_share']:.2f}"
        if "measured_imbalance" in r:
            line += (
                f" measured_imbalance={r['measured_imbalance']:.4f} "
                f"(flops {r['flops_imbalance_measured_subset']:.4f}) "
                f"max={r['measured_max_ms']:.1f}ms mean={r['measured_mean_ms']:.1f}ms"
            )
        print(line, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
