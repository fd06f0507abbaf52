"""Compare CP sharding strategies (and torch's own load balancers) on packed micro-batches:
FLOPs and token balance, K/V gathered, small chunks, plan time; ``--measure`` also times every
rank's local attention on this machine (CPU, or one GPU with ``--device cuda``, each rank in turn)
and, with per-sequence, per-document and adaptive all measured, the paper's Figure 15 comparison.

    python -m torchtitan_wlb.tools.cp_bench --generator longtail_scaled --context-len 131072 \\
        --cp 8 --micro-batches 16 --json
    python -m torchtitan_wlb.tools.cp_bench --generator short --context-len 8192 --cp 2 \\
        --micro-batches 4 --measure --json
    python -m torchtitan_wlb.tools.cp_bench --generator longtail_scaled --context-len 131072 \\
        --cp 4 --packer wlb --micro-batches 8 --measure --measure-micro-batches 16 \\
        --device cuda --heads 32 --kv-heads 8 --head-dim 128 --json   # gpu

What is measured and every JSON key: docs/benchmarks_cp.md.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.cp.adaptive import ADAPTIVE_CANDIDATES, build_cp_plan
from torchtitan_wlb.cp.plan import CPPlan
from torchtitan_wlb.cp.profile import CPProfile, resolve_profile
from torchtitan_wlb.models.catalogue import MODELS, get_model
from torchtitan_wlb.packing import OriginalPacker, PackingConfig, build_packer, packing_config
from torchtitan_wlb.packing.driver import LengthStream, drive, next_plan
from torchtitan_wlb.tools import torch_balancers
from torchtitan_wlb.tools.cli import ToolParser, json_text, require_at_least
from torchtitan_wlb.tools.cp_calls import call_breakdown, elapsed_ms, rank_tensors
from torchtitan_wlb.workloads import GENERATORS, generate, load_lengths, split_long

STRATEGY_NAMES = ("per_sequence", "per_document", "hybrid", "adaptive")
FIGURE15 = ("per_sequence", "per_document", "adaptive")
"""The strategies the paper's Figure 15 compares: ``results["figure15"]`` needs all measured."""
PACKER_NAMES = ("original", "wlb")
DTYPES = ("float32", "bfloat16", "float16")
SHOWN = {  # a result's text line: these JSON keys where it has them, in this format
    "flops_imbalance": ".4f",
    "token_imbalance": ".4f",
    "kv_gather_bytes": ".3g",
    "small_chunks": ".1f",
    "plan_ms": ".3f",
    "per_document_share": ".2f",
    "hybrid_share": ".2f",
    "measured_imbalance": ".4f",
    "flops_imbalance_measured_subset": ".4f",
    "measured_max_ms": ".1f",
    "measured_mean_ms": ".1f",
    "adaptive_vs_per_sequence": ".4f",
    "adaptive_vs_per_document": ".4f",
    "oracle_ms": ".1f",
    "adaptive_over_oracle": ".4f",
    "adaptive_choice_agreement": ".2f",
}
LAYOUT_FIELDS = (
    "doc_lens",
    "seg_doc",
    "seg_start",
    "seg_len",
    "seg_slot",
    "slot_order",
    "local_lens",
    "seg_local_offset",
    "gather_lens",
    "doc_gathered",
)
"""The :class:`CPPlan` arrays that fix every rank's local attention problem."""


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


def pack_wlb_micro_batches(
    lens: np.ndarray, context_len: int, micro_batches: int, cost_model: CostModel, steps: int = 1
) -> list[np.ndarray]:
    """The non-empty micro-batches of the first ``steps`` steps of ``micro_batches`` that the
    ``wlb`` packer emits (whole documents, S_max its default 1.25 x context): what WLB-LLM's own
    packing hands to CP, the inputs of the paper's Figure 15."""
    lens = split_long(lens, context_len)
    packer = build_packer("wlb", packing_config("wlb", micro_batches, context_len), cost_model)
    if int(lens.sum()) < steps * packer.tokens_wanted():
        raise ValueError(
            f"{int(lens.sum())} tokens of documents cannot fill {steps} steps of {micro_batches} "
            f"micro-batches of {context_len} tokens"
        )
    stream = LengthStream(lens, end_of_data=False)  # a sample of the data: never flushed
    return [np.asarray(x) for step in drive(packer, stream, steps) for x in step.doc_lens if len(x)]


def packed_steps(args: argparse.Namespace) -> int:
    """Packer steps taken: one, except that ``--packer wlb --measure`` takes enough steps of
    ``--micro-batches`` for ``--measure-micro-batches`` (original keeps its single step)."""
    if args.packer != "wlb" or not args.measure:
        return 1
    return max(1, math.ceil(args.measure_micro_batches / args.micro_batches))


def pack(args: argparse.Namespace, lens: np.ndarray) -> list[np.ndarray]:
    """The micro-batches of ``--packer``; ``wlb`` balances with ``--model``'s cost model at
    ``--cp`` (per GPU), as pack_bench does."""
    if args.packer == "original":
        return pack_micro_batches(lens, args.context_len, args.micro_batches)
    cost_model = CostModel.from_model_dims(**get_model(args.model).dims(), cp=args.cp)
    steps = packed_steps(args)
    return pack_wlb_micro_batches(lens, args.context_len, args.micro_batches, cost_model, steps)


def _rank_step(
    plan: CPPlan,
    rank: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    backend: str = "cpu",
) -> Callable[[], object]:
    """A closure running ``rank``'s local attention forward + backward on random tensors. On CPU
    ``.sum().backward()`` (the method of the CPU figures); on CUDA fresh gradients against a
    random output gradient, as in training: accumulating into ``.grad`` and the broadcast ones
    gradient would add memory-bound kernels that are no part of attention."""
    import torch

    from torchtitan_wlb.cp.op import _local_attention

    tensors, cus, sizes, grad = rank_tensors(plan, rank, heads, kv_heads, head_dim, device, dtype)

    def forward() -> torch.Tensor:
        return _local_attention(*tensors, cus, sizes, head_dim**-0.5, backend)

    if torch.device(device).type == "cpu":
        return lambda: forward().sum().backward()
    return lambda: torch.autograd.grad(forward(), tensors, grad, allow_unused=True)


def measure_backend(device: str) -> str:
    """The attention backend ``--measure`` uses: the CPU one on CPU, else what ``"auto"`` resolves
    to (flash-attn, then torch's varlen kernel), as training would run."""
    import torch

    from torchtitan_wlb.attention import resolve_backend

    dev = torch.device(device)
    return resolve_backend("cpu" if dev.type == "cpu" else "auto", dev)


def measure_ranks_ms(
    plan: CPPlan,
    heads: int,
    kv_heads: int,
    head_dim: int,
    repeats: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
) -> np.ndarray:
    """Per-rank forward + backward time (ms) of the local attention over ``repeats`` round-robin
    rounds after one warm-up each. CPU: CPU time (one thread), fastest round, so that other
    processes on the cores do not inflate one rank. CUDA: every rank in turn on the one device,
    synchronised wall time, median round (how ``cp_profile`` times the table adaptive predicts
    from)."""
    import torch

    backend = measure_backend(device)
    steps = [
        _rank_step(plan, r, heads, kv_heads, head_dim, device=device, dtype=dtype, backend=backend)
        for r in range(plan.cp_degree)
    ]
    cuda = torch.device(device).type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else None
    for step in steps:
        step()  # warm-up (kernel selection, allocator)
    rounds = np.array([[elapsed_ms(step, sync) for step in steps] for _ in range(repeats)])
    return np.median(rounds, axis=0) if cuda else rounds.min(axis=0)


def same_layout(a: CPPlan, b: CPPlan) -> bool:
    """Whether two plans give every rank the same local attention problem (:data:`LAYOUT_FIELDS`
    equal): adaptive's plan is one of the fixed strategies' drafts, so its measured time is that
    strategy's, and a choice between identical plans is the same problem."""
    return all(np.array_equal(getattr(a, name), getattr(b, name)) for name in LAYOUT_FIELDS)


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


def measured_summary(rank_ms: list[np.ndarray], rows: list[dict]) -> dict:
    """One strategy's ``measured_*`` keys from its measured micro-batches' per-rank times
    (``measured_max_ms``: the mean over them of the slowest rank, a CP step's attention time)."""
    top = np.array([ms.max() for ms in rank_ms])
    mean = np.array([ms.mean() for ms in rank_ms])
    imb = [r["flops_imbalance"] for r in rows[: len(rank_ms)]]
    return {
        "measured_micro_batches": len(rank_ms),
        "measured_max_ms": float(np.mean(top)),
        "measured_mean_ms": float(np.mean(mean)),
        "measured_imbalance": float(np.mean(top / mean)),
        "flops_imbalance_measured_subset": float(np.mean(imb)),
    }


def figure15(
    step_ms: dict[str, np.ndarray],
    chosen: list[str],
    equivalent: list[set[str]],
    candidates: Sequence[str],
) -> dict:
    """The paper's Figure 15 from measured slowest-rank times (``step_ms``: per strategy, one
    value per measured micro-batch): adaptive's saving over per-sequence and per-document, the
    oracle (the faster measured candidate of every micro-batch) and how often adaptive's
    predicted choice (``chosen``) was the measured-fastest one; a choice counts as right when the
    fastest plan is identical to it (``equivalent``: the candidates with the chosen plan)."""
    total = {name: float(ms.sum()) for name, ms in step_ms.items()}
    by_candidate = np.stack([step_ms[name] for name in candidates])
    oracle = float(by_candidate.min(axis=0).sum())
    fastest = [candidates[j] for j in by_candidate.argmin(axis=0)]  # ties: the earlier, as adaptive
    agree = [f in same for f, same in zip(fastest, equivalent, strict=True)]
    return {
        "measured_micro_batches": len(chosen),
        "adaptive_vs_per_sequence": 1.0 - total["adaptive"] / total["per_sequence"],
        "adaptive_vs_per_document": 1.0 - total["adaptive"] / total["per_document"],
        "oracle_ms": oracle,
        "adaptive_over_oracle": total["adaptive"] / oracle - 1.0,
        "adaptive_choice_agreement": float(np.mean(agree)),
        "total_ms": total,
        "candidates": list(candidates),
        "chosen": chosen,
        "measured_fastest": fastest,
        "step_ms": {name: ms.tolist() for name, ms in step_ms.items()},
    }


def _lengths(args: argparse.Namespace) -> np.ndarray:
    """``--lengths``, or the generator's lengths until they hold 1.5 x the packed steps' tokens."""

    def sample(seed: int) -> np.ndarray:
        return generate(args.generator, 4096, args.context_len, seed=seed)

    if args.lengths:
        return load_lengths(args.lengths)
    lens = sample(args.seed)
    while lens.sum() < packed_steps(args) * args.micro_batches * args.context_len * 1.5:
        lens = np.concatenate([lens, sample(args.seed + len(lens))])
    return lens


def _timed_plan(
    doc_lens: np.ndarray, strategy: str, args: argparse.Namespace, profile: CPProfile
) -> tuple[CPPlan, list[float]]:
    """A micro-batch's plan and ``--plan-repeats`` wall times (ms) of what one rank does per
    micro-batch: the plan, its own index arrays, the op's ``kv_order`` and attention spec."""
    times = []
    for _ in range(args.plan_repeats):
        start = time.perf_counter()
        plan = build_cp_plan(
            doc_lens,
            args.cp,
            strategy,
            profile,
            hybrid_max_len=args.hybrid_max_len,
            candidates=args.adaptive_candidates,
        )
        plan.rank_indices(0)  # what a rank does per micro-batch: its index arrays
        plan.kv_order()  # and the op's
        plan.local_attention_spec(0)
        times.append((time.perf_counter() - start) * 1e3)
    return plan, times


def _rank_times(
    plan: CPPlan, i: int, args: argparse.Namespace, plans: dict, rank_ms: dict
) -> np.ndarray:
    """Micro-batch ``i``'s per-rank times under ``plan``: measured for a fixed strategy; for
    adaptive the measured times of the fixed plan it chose (the same plan: checked), so that
    predicted and measured choices compare exactly and no measurement runs twice."""
    if plan.requested != "adaptive":
        return measure_ranks_ms(
            plan,
            args.heads,
            args.kv_heads,
            args.head_dim,
            args.measure_repeats,
            device=args.device,
            dtype=args.dtype,
        )
    if not same_layout(plan, plans[plan.strategy][i]):
        raise RuntimeError(
            f"adaptive's plan of micro-batch {i} differs from the {plan.strategy} plan it chose"
        )
    return rank_ms[plan.strategy][i]


def run(args: argparse.Namespace) -> dict:
    lens = _lengths(args)
    micro_batches = pack(args, lens)
    profile = resolve_profile(args.profile)
    results: dict = {}
    kv_bytes = 2 * args.kv_heads * args.head_dim * args.kv_dtype_bytes  # K and V, one layer
    # hybrid's whole-document threshold of every micro-batch (automatic per micro-batch unless
    # --hybrid-max-len): small chunks of documents up to it are what hybrid avoids
    max_len = args.hybrid_max_len
    short = [
        build_cp_plan(m, args.cp, "hybrid", hybrid_max_len=max_len).max_len for m in micro_batches
    ]

    def stats(assignment: torch_balancers.Assignment, i: int) -> dict:
        return torch_balancers.assignment_stats(assignment, kv_bytes, short_doc_len=short[i])

    n_measured = min(len(micro_batches), args.measure_micro_batches) if args.measure else 0
    plans: dict[str, list[CPPlan]] = {}  # the measured micro-batches' plans, per strategy
    rank_ms: dict[str, list[np.ndarray]] = {}  # and their per-rank times
    for strategy in STRATEGY_NAMES:
        rows, chosen = [], []
        plans[strategy], rank_ms[strategy] = [], []
        for i, doc_lens in enumerate(micro_batches):
            plan, times = _timed_plan(doc_lens, strategy, args, profile)
            rows.append(  # the assignment's flops_imbalance is the plan's (same causal pairs)
                stats(torch_balancers.plan_assignment(plan), i)
                | {
                    "plan_ms": float(np.median(times)),
                    "plan_ms_min": float(np.min(times)),
                    "estimated_max_rank_ms": profile.estimate_plan_seconds(plan) * 1e3,
                }
            )
            chosen.append(plan.strategy)
            if i < n_measured:
                plans[strategy].append(plan)
                rank_ms[strategy].append(_rank_times(plan, i, args, plans, rank_ms))
        entry = summarise(rows)
        if strategy == "adaptive":
            entry["per_document_share"] = float(np.mean([c == "per_document" for c in chosen]))
            entry["hybrid_share"] = float(np.mean([c == "hybrid" for c in chosen]))
        if args.measure:
            entry |= measured_summary(rank_ms[strategy], rows)
        results[strategy] = entry
    for name in torch_balancers.TORCH_BALANCERS if args.torch_balancers else ():
        assignments = [
            torch_balancers.torch_assignment(name, m, args.cp, repeats=args.plan_repeats)
            for m in micro_batches
        ]
        results[name] = summarise([stats(a, i) for i, a in enumerate(assignments)])
    if n_measured and all(rank_ms[name] for name in FIGURE15):
        results["figure15"] = _figure15(plans, rank_ms, args.adaptive_candidates)
    if n_measured and args.call_breakdown:  # the fixed strategies (adaptive picks among them)
        fixed = {name: plans[name] for name in STRATEGY_NAMES if name != "adaptive"}
        shape = (args.heads, args.kv_heads, args.head_dim)
        results["call_breakdown"] = call_breakdown(
            fixed,
            profile,
            shape,
            args.measure_repeats,
            args.device,
            args.dtype,
            measure_backend(args.device),
        )
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
        "small_chunk_tokens": torch_balancers.SMALL_CHUNK,
        "hybrid_max_len_mean": float(np.mean(short)),
    } | _config_extra(args)
    return results


def _figure15(plans: dict, rank_ms: dict, candidates: Sequence[str]) -> dict:
    """:func:`figure15` from every strategy's measured plans and per-rank times."""
    step_ms = {name: np.array([ms.max() for ms in rank_ms[name]]) for name in STRATEGY_NAMES}
    chosen = [plan.strategy for plan in plans["adaptive"]]
    equivalent = [
        {name for name in candidates if same_layout(plans[name][i], plan)}
        for i, plan in enumerate(plans["adaptive"])
    ]
    return figure15(step_ms, chosen, equivalent, candidates)


def _config_extra(args: argparse.Namespace) -> dict:
    """The ``config`` keys of the packer, adaptive's candidates and ``--measure``'s device."""
    extra: dict = {"packer": args.packer, "packed_steps": packed_steps(args)}
    if args.packer == "wlb":
        extra["packer_model"] = args.model
    extra["adaptive_candidates"] = list(args.adaptive_candidates)
    if args.measure:
        extra |= {"measure_device": args.device, "measure_dtype": args.dtype}
        extra["measure_backend"] = measure_backend(args.device)
    return extra


def _device(text: str) -> str:
    """argparse type of ``--device``: ``cpu``, ``cuda`` or ``cuda:N``."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _model(text: str) -> str:
    """argparse type of ``--model``: a catalogue name in any case."""
    try:
        return get_model(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _candidates(text: str) -> tuple[str, ...]:
    """argparse type of ``--adaptive-candidates``: comma-separated fixed strategies."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or any(name not in ADAPTIVE_CANDIDATES for name in names):
        accepted = ",".join(ADAPTIVE_CANDIDATES)
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {accepted}, got {text!r}"
        )
    return names


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.cp_bench", __doc__)
    p.add_argument("--lengths", default=None, help="JSON list / .npy / text file of doc lengths")
    p.add_argument("--generator", default="longtail_scaled", choices=list(GENERATORS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-len", type=int, default=131072)
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=16, help="N: micro-batches per step")
    p.add_argument("--packer", choices=PACKER_NAMES, default="original", help="micro-batches of")
    p.add_argument(
        "--model", type=_model, default="7B", help=f"wlb's cost model: {', '.join(MODELS)}"
    )
    p.add_argument("--hybrid-max-len", type=int, default=0, help="hybrid's threshold; 0: auto")
    p.add_argument("--profile", default=None, help="CP profile JSON (default: packaged CPU table)")
    p.add_argument(
        "--adaptive-candidates",
        type=_candidates,
        default=ADAPTIVE_CANDIDATES,
        help="what adaptive chooses among (the paper's: per_sequence,per_document)",
    )
    p.add_argument("--plan-repeats", type=int, default=5, help="timings per micro-batch plan")
    p.add_argument("--measure", action="store_true", help="time every rank's local attention")
    p.add_argument("--measure-micro-batches", type=int, default=4, help="micro-batches measured")
    p.add_argument(
        "--measure-repeats",
        type=int,
        default=5,
        help="rounds per rank (cpu: fastest, cuda: median)",
    )
    p.add_argument(
        "--call-breakdown",
        action="store_true",
        help="--measure: also time each rank's varlen calls alone beside their prediction",
    )
    p.add_argument("--device", type=_device, default="cpu", help="--measure on: cpu, cuda[:N]")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="--measure: cpu fp32, cuda bf16")
    p.add_argument("--heads", type=int, default=2, help="query heads for --measure")
    p.add_argument("--kv-heads", type=int, default=1, help="KV heads (--measure, K/V bytes)")
    p.add_argument("--head-dim", type=int, default=16, help="head dim (--measure, K/V bytes)")
    p.add_argument("--kv-dtype-bytes", type=int, default=2, help="bytes per K/V element")
    p.add_argument("--no-torch-balancers", dest="torch_balancers", action="store_false")
    p.add_argument("--json", action="store_true", help="print the JSON result last")
    return p


def check_device(p: argparse.ArgumentParser, device: str) -> None:
    """``p.error`` unless this torch can run on ``device`` (before any work starts)."""
    import torch

    if device == "cpu":
        return
    if not torch.cuda.is_available():
        p.error(f"--device {device}: this torch ({torch.__version__}) sees no CUDA device")
    index, count = torch.device(device).index, torch.cuda.device_count()
    if index is not None and index >= count:
        p.error(
            f"--device {device}: this machine has {count} CUDA device(s), cuda:0 .. cuda:{count - 1}"
        )


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    require_at_least(p, args, ("context_len", "cp", "micro_batches", "plan_repeats"))
    if args.measure:
        require_at_least(p, args, ("measure_micro_batches", "measure_repeats"))
    elif args.call_breakdown:
        p.error("--call-breakdown times the measured micro-batches' calls: add --measure")
    if args.hybrid_max_len < 0:
        p.error(f"--hybrid-max-len = {args.hybrid_max_len} must be >= 0 (0: automatic)")
    check_device(p, args.device)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    import torch

    threads = torch.get_num_threads()
    if args.measure and args.device == "cpu":
        torch.set_num_threads(1)  # CPU time of one thread = the kernel's work
    try:
        results = run(args)
    except (ValueError, OSError) as exc:  # a bad lengths or profile file: one line
        p.error(str(exc))
    except RuntimeError as exc:  # e.g. CUDA out of memory, an unusable kernel: its first line
        p.error(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    finally:
        torch.set_num_threads(threads)
    for name, r in results.items():
        if name != "config":
            shown = " ".join(f"{key}={r[key]:{f}}" for key, f in SHOWN.items() if key in r)
            print(f"{name:18s} {shown}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json_text(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
