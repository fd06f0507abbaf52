"""Compare CP sharding strategies (and torch's own load balancers) on packed micro-batches:
FLOPs and token balance, K/V gathered, small chunks, plan time; ``--measure`` also times every
rank's local attention on this machine.

    python -m torchtitan_wlb.tools.cp_bench --generator longtail_scaled --context-len 131072 \\
        --cp 8 --micro-batches 16 --json
    python -m torchtitan_wlb.tools.cp_bench --generator short --context-len 8192 --cp 2 \\
        --micro-batches 4 --measure --json

What is measured and every JSON key: docs/benchmarks_cp.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.cp import torch_lb
from torchtitan_wlb.cp.adaptive import build_cp_plan
from torchtitan_wlb.cp.plan import CPPlan
from torchtitan_wlb.cp.profile import resolve_profile
from torchtitan_wlb.packing import OriginalPacker, PackingConfig
from torchtitan_wlb.packing.driver import LengthStream, next_plan
from torchtitan_wlb.tools.cli import ToolParser, require_at_least
from torchtitan_wlb.workloads import GENERATORS, generate, load_lengths, split_long

STRATEGY_NAMES = ("per_sequence", "per_document", "hybrid", "adaptive")
SHOWN = {  # a result's text line: these JSON keys where it has them, in this format
    "flops_imbalance": ".4f", "token_imbalance": ".4f", "kv_gather_bytes": ".3g",
    "small_chunks": ".1f", "plan_ms": ".3f", "per_document_share": ".2f", "hybrid_share": ".2f",
    "measured_imbalance": ".4f", "flops_imbalance_measured_subset": ".4f",
    "measured_max_ms": ".1f", "measured_mean_ms": ".1f",
}  # fmt: skip


def pack_micro_batches(lens: np.ndarray, context_len: int, micro_batches: int) -> list[np.ndarray]:
    """``micro_batches`` micro-batches of one step of TorchTitan's sequential fill ("original")."""
    lens = split_long(lens, context_len)
    config = PackingConfig(micro_batches=micro_batches, context_len=context_len)
    packer = OriginalPacker(config, CostModel.from_coefficients(1.0, 1.0))
    if int(lens.sum()) < packer.tokens_wanted():
        raise ValueError(
            f"{int(lens.sum())} tokens of documents cannot fill {micro_batches} micro-batches of "
            f"{context_len} tokens"
        )
    step = next_plan(packer, LengthStream(lens, end_of_data=False))
    return [np.asarray(x) for x in step.doc_lens if len(x)]


def _rank_step(plan: CPPlan, rank: int, heads: int, kv_heads: int, head_dim: int):
    """A closure running ``rank``'s local attention forward + backward on random tensors."""
    import torch

    from torchtitan_wlb.cp.op import _local_attention, op_arguments

    s = plan.local_attention_spec(rank)
    n_local, n_gather = int(plan.local_lens[rank]), s.n_gather_tokens
    gen = torch.Generator().manual_seed(rank)
    gathered, whole = (plan.gathered_len, kv_heads), (n_local - n_gather, kv_heads)
    tensors = [
        torch.randn(n, h, head_dim, generator=gen, requires_grad=True)
        for n, h in ((n_local, heads), gathered, gathered, whole, whole)
    ]  # q, then K and V of the gathered keys and of the whole documents
    cus, sizes = op_arguments(s, plan.max_gather_len)
    cus = tuple(map(torch.from_numpy, cus))
    return lambda: _local_attention(*tensors, cus, sizes, head_dim**-0.5, "cpu").sum().backward()


def measure_ranks_ms(plan: CPPlan, heads: int, kv_heads: int, head_dim: int, repeats: int):
    """Per-rank forward + backward CPU time (ms) of the local attention, fastest of ``repeats``
    round-robin rounds: CPU time, so that other processes on the cores do not inflate one rank."""
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


# JSON key -> (per-micro-batch column, its reduction over the micro-batches); torch's balancers
# have no plan_ms_min or estimated_max_rank_ms column
SUMMARY = {
    "flops_imbalance": ("flops_imbalance", np.mean),
    "flops_imbalance_max": ("flops_imbalance", np.max),
    "plan_ms": ("plan_ms", np.median),
    "plan_ms_max": ("plan_ms", np.max),
    "plan_ms_min": ("plan_ms_min", np.min),
    "estimated_max_rank_ms": ("estimated_max_rank_ms", np.mean),
    "token_imbalance": ("token_imbalance", np.mean),
    "token_imbalance_max": ("token_imbalance", np.max),
    "kv_gather_bytes": ("kv_gather_bytes", np.mean),
    "kv_gather_tokens": ("kv_gather_tokens", np.mean),
    "small_chunks": ("small_chunks", np.mean),
    "small_chunks_total": ("small_chunks", np.sum),
    "small_chunks_short_docs": ("small_chunks_short_docs", np.sum),
    "small_chunk_docs_max_len": ("small_chunk_docs_max_len", np.max),
    "pad_tokens": ("pad_tokens", np.mean),
}


def summarise(rows: list[dict]) -> dict:
    """Per-micro-batch figures reduced as :data:`SUMMARY` says (counts stay integers)."""
    cols = {key: np.asarray([r[key] for r in rows]) for key in rows[0]}
    return {key: f(cols[col]).item() for key, (col, f) in SUMMARY.items() if col in cols}


def run(args: argparse.Namespace) -> dict:
    def sample(seed: int) -> np.ndarray:
        return generate(args.generator, 4096, args.context_len, seed=seed)

    lens = load_lengths(args.lengths) if args.lengths else sample(args.seed)
    while not args.lengths and lens.sum() < args.micro_batches * args.context_len * 1.5:
        lens = np.concatenate([lens, sample(args.seed + len(lens))])
    micro_batches = pack_micro_batches(lens, args.context_len, args.micro_batches)
    profile = resolve_profile(args.profile)
    results: dict = {}
    kv_bytes = 2 * args.kv_heads * args.head_dim * args.kv_dtype_bytes  # K and V, one layer
    # hybrid's whole-document threshold of every micro-batch (automatic per micro-batch unless
    # --hybrid-max-len): small chunks of documents up to it are what hybrid avoids
    max_len = args.hybrid_max_len
    short = [
        build_cp_plan(m, args.cp, "hybrid", hybrid_max_len=max_len).max_len for m in micro_batches
    ]

    def stats(assignment: torch_lb.Assignment, i: int) -> dict:
        return torch_lb.assignment_stats(assignment, kv_bytes, short_doc_len=short[i])

    for strategy in STRATEGY_NAMES:
        rows, chosen = [], []
        measured = []  # (max / mean, max, mean) of the ranks' times, per measured micro-batch
        for i, doc_lens in enumerate(micro_batches):
            times = []
            for _ in range(args.plan_repeats):
                start = time.perf_counter()
                plan = build_cp_plan(doc_lens, args.cp, strategy, profile, hybrid_max_len=max_len)
                plan.rank_indices(0)  # what a rank does per micro-batch: its index arrays
                plan.kv_order()  # and the op's
                plan.local_attention_spec(0)
                times.append((time.perf_counter() - start) * 1e3)
            rows.append(  # the assignment's flops_imbalance is the plan's (same causal pairs)
                stats(torch_lb.plan_assignment(plan), i)
                | {
                    "plan_ms": float(np.median(times)),
                    "plan_ms_min": float(np.min(times)),
                    "estimated_max_rank_ms": profile.estimate_plan_seconds(plan) * 1e3,
                }
            )
            chosen.append(plan.strategy)
            if args.measure and i < args.measure_micro_batches:
                ms = measure_ranks_ms(
                    plan, args.heads, args.kv_heads, args.head_dim, args.measure_repeats
                )
                measured.append((float(ms.max() / ms.mean()), float(ms.max()), float(ms.mean())))
        entry = summarise(rows)
        if strategy == "adaptive":
            entry["per_document_share"] = float(np.mean([c == "per_document" for c in chosen]))
            entry["hybrid_share"] = float(np.mean([c == "hybrid" for c in chosen]))
        if args.measure:
            ratio, top, mean = np.reshape(measured, (-1, 3)).T
            entry["measured_micro_batches"] = len(measured)
            entry["measured_max_ms"] = float(np.mean(top))
            entry["measured_mean_ms"] = float(np.mean(mean))
            entry["measured_imbalance"] = float(np.mean(ratio))
            imb = [r["flops_imbalance"] for r in rows[: len(measured)]]
            entry["flops_imbalance_measured_subset"] = float(np.mean(imb))
        results[strategy] = entry
    for name in torch_lb.TORCH_BALANCERS if args.torch_balancers else ():
        assignments = [
            torch_lb.torch_assignment(name, m, args.cp, repeats=args.plan_repeats)
            for m in micro_batches
        ]
        results[name] = summarise([stats(a, i) for i, a in enumerate(assignments)])
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
        "small_chunk_tokens": torch_lb.SMALL_CHUNK,
        "hybrid_max_len_mean": float(np.mean(short)),
    }
    return results


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.cp_bench", __doc__)
    p.add_argument("--lengths", default=None, help="JSON list / .npy / text file of doc lengths")
    p.add_argument("--generator", default="longtail_scaled", choices=list(GENERATORS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-len", type=int, default=131072)
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--hybrid-max-len", type=int, default=0, help="hybrid's threshold; 0: auto")
    p.add_argument("--profile", default=None, help="CP profile JSON (default: packaged CPU table)")
    p.add_argument("--plan-repeats", type=int, default=5, help="timings per micro-batch plan")
    p.add_argument("--measure", action="store_true", help="time every rank's local attention")
    p.add_argument("--measure-micro-batches", type=int, default=4, help="micro-batches measured")
    p.add_argument("--measure-repeats", type=int, default=5, help="rounds per rank (fastest kept)")
    p.add_argument("--heads", type=int, default=2, help="query heads for --measure")
    p.add_argument("--kv-heads", type=int, default=1, help="KV heads (--measure, K/V bytes)")
    p.add_argument("--head-dim", type=int, default=16, help="head dim (--measure, K/V bytes)")
    p.add_argument("--kv-dtype-bytes", type=int, default=2, help="bytes per K/V element")
    p.add_argument("--no-torch-balancers", dest="torch_balancers", action="store_false")
    p.add_argument("--json", action="store_true", help="print the JSON result last")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    require_at_least(p, args, ("context_len", "cp", "micro_batches", "plan_repeats"))
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
    for name, r in results.items():
        if name != "config":
            shown = " ".join(f"{key}={r[key]:{f}}" for key, f in SHOWN.items() if key in r)
            print(f"{name:18s} {shown}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
