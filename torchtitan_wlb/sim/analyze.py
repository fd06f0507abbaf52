"""``wlb-analyze``: what WLB would buy on YOUR data before spending a cluster on it, found by
trying the packers and candidate settings on the data (docs/simulator.md)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from torchtitan_wlb.packing import packing_config
from torchtitan_wlb.packing.tuning import choose, run_sample, tune_trials
from torchtitan_wlb.sim import cli
from torchtitan_wlb.sim.config import MODES, REQUIRED_MODES
from torchtitan_wlb.sim.engine import cost_model_for, simulate_mode
from torchtitan_wlb.workloads import load_lengths, long_documents, long_token_share, split_long

PACKERS_COMPARED = ("original", "fixed_greedy", "wlb_paper", "wlb")
SMAX_CANDIDATES = (1.0, 1.125, 1.25, 1.5)


def length_histogram(lengths: np.ndarray, context_len: int) -> list[dict]:
    """Power-of-two length buckets: documents and share of tokens per bucket."""
    lengths = np.asarray(lengths, dtype=np.int64)
    top = max(int(lengths.max()), 2)
    edges = 2 ** np.arange(0, int(np.ceil(np.log2(top))) + 2)
    idx = np.searchsorted(edges, lengths, side="right") - 1
    docs = np.bincount(idx, minlength=edges.size - 1)[: edges.size - 1]
    toks = np.bincount(idx, weights=lengths, minlength=edges.size - 1)[: edges.size - 1]
    total = float(lengths.sum())
    return [
        {
            "min_len": int(edges[i]),
            "max_len": int(edges[i + 1] - 1),
            "docs": int(docs[i]),
            "doc_share": float(docs[i] / lengths.size),
            "token_share": float(toks[i] / total),
            "over_half_context": bool(long_documents(edges[i + 1] - 1, context_len)),
        }
        for i in np.flatnonzero(docs)
    ]


def predicted_imbalance(lengths, cfg, packer: str, **overrides) -> dict:
    """One packer's predicted imbalance and delay over the sample (no flush: it is a sample)."""
    config = packing_config(
        packer, cfg.n_global, cfg.context_len, max_delay_steps=cfg.max_delay_steps, **overrides
    )
    docs = split_long(lengths, cfg.context_len)
    run = run_sample(packer, docs, config, cost_model_for(cfg), cfg.steps)
    if not run.steps:
        raise ValueError("the lengths sample is too small for one step; give more documents")
    return {
        "imbalance": run.imbalance,
        "avg_delay_steps": run.mean_delay,
        "steps": run.steps,
        "smax": int(run.packer.cap),
        "queues": [int(x) for x in getattr(run.packer, "thresholds", [])],
    }


def recommend(lengths, cfg) -> dict:
    """Queue thresholds (1-3 queues) x S_max at the configured K, chosen by the packing tuner's one
    rule (``packing.tuning.choose``: the lowest imbalance within the delay budget, ties to the
    smaller S_max)."""
    cm = cost_model_for(cfg)
    smax = {replace(cfg, smax_factor=f).smax: f for f in reversed(SMAX_CANDIDATES)}
    config = packing_config(
        "wlb", cfg.n_global, cfg.context_len, max_delay_steps=cfg.max_delay_steps
    )
    docs, waits = split_long(lengths, cfg.context_len), (cfg.max_delay_steps,)
    trials = tune_trials(docs, config, cm, smaxes=tuple(smax), waits=waits, steps=cfg.steps)
    pick = choose(trials)
    return {
        "queue_thresholds": list(pick.queue_thresholds),
        "micro_batch_max_len": pick.smax,
        "max_delay_steps": cfg.max_delay_steps,
        "predicted_imbalance": pick.imbalance,
        "avg_delay_steps": pick.mean_delay,
        "break_even_length": float(cm.break_even_length),
        "trials": [
            {
                "levels": len(t.queue_thresholds),
                "smax_factor": smax[t.smax],
                "imbalance": t.imbalance,
                "avg_delay_steps": t.mean_delay,
                "steps": t.steps,
                "smax": t.smax,
                "queues": list(t.queue_thresholds),
            }
            for t in trials
        ],
    }


def lengths_from_dataset(path: str, limit: int) -> np.ndarray:
    from torchtitan_wlb.data.sources import TextSource
    from torchtitan_wlb.data.tokenizer import ByteTokenizer

    kind = {".jsonl": "jsonl", ".parquet": "parquet"}.get(Path(path).suffix, "text")
    tok = ByteTokenizer()
    texts = TextSource(kind=kind, path=str(path)).open_texts()
    out = [len(tok.encode(text)) for _, text in itertools.islice(texts, limit)]
    if not out:
        raise ValueError(f"dataset {path!r} holds no documents")
    return np.asarray(out, dtype=np.int64)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wlb-analyze",
        description="Document-length analysis and WLB recommendations for a dataset.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="JSON list, .npy, or one integer per line")
    src.add_argument("--dataset", help="local jsonl / parquet / text file, tokenized here")
    p.add_argument("--max-docs", type=int, default=200_000, help="documents read from --dataset")
    cli.add_setup_args(p)
    p.add_argument("--steps", type=int, default=50, help="steps packed per trial")
    p.add_argument("--no-simulate", action="store_true", help="skip the step-time simulation")
    p.add_argument("--plot", default=None, metavar="DIR")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        lengths = (
            load_lengths(args.lengths)
            if args.lengths
            else lengths_from_dataset(args.dataset, args.max_docs)
        )
        # The simulator's option defaults, for the fields analyze does not expose.
        args.warmup_steps, args.smax_factor, args.queue_thresholds = 0, 1.25, None
        cfg = cli.config_from_args(args)
        hist = length_histogram(lengths, cfg.context_len)
        packers = {p: predicted_imbalance(lengths, cfg, p) for p in PACKERS_COMPARED}
        rec = recommend(lengths, cfg)
        out: dict = {
            "documents": int(lengths.size),
            "tokens": int(lengths.sum()),
            "mean_len": float(lengths.mean()),
            "median_len": float(np.median(lengths)),
            "max_len": int(lengths.max()),
            "token_share_over_half_context": long_token_share(lengths, cfg.context_len),
            "histogram": hist,
            "packers": packers,
            "recommended": {k: v for k, v in rec.items() if k != "trials"},
            "recommend_trials": rec["trials"],
        }
        if not args.no_simulate:
            sim_cfg = replace(cfg, steps=min(cfg.steps, 20), warmup_steps=4)
            names = (*REQUIRED_MODES, "wlb_hybrid")  # + adaptive CP with hybrid sharding
            s = cli.summarize({m: simulate_mode(MODES[m], lengths, sim_cfg) for m in names})
            keys = ("speedup_wlb_vs_plain", "speedup_wlb_vs_fixed", "speedup_wlb_hybrid_vs_plain")
            out["simulated"] = {k: s[k] for k in keys} | {
                "speedup_wlb_hybrid_vs_wlb": s["wlb_hybrid"]["tokens_per_s"]
                / s["wlb"]["tokens_per_s"],
                "wlb_hybrid_share": s["wlb_hybrid"]["hybrid_share"],
            }
        if args.plot:
            from torchtitan_wlb.sim.plots import length_histogram as plot_histogram

            Path(args.plot).mkdir(parents=True, exist_ok=True)
            path = plot_histogram(hist, cfg.context_len, Path(args.plot) / "length_histogram.png")
            out["plots"] = [str(path)]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{out['documents']} documents, {out['tokens']} tokens; mean {out['mean_len']:.0f}, "
        f"median {out['median_len']:.0f}, max {out['max_len']}"
    )
    print(f"{'length bucket':>20} {'docs':>9} {'docs %':>7} {'tokens %':>9}")
    for r in hist:
        print(
            f"{r['min_len']:>9}-{r['max_len']:<10} {r['docs']:>9} {100 * r['doc_share']:>6.1f}% "
            f"{100 * r['token_share']:>8.1f}%"
        )
    print(f"predicted imbalance (max/mean micro-batch workload, N = {cfg.n_global} per step):")
    for name, r in packers.items():
        print(f"  {name:<13} {r['imbalance']:.3f}   mean delay {r['avg_delay_steps']:.2f} steps")
    if "simulated" in out:
        sp = out["simulated"]
        print(
            f"simulated speedup: WLB vs Plain-4D {sp['speedup_wlb_vs_plain']:.3f}x, "
            f"vs Fixed-4D {sp['speedup_wlb_vs_fixed']:.3f}x; adaptive CP with hybrid sharding "
            f"{sp['speedup_wlb_hybrid_vs_plain']:.3f}x vs Plain-4D "
            f"({sp['speedup_wlb_hybrid_vs_wlb']:.3f}x vs WLB, hybrid on "
            f"{100 * sp['wlb_hybrid_share']:.0f} % of micro-batches)"
        )
    rec = out["recommended"]
    print(
        f'recommended settings:\n[wlb]\nmode = "wlb"\nqueue_thresholds = '
        f"[{', '.join(str(t) for t in rec['queue_thresholds'])}]\nmicro_batch_max_len = "
        f"{rec['micro_batch_max_len']}  # S_max: check it fits activation memory\n"
        f"max_delay_steps = {rec['max_delay_steps']}\n"
    )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
