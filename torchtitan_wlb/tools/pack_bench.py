"""Packing benchmark: balance, delay and overhead of a packer on a document-length workload.

    python -m torchtitan_wlb.tools.pack_bench --generator longtail --context-len 131072 \\
        --micro-batches 8 --packer wlb --steps 100 --json
    python -m torchtitan_wlb.tools.pack_bench --generator longtail --context-len 131072 \\
        --micro-batches 8 --packer fixed_greedy --window 4 --steps 200 --json
    python -m torchtitan_wlb.tools.pack_bench --generator longtail --table2

``--lengths FILE`` takes your own documents instead of a generator: FILE is a JSON list of token counts, a ``.npy`` array, or one integer per line. Documents longer
than ``--max-doc-len`` (default: the packer's micro-batch cap) are split into pieces first, as the
loader does, and counted. The last line printed is one JSON object (with ``--json``) holding
``packer, micro_batches, steps, imbalance`` (mean over steps), ``overhead_ms`` (median per global
batch), ``avg_delay_iters`` (token-weighted), ``max_tokens_per_microbatch``, ``tokens_in`` and
``tokens_out`` (after the final flush; equal unless documents were lost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import fields, replace
from typing import Any

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.models.catalogue import MODELS, get_model
from torchtitan_wlb.packing import (
    PACKERS,
    LengthStream,
    PackingConfig,
    build_packer,
    drain,
    drive,
    packing_config,
)
from torchtitan_wlb.packing.tuning import tune_queues
from torchtitan_wlb.tools.cli import ToolParser, progress
from torchtitan_wlb.workloads import (
    DEFAULT_NUM_DOCS,
    GENERATORS,
    generate,
    load_lengths,
    split_long,
)

# The paper's Table 2 (7B, 128K context): (method, config, imbalance, overhead).
PAPER_TABLE2 = [
    ("original", "-", 1.44, "0 ms"),
    ("fixed_greedy", "G=1", 1.41, "4-5 ms"),
    ("fixed_greedy", "G=2", 1.22, "4-5 ms"),
    ("fixed_greedy", "G=4", 1.11, "4-5 ms"),
    ("fixed_greedy", "G=8", 1.08, "4-5 ms"),
    ("solver", "G=1", 1.40, "467 ms"),
    ("solver", "G=2", 1.18, "1.5 s"),
    ("solver", "G=4", 1.09, "25 s"),
    ("wlb_paper", "1 queue", 1.24, "8 ms"),
    ("wlb_paper", "2 queues", 1.05, "20 ms"),
    ("wlb_paper", "3 queues", 1.05, "23 ms"),
    ("wlb", "3 queues", None, "-"),
]


def build_cost_model(args: argparse.Namespace) -> CostModel:
    if args.profile:
        return CostModel.from_profile(args.profile)
    if args.attn_coef is not None or args.linear_coef is not None:
        if args.attn_coef is None or args.linear_coef is None:
            raise ValueError("--attn-coef and --linear-coef must be given together")
        return CostModel.from_coefficients(args.attn_coef, args.linear_coef)
    return CostModel.from_model_dims(**get_model(args.model).dims(), tp=args.tp, cp=args.cp)


def run(
    packer_name: str,
    lengths: np.ndarray,
    config: PackingConfig,
    cost_model: CostModel,
    steps: int,
) -> dict[str, Any]:
    """Drive one packer over ``steps`` global batches plus the final flush; return the summary."""
    packer = build_packer(packer_name, config, cost_model)
    stream = LengthStream(lengths)
    main = list(drive(packer, stream, steps))
    # Flush: what is still queued or carried after the S steps is emitted and counted.
    flushed = list(drain(packer))
    plans = main + flushed
    per_step = [plan.stats for plan in main]
    tokens_out = sum(int(x.sum()) for plan in plans for x in plan.doc_lens)
    emitted = sum(x.size for plan in plans for x in plan.doc_ids)
    max_mb_tokens = max((plan.stats["max_tokens"] for plan in plans), default=0)
    flush_steps = len(flushed)
    tokens_in = int(lengths[: stream.pos].sum())
    n_tok = sum(s["tokens"] for s in per_step)
    ms = [s["pack_ms"] for s in per_step]
    if config.window > 1 and packer_name in ("fixed_greedy", "solver"):
        g = config.window  # one plan per window of G steps: amortise it over the window
        ms = [sum(ms[i : i + g]) / g for i in range(0, len(ms), g)]
    return {
        "packer": packer_name,
        "micro_batches": config.micro_batches,
        "steps": len(per_step),
        "imbalance": float(np.mean([s["imbalance"] for s in per_step])) if per_step else 1.0,
        "imbalance_p95": float(np.percentile([s["imbalance"] for s in per_step], 95))
        if per_step
        else 1.0,
        "overhead_ms": float(statistics.median(ms)) if ms else 0.0,
        "avg_delay_iters": float(sum(s["mean_delay"] * s["tokens"] for s in per_step) / n_tok)
        if n_tok
        else 0.0,
        "max_delay_iters": max((s["max_delay"] for s in per_step), default=0),
        "max_tokens_per_microbatch": int(max_mb_tokens),
        "tokens_in": tokens_in,
        "tokens_out": int(tokens_out),
        "docs_in": stream.pos,
        "docs_out": int(emitted),
        "flush_steps": flush_steps,
        "context_len": config.context_len,
        "smax": packer.cap,
        "window": config.window,
        "max_wait": config.max_wait,
        "final_wait": getattr(packer, "k_eff", config.max_wait),
        "queues": [int(x) for x in getattr(packer, "thresholds", [])],
    }


# The flags named after PackingConfig fields (argparse dest = field name), defaults from it.
DEFAULTS = {f.name: f.default for f in fields(PackingConfig)}
KNOBS = (
    "max_wait",
    "window",
    "solver_time_limit",
    "balance_target",
    "release_slack",
    "adaptive_max_wait",
    "delay_target",
)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {v}")
    return v


def _model_name(text: str) -> str:
    """A catalogue model name in any case; "8b", this tool's name for Llama 3 8B, still works."""
    name = "llama3_8B" if text.strip().lower() == "8b" else text
    try:
        return get_model(name).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _queues(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--queues expects comma-separated integers, got {text!r}"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError("--queues needs at least one threshold")
    return out


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.pack_bench", __doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="JSON list / .npy / one integer per line of doc lengths")
    src.add_argument("--generator", choices=list(GENERATORS), help="built-in synthetic workload")
    p.add_argument(
        "--num-docs", type=_positive_int, default=DEFAULT_NUM_DOCS, help="docs to generate"
    )
    p.add_argument("--seed", type=_nonneg_int, default=0, help="generator seed")
    p.add_argument("--context-len", type=_positive_int, default=131072)
    p.add_argument("--micro-batches", type=_positive_int, default=4, help="N per step")
    p.add_argument("--packer", choices=PACKERS, default="wlb")
    p.add_argument("--steps", type=_positive_int, default=100)
    p.add_argument("--queues", type=_queues, default=None, help="thresholds, e.g. 32768,65536")
    p.add_argument("--smax", type=_positive_int, default=None, help="micro-batch token cap")
    p.add_argument(
        "--max-wait", type=_nonneg_int, default=DEFAULTS["max_wait"], help="K: max steps in a queue"
    )
    p.add_argument(
        "--window", type=_positive_int, default=DEFAULTS["window"], help="G for fixed_greedy/solver"
    )
    p.add_argument(
        "--solver-time-limit",
        type=float,
        default=DEFAULTS["solver_time_limit"],
        help="seconds per window",
    )
    p.add_argument(
        "--balance-target",
        type=float,
        default=DEFAULTS["balance_target"],
        help="wlb release target",
    )
    p.add_argument(
        "--release-slack",
        type=float,
        default=DEFAULTS["release_slack"],
        help="wlb: target growth with age / K",
    )
    p.add_argument(
        "--adaptive-max-wait",
        type=_nonneg_int,
        default=DEFAULTS["adaptive_max_wait"],
        help="wlb: K may grow up to this while the delay is under --delay-target (<= K: fixed K)",
    )
    p.add_argument(
        "--delay-target",
        type=float,
        default=DEFAULTS["delay_target"],
        help="wlb: adaptive K's target",
    )
    p.add_argument(
        "--max-doc-len",
        type=_positive_int,
        default=None,
        help="split longer documents into pieces (default: the context length)",
    )
    p.add_argument(
        "--model",
        type=_model_name,
        default="7B",
        help=f"analytic cost model of a catalogue model: {', '.join(MODELS)} (any case)",
    )
    p.add_argument("--tp", type=_positive_int, default=1)
    p.add_argument("--cp", type=_positive_int, default=1)
    p.add_argument("--attn-coef", type=float, default=None)
    p.add_argument("--linear-coef", type=float, default=None)
    p.add_argument("--profile", default=None, help="JSON (length, seconds) table")
    p.add_argument("--table2", action="store_true", help="print the paper's Table 2 comparison")
    p.add_argument("--solver-steps", type=_positive_int, default=8, help="steps for solver rows")
    p.add_argument(
        "--solver-gap",
        type=_nonneg_int,
        default=0,
        help="also re-solve wlb's first STEPS steps exactly (HiGHS) and report wlb / optimum",
    )
    p.add_argument(
        "--tune",
        type=_fraction,
        default=None,
        help="choose queues and K on this fraction of the documents (the tail), run on the rest",
    )
    p.add_argument(
        "--delay-budget", type=float, default=0.5, help="--tune: max token-weighted mean delay"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    return p


def _config(args: argparse.Namespace, packer: str, **over: Any) -> PackingConfig:
    knobs: dict[str, Any] = {k: getattr(args, k) for k in KNOBS}
    knobs.update(smax=args.smax, queue_thresholds=args.queues)
    knobs.update(over)
    return packing_config(packer, args.micro_batches, args.context_len, **knobs)


def _prepare(args: argparse.Namespace, cap: int) -> tuple[np.ndarray, int]:
    if args.lengths:
        try:
            lengths = load_lengths(args.lengths)
        except ValueError as exc:
            raise ValueError(f"--lengths: {exc}") from None
    else:
        lengths = generate(args.generator, args.num_docs, args.context_len, args.seed)
    max_len = args.max_doc_len or min(cap, args.context_len)
    if max_len > cap:
        raise ValueError(f"--max-doc-len {max_len} exceeds the micro-batch cap {cap}")
    return split_long(lengths, max_len), int((lengths > max_len).sum())


def table2(args: argparse.Namespace, cost_model: CostModel) -> list[dict[str, Any]]:
    """Every Table 2 method and configuration on the same workload, beside the paper's figures."""
    lengths, n_split = _prepare(args, args.context_len)
    ctx = args.context_len
    rows = []
    paper_q = {1: (ctx // 2,), 2: (ctx // 4, ctx // 2), 3: (ctx // 8, ctx // 4, ctx // 2)}
    bar = progress(PAPER_TABLE2, desc="table 2", unit="row")
    for method, cfg, paper_imb, paper_ms in bar:
        bar.set_postfix_str(f"{method} {cfg}")
        over: dict[str, Any] = {}
        steps = args.steps
        if cfg.startswith("G="):
            over["window"] = int(cfg[2:])
        if method == "solver":
            steps = args.solver_steps * over["window"]
        if method.startswith("wlb"):
            over["queue_thresholds"] = args.queues or paper_q[int(cfg.split()[0])]
        res = run(method, lengths, _config(args, method, **over), cost_model, steps)
        res.update(config=cfg, paper_imbalance=paper_imb, paper_overhead=paper_ms)
        res["docs_split"] = n_split
        rows.append(res)
        bar.write(
            f"{method:13s} {cfg:9s} imbalance {res['imbalance']:.3f} "
            f"(paper {paper_imb if paper_imb is not None else '-'})  "
            f"overhead {res['overhead_ms']:8.2f} ms (paper {paper_ms})  "
            f"delay {res['avg_delay_iters']:.2f}",
            file=sys.stdout,
        )
    return rows


def solver_gap(
    lengths: np.ndarray, config: PackingConfig, cost_model: CostModel, steps: int, limit: float
) -> dict[str, Any]:
    """Re-solve the documents ``wlb`` emitted in each of its first ``steps`` steps exactly.

    Same documents, same N, same S_max: the ratio of wlb's heaviest micro-batch to the optimum
    isolates the placement quality from the release decisions. Windows the solver does not
    finish within ``limit`` seconds are reported against its proven lower bound.
    """
    from torchtitan_wlb.packing.solver import solve_minmax

    packer = build_packer("wlb", config, cost_model)
    ratios, bound_ratios, solved = [], [], 0
    for plan in drive(packer, LengthStream(lengths), steps):
        lens = np.concatenate(plan.doc_lens)
        mine = plan.stats["max_workload"]
        if lens.size == 0:  # everything queued this step: nothing to compare
            continue
        res = solve_minmax(lens, config.micro_batches, packer.cap, cost_model, limit)
        if res.optimal:
            solved += 1
            ratios.append(mine / res.max_load)
        bound_ratios.append(mine / res.lower_bound)
    return {
        "gap_steps": steps,
        "gap_solved": solved,
        "gap_mean_wlb_over_opt": float(np.mean(ratios)) if ratios else None,
        "gap_max_wlb_over_opt": float(np.max(ratios)) if ratios else None,
        "gap_mean_wlb_over_bound": float(np.mean(bound_ratios)) if bound_ratios else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        cost_model = build_cost_model(args)
        if args.table2:
            rows = table2(args, cost_model)
            if args.json:
                print(json.dumps({"table2": rows}))
            return 0
        config = _config(args, args.packer)
        packer = build_packer(args.packer, config, cost_model)
        lengths, n_split = _prepare(args, packer.cap)
        tuned = None
        if args.tune:
            if args.packer not in ("wlb", "wlb_paper"):
                raise ValueError(
                    "--tune chooses queue thresholds and K: use --packer wlb or wlb_paper"
                )
            # Tune on the held-out tail of the document list, evaluate on the rest.
            cut = int(round(lengths.size * (1 - args.tune)))
            if cut < 1 or cut >= lengths.size:
                raise ValueError(f"--tune {args.tune} leaves no documents to tune or to evaluate")
            tuned = tune_queues(
                lengths[cut:],
                config,
                cost_model,
                packer=args.packer,
                delay_budget=args.delay_budget,
            )
            config = replace(
                config, queue_thresholds=tuned.queue_thresholds, max_wait=tuned.max_wait
            )
            lengths = lengths[:cut]
        res = run(args.packer, lengths, config, cost_model, args.steps)
        res["docs_split"] = n_split
        res["break_even_length"] = cost_model.break_even_length
        if tuned is not None:
            res["tuned_on_docs"] = int(round(len(lengths) * args.tune / (1 - args.tune)))
            res["tuned_sample_imbalance"] = tuned.imbalance
            res["tuned_sample_delay"] = tuned.mean_delay
        if args.solver_gap:
            if args.packer != "wlb":
                raise ValueError(
                    "--solver-gap compares the wlb packer with the optimum: use --packer wlb"
                )
            res.update(
                solver_gap(lengths, config, cost_model, args.solver_gap, args.solver_time_limit)
            )
    except ValueError as exc:
        p.error(str(exc))
    if not args.json:
        for k, v in res.items():
            print(f"{k:28s} {v}")
    print(json.dumps(res))
    return 0 if res["tokens_in"] == res["tokens_out"] else 1


if __name__ == "__main__":
    sys.exit(main())
