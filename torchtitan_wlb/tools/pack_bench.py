"""Packing benchmark: balance, delay and overhead of a packer on a document-length workload.

    python -m torchtitan_wlb.tools.pack_bench --generator longtail --context-len 131072 \\
        --micro-batches 8 --packer wlb --steps epoch --json
    python -m torchtitan_wlb.tools.pack_bench --generator longtail --context-len 131072 \\
        --micro-batches 8 --packer fixed_greedy --window 4 --steps 200 --json
    python -m torchtitan_wlb.tools.pack_bench --generator longtail --table2

Options, ``--steps epoch`` versus a partial window, and every JSON key: docs/packing.md.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from torchtitan_wlb import workloads
from torchtitan_wlb.cost_fit import profile_cost_model
from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.data.wlb_node import TOKEN_DTYPE, WLBPackingNode
from torchtitan_wlb.models.catalogue import MODELS, get_model
from torchtitan_wlb.packing import (
    PACKERS,
    LengthStream,
    Packer,
    PackingConfig,
    build_packer,
    drain,
    drive,
    packing_config,
)
from torchtitan_wlb.packing.driver import take_until
from torchtitan_wlb.packing.paper import PAPER_TABLE2
from torchtitan_wlb.packing.tuning import DELAY_BUDGET, tune_queues
from torchtitan_wlb.tools.cli import ToolParser, json_text, progress


def build_cost_model(args: argparse.Namespace) -> CostModel:
    if args.profile:
        return profile_cost_model(args.profile)
    if args.attn_coef is not None or args.linear_coef is not None:
        if args.attn_coef is None or args.linear_coef is None:
            raise ValueError("--attn-coef and --linear-coef must be given together")
        return CostModel.from_coefficients(args.attn_coef, args.linear_coef)
    return CostModel.from_model_dims(**get_model(args.model).dims(), tp=args.tp, cp=args.cp)


class _TokenSource(BaseNode[dict]):
    """Documents as the document node yields them, without a tokenizer: views of a wrapping arena
    of ``arena_tokens`` tokens, larger than the caches (docs/packing.md)."""

    def __init__(self, lengths: np.ndarray, arena_tokens: int = 0) -> None:
        super().__init__()
        self.lengths = np.asarray(lengths, np.int64)
        longest = int(self.lengths.max()) if self.lengths.size else 1
        span = max(int(arena_tokens), 2 * longest)
        self._buffer = np.arange(span + longest, dtype=TOKEN_DTYPE)
        self._cum = np.cumsum(self.lengths)
        self._start = (self._cum - self.lengths) % span
        self._pos = 0

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._pos = int(initial_state["pos"]) if initial_state else 0

    def next(self) -> dict:
        ids, views = self.read_documents(1)
        if not ids.size:
            raise StopIteration
        return {"doc_id": int(ids[0]), "tokens": views[0]}

    def read_documents(self, min_tokens: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """The next documents until their tokens reach ``min_tokens`` (or the end)."""
        start = self._pos
        self._pos, _ = take_until(min_tokens, self._cum, start)
        lo = self._start[start : self._pos]
        hi = lo + self.lengths[start : self._pos]
        views = list(map(self._buffer.__getitem__, map(slice, lo.tolist(), hi.tolist())))
        return np.arange(start, self._pos), views

    def get_state(self) -> dict:
        return {"pos": self._pos}


def _node(packer: Packer, lengths: np.ndarray, dp: int) -> WLBPackingNode:
    """The data node on DP rank 0 of ``dp``, fed from an arena of four global batches."""
    arena = 4 * packer.config.micro_batches * packer.config.context_len
    node = WLBPackingNode(_TokenSource(lengths, arena), packer, dp_rank=0, dp_degree=dp)
    node.reset()
    return node


def node_step_ms(packer: Packer, lengths: np.ndarray, steps: int, dp: int) -> tuple[list, list]:
    """Wall and thread CPU milliseconds of every step of the data node on DP rank 0 of ``dp``."""
    node = _node(packer, lengths, dp)
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        if next(node, None) is None:
            break
        cpu.append((time.thread_time() - start_cpu) * 1e3)
        wall.append((time.perf_counter() - start) * 1e3)
    return wall, cpu


def collate_step_ms(packer: Packer, lengths: np.ndarray, steps: int, dp: int) -> list[float]:
    """Thread CPU milliseconds of collating each step's micro-batches into the model's tensors
    (what the training thread pays after the node's step), on a pass of its own so that
    ``node_step_ms`` times the node's steps back to back as before."""
    # Imported here: collate imports TorchTitan (seconds), which nothing else in this tool needs.
    from torchtitan_wlb.data.collate import collate_micro_batch

    out: list[float] = []
    for step in itertools.islice(_node(packer, lengths, dp), steps):
        start = time.thread_time()
        for mb in step["micro_batches"]:
            collate_micro_batch(mb["tokens"], mb["doc_lens"])
        out.append((time.thread_time() - start) * 1e3)
    return out


def run(
    packer_name: str,
    lengths: np.ndarray,
    config: PackingConfig,
    cost_model: CostModel,
    steps: int | None,
    dp: int = 1,
) -> dict[str, Any]:
    """Pack ``lengths`` with one packer and summarise balance, delay and cost: one whole pass
    (``steps=None``) or a partial window of ``steps`` steps, its flush unscored."""
    packer = build_packer(packer_name, config, cost_model)
    stream = LengthStream(lengths)
    scored, ended = [], []
    for plan in drive(packer, stream, steps):
        scored.append(plan)
        ended.append(stream.exhausted)
    whole = stream.exhausted and not packer.has_pending()
    plans = scored + list(drain(packer))  # a partial window's flush: counted, not scored
    per_step = [plan.stats for plan in scored]
    n_tok = sum(s["tokens"] for s in per_step)
    delay = sum(s["mean_delay"] * s["tokens"] for s in per_step)
    plan_ms = [s["pack_ms"] for s in per_step]
    if config.packing_window > 1 and packer_name in ("fixed_greedy", "solver"):
        g = config.packing_window  # one plan per window of G steps: amortise it over the window
        plan_ms = [sum(plan_ms[i : i + g]) / g for i in range(0, len(plan_ms), g)]
    fresh = build_packer(packer_name, config, cost_model)
    node_ms, node_cpu_ms = node_step_ms(fresh, lengths, len(scored), dp)
    collate_ms = collate_step_ms(
        build_packer(packer_name, config, cost_model), lengths, len(scored), dp
    )
    ratio = np.array([s["imbalance"] for s in per_step]) if per_step else np.ones(1)
    top = np.array([s["max_workload"] for s in per_step])
    mean = np.array([s["mean_workload"] for s in per_step])
    best = np.maximum([s["max_doc_workload"] for s in per_step], mean) if per_step else mean
    total = float(mean.sum())
    return {
        "packer": packer_name,
        "micro_batches": config.micro_batches,
        "steps": len(per_step),
        "whole_pass": bool(whole),
        "imbalance": float(ratio.mean()),
        "imbalance_p95": float(np.percentile(ratio, 95)),
        "imbalance_time_weighted": float(top.sum() / total) if total else 1.0,
        "imbalance_worst_step": float(ratio.max()),
        "lower_bound_time_weighted": float(best.sum() / total) if total else 1.0,
        "drain_steps": int(sum(ended)) if whole else 0,
        **_spread("overhead_ms", node_ms, with_max=True),
        **_spread("overhead_cpu_ms", node_cpu_ms),
        **_spread("collate_ms", collate_ms),
        **_spread("plan_ms", plan_ms),
        "dp": dp,
        "avg_delay_iters": float(delay / n_tok) if n_tok else 0.0,
        "max_delay_iters": max((s["max_delay"] for s in per_step), default=0),
        "max_tokens_per_microbatch": max((int(p.stats["max_tokens"]) for p in plans), default=0),
        "tokens_in": int(lengths[: stream.pos].sum()),
        "tokens_out": sum(int(x.sum()) for p in plans for x in p.doc_lens),
        "docs_in": stream.pos,
        "docs_out": sum(int(x.size) for p in plans for x in p.doc_ids),
        "flush_steps": len(plans) - len(scored),
        "context_len": config.context_len,
        "smax": packer.cap,
        "window": config.packing_window,
        "max_wait": config.max_delay_steps,
        "final_wait": getattr(packer, "k_eff", config.max_delay_steps),
        "queues": [int(x) for x in getattr(packer, "thresholds", [])],
    }


def _spread(name: str, values: list[float], with_max: bool = False) -> dict[str, float]:
    """Mean, 95th percentile (and maximum) of ``values`` (zeros when there are none)."""
    v = np.asarray(values or [0.0], np.float64)
    out = {name: float(v.mean()), f"{name}_p95": float(np.percentile(v, 95))}
    if with_max:
        out[f"{name}_max"] = float(v.max())
    return out


def _arg(convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable:
    """argparse type: ``convert(text)`` if it succeeds and ``ok`` accepts it, else one error."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _arg(int, lambda v: v >= 1, "an integer >= 1")
_nonneg_int = _arg(int, lambda v: v >= 0, "an integer >= 0")
_fraction = _arg(float, lambda v: 0 < v < 1, "a fraction in (0, 1)")
_queues = _arg(
    lambda text: tuple(int(x) for x in text.split(",") if x.strip()),
    bool,
    "comma-separated integers",
)


def _model_name(text: str) -> str:
    """A catalogue model name in any case; "8b", this tool's name for Llama 3 8B, still works."""
    name = "llama3_8B" if text.strip().lower() == "8b" else text
    try:
        return get_model(name).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# PackingConfig knobs and their flags: flag (its dest) -> (field, argparse type, help).
KNOBS = {
    "max_wait": ("max_delay_steps", _nonneg_int, "K: max steps in a queue"),
    "window": ("packing_window", _positive_int, "G for fixed_greedy/solver"),
    "solver_time_limit": ("solver_time_limit_s", float, "seconds per window"),
    "balance_target": ("balance_target", float, "wlb release target"),
    "release_slack": ("release_slack", float, "wlb: target growth with age / K"),
    "adaptive_max_wait": (
        "adaptive_max_delay_steps",
        _nonneg_int,
        "wlb: K may grow up to this (<= K: fixed K)",
    ),
    "delay_target": ("delay_target", float, "wlb: adaptive K's delay target"),
    "read_ahead_steps": (
        "read_ahead_steps",
        _positive_int,
        "wlb: global batches read ahead (sees the end)",
    ),
}
# Defaults of the benchmark that differ from PackingConfig's (the [wlb] section's): the solver's
# rows are timed with 10 s per window, as every published figure of this tool was.
BENCH_DEFAULTS = {"solver_time_limit_s": 10.0}


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.pack_bench", __doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="JSON list / .npy / one integer per line of doc lengths")
    src.add_argument("--generator", choices=list(workloads.GENERATORS), help="synthetic lengths")
    p.add_argument("--num-docs", type=_positive_int, default=workloads.DEFAULT_NUM_DOCS)
    p.add_argument("--seed", type=_nonneg_int, default=0, help="generator seed")
    p.add_argument("--context-len", type=_positive_int, default=131072)
    p.add_argument("--micro-batches", type=_positive_int, default=4, help="N per step")
    p.add_argument("--packer", choices=PACKERS, default="wlb")
    p.add_argument("--steps", type=workloads.steps_arg, default=100, help="a count, or 'epoch'")
    p.add_argument("--dp", type=_positive_int, default=1, help="DP ranks of the data node")
    p.add_argument("--queues", type=_queues, default=None, help="thresholds, e.g. 32768,65536")
    p.add_argument("--smax", type=_positive_int, default=None, help="micro-batch token cap")
    for dest, (field, kind, text) in KNOBS.items():
        default = BENCH_DEFAULTS.get(field, getattr(PackingConfig, field))
        p.add_argument(f"--{dest.replace('_', '-')}", type=kind, default=default, help=text)
    p.add_argument("--max-doc-len", type=_positive_int, default=None, help="split longer docs")
    models = ", ".join(MODELS)
    p.add_argument("--model", type=_model_name, default="7B", help=f"cost model of: {models}")
    p.add_argument("--tp", type=_positive_int, default=1)
    p.add_argument("--cp", type=_positive_int, default=1)
    p.add_argument("--attn-coef", type=float, default=None)
    p.add_argument("--linear-coef", type=float, default=None)
    p.add_argument("--profile", default=None, help="JSON (length, seconds) table")
    p.add_argument("--table2", action="store_true", help="print the paper's Table 2 comparison")
    p.add_argument("--solver-steps", type=_positive_int, default=8, help="steps for solver rows")
    p.add_argument("--solver-gap", type=_nonneg_int, default=0, help="wlb vs optimum over STEPS")
    p.add_argument("--tune", type=_fraction, default=None, help="tune on this share of the docs")
    p.add_argument(
        "--delay-budget", type=float, default=DELAY_BUDGET, help="--tune: max mean delay"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    return p


def _config(args: argparse.Namespace, packer: str, **over: Any) -> PackingConfig:
    knobs: dict[str, Any] = {field: getattr(args, dest) for dest, (field, *_) in KNOBS.items()}
    knobs.update(smax=args.smax, queue_thresholds=args.queues)
    knobs.update(over)
    return packing_config(packer, args.micro_batches, args.context_len, **knobs)


def _prepare(args: argparse.Namespace, cap: int) -> tuple[np.ndarray, int]:
    if args.lengths:
        try:
            lengths = workloads.load_lengths(args.lengths)
        except ValueError as exc:
            raise ValueError(f"--lengths: {exc}") from None
    else:
        lengths = workloads.generate(args.generator, args.num_docs, args.context_len, args.seed)
    max_len = args.max_doc_len or min(cap, args.context_len)
    if max_len > cap:
        raise ValueError(f"--max-doc-len {max_len} exceeds the micro-batch cap {cap}")
    return workloads.split_long(lengths, max_len), int((lengths > max_len).sum())


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
        steps = None if args.steps == "epoch" else args.steps
        if cfg.startswith("G="):
            over["packing_window"] = int(cfg[2:])
        if method == "solver":
            steps = args.solver_steps * over["packing_window"]
        if method.startswith("wlb"):
            over["queue_thresholds"] = args.queues or paper_q[int(cfg.split()[0])]
        res = run(method, lengths, _config(args, method, **over), cost_model, steps)
        res.update(
            config=cfg, paper_imbalance=paper_imb, paper_overhead=paper_ms, docs_split=n_split
        )
        rows.append(res)
        bar.write(
            f"{method:13s} {cfg:9s} imbalance {res['imbalance']:.3f} (paper {paper_imb or '-'})  "
            f"plan {res['plan_ms']:8.2f} ms (paper {paper_ms}), node step "
            f"{res['overhead_ms']:6.2f} ms  delay {res['avg_delay_iters']:.2f}",
            file=sys.stdout,
        )
    return rows


def solver_gap(
    lengths: np.ndarray, config: PackingConfig, cost_model: CostModel, steps: int, limit: float
) -> dict[str, Any]:
    """Re-solve each of ``wlb``'s first ``steps`` steps exactly (same N, S_max): its placement
    apart from its releases; an unfinished solve (``limit`` s) gives its proven lower bound."""
    from torchtitan_wlb.packing.solver import solve_minmax

    packer = build_packer("wlb", config, cost_model)
    ratios, bound_ratios = [], []  # ratios: the solves proven optimal
    for plan in drive(packer, LengthStream(lengths), steps):
        lens = np.concatenate(plan.doc_lens)
        mine = plan.stats["max_workload"]
        if lens.size == 0:  # everything queued this step: nothing to compare
            continue
        res = solve_minmax(lens, config.micro_batches, packer.cap, cost_model, limit)
        if res.optimal:
            ratios.append(mine / res.max_load)
        bound_ratios.append(mine / res.lower_bound)
    return {
        "gap_steps": steps,
        "gap_solved": len(ratios),
        "gap_mean_wlb_over_opt": float(np.mean(ratios)) if ratios else None,
        "gap_max_wlb_over_opt": float(np.max(ratios)) if ratios else None,
        "gap_mean_wlb_over_bound": float(np.mean(bound_ratios)) if bound_ratios else None,
    }


def _tune(
    args: argparse.Namespace, lengths: np.ndarray, config: PackingConfig, cost_model: CostModel
) -> tuple[np.ndarray, PackingConfig, Any]:
    """Queue thresholds and K tuned on the tail of the documents; the rest is what is packed."""
    if args.packer not in ("wlb", "wlb_paper"):
        raise ValueError("--tune chooses queue thresholds and K: use --packer wlb or wlb_paper")
    cut = int(round(lengths.size * (1 - args.tune)))
    if cut < 1 or cut >= lengths.size:
        raise ValueError(f"--tune {args.tune} leaves no documents to tune or to evaluate")
    tuned = tune_queues(
        lengths[cut:], config, cost_model, packer=args.packer, delay_budget=args.delay_budget
    )
    config = replace(
        config, queue_thresholds=tuned.queue_thresholds, max_delay_steps=tuned.max_wait
    )
    return lengths[:cut], config, tuned


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        cost_model = build_cost_model(args)
        if args.table2:
            rows = table2(args, cost_model)
            if args.json:
                print(json_text({"table2": rows}))
            return 0
        config = _config(args, args.packer)
        lengths, n_split = _prepare(args, build_packer(args.packer, config, cost_model).cap)
        tuned = None
        if args.tune:
            lengths, config, tuned = _tune(args, lengths, config, cost_model)
        if args.micro_batches % args.dp:
            raise ValueError(
                f"--micro-batches {args.micro_batches} is not divisible by --dp {args.dp}"
            )
        steps = None if args.steps == "epoch" else args.steps
        res = run(args.packer, lengths, config, cost_model, steps, args.dp)
        res["docs_split"] = n_split
        res["break_even_length"] = cost_model.break_even_length
        if tuned is not None:
            res["tuned_on_docs"] = int(round(len(lengths) * args.tune / (1 - args.tune)))
            res.update(tuned_sample_imbalance=tuned.imbalance, tuned_sample_delay=tuned.mean_delay)
        if args.solver_gap:
            if args.packer != "wlb":
                raise ValueError("--solver-gap compares wlb with the optimum: use --packer wlb")
            gap = solver_gap(lengths, config, cost_model, args.solver_gap, args.solver_time_limit)
            res.update(gap)
    except ValueError as exc:
        p.error(str(exc))
    if not args.json:
        for k, v in res.items():
            print(f"{k:28s} {v}")
    print(json_text(res))
    return 0 if res["tokens_in"] == res["tokens_out"] else 1


if __name__ == "__main__":
    sys.exit(main())
