"""Convergence: the same documents trained exactly once by each mode, and the held-out loss.

Every mode trains the same texts of the built-in corpus for one whole pass (drain included), with
the same model, seeds and learning-rate schedule, one CPU rank per job, and validates on the
corpus's held-out split every few steps (``[validation]``); each seed is one job per mode.

    python -m torchtitan_wlb.tools.convergence_bench --json-out conv.json --plot conv.png
    python -m torchtitan_wlb.tools.convergence_bench --seeds 0 --modes wlb --num-texts 100 --json
    python -m torchtitan_wlb.tools.convergence_bench --from-json a.json,b.json --plot both.png

Modes, measures and the results: docs/benchmarks_convergence.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_wlb.data.sources import builtin_split
from torchtitan_wlb.tools.cli import ToolParser, json_text, require_at_least
from torchtitan_wlb.tools.e2e_bench import job_command

ROOT = Path(__file__).resolve().parents[2]
MODES = ("plain_4d", "fixed_4d", "wlb")
BASELINES = ("plain_4d", "fixed_4d")
# Variants that turn one WLB mechanism down, to find which one moves the loss: the delay of
# outliers (K = 1, not adapted: the least the queues allow), the variable micro-batch length
# (S_max = context, as the baselines).
VARIANTS = {
    "wlb_delay1": ["--wlb.mode", "wlb", "--wlb.max_delay_steps", "1",
                   "--wlb.advanced.adaptive_max_delay_steps", "1"],
    "wlb_fixed_len": ["--wlb.mode", "wlb"],
}  # fmt: skip


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.convergence_bench", __doc__)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (and variants)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated [debug] seed values")
    p.add_argument("--model", default="tiny", help="llama3_wlb flavor (default: tiny)")
    p.add_argument("--num-texts", type=int, default=550, help="training texts (corpus order)")
    p.add_argument("--context-len", type=int, default=512, help="[training] seq_len")
    p.add_argument("--micro-batches", type=int, default=4, help="N per optimizer step")
    p.add_argument("--smax-factor", type=float, default=1.25, help="S_max / context (wlb)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=5, help="learning-rate warmup steps")
    p.add_argument("--val-freq", type=int, default=5, help="[validation] freq (steps)")
    p.add_argument("--val-steps", type=int, default=8, help="held-out set: this x context tokens")
    p.add_argument("--jobs", type=int, default=2, help="jobs run at once (one core each)")
    p.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
    p.add_argument("--json-out", default="", help="write the result JSON here")
    p.add_argument("--plot", default="", help="write the PNG figure here (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (last line)")
    p.add_argument(
        "--from-json",
        default="",
        help="comma-separated result files: merge their runs, summarize and plot, train nothing",
    )
    return p


def write_texts(path: Path, count: int) -> int:
    """The first ``count`` training texts of the built-in corpus as JSONL; their characters."""
    texts = builtin_split(heldout=False)[:count]
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return sum(len(t) for t in texts)


def mode_flags(mode: str, args: argparse.Namespace) -> list[str]:
    """The ``[wlb]`` flags of a mode or variant (S_max = context for the fixed-length ones)."""
    flags = VARIANTS.get(mode, ["--wlb.mode", mode])
    fixed = mode in BASELINES or mode == "wlb_fixed_len"
    smax = args.context_len if fixed else int(args.context_len * args.smax_factor)
    return [*flags, "--wlb.micro_batch_max_len", str(smax)]


def train_command(mode: str, seed: int, args: argparse.Namespace, data: Path, dump: Path) -> list:
    """One rank's whole pass over ``data`` with validation, as ``torch.distributed.run`` runs it.
    The schedule decays over 100000 steps: the same learning rate at every step in every mode."""
    return [
        *job_command(1, args, data, dump),
        "--training.steps", "100000", "--wlb.epochs", "1", *mode_flags(mode, args),
        "--optimizer.lr", str(args.lr), "--lr_scheduler.warmup_steps", str(args.warmup),
        "--validation.enable", "--validation.dataset", "wlb_builtin_validation",
        "--validation.freq", str(args.val_freq), "--validation.steps", str(args.val_steps),
        "--validation.seq_len", str(args.context_len), "--validation.local_batch_size", "1",
        "--wlb.advanced.metrics_jsonl", "--checkpoint.no-enable", "--metrics.log_freq", "1",
        "--metrics.disable_color_printing", "--debug.seed", str(seed),
    ]  # fmt: skip


def run_jobs(jobs: list[tuple[str, int, list, Path]], parallel: int) -> dict[tuple, float]:
    """Run the jobs, ``parallel`` at a time with one thread each; wall seconds per (mode, seed).
    Raises RuntimeError with the log's tail when one fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    pending, running, walls = list(jobs), [], {}
    while pending or running:
        while pending and len(running) < parallel:
            mode, seed, cmd, dump = pending.pop(0)
            dump.mkdir(parents=True, exist_ok=True)
            log = open(dump / "train.log", "w")  # noqa: SIM115 -- closed when the job ends
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((mode, seed, dump, proc, log, time.perf_counter()))
            print(f"started {mode} seed {seed}", file=sys.stderr, flush=True)
        time.sleep(1.0)
        for job in [j for j in running if j[3].poll() is not None]:
            mode, seed, dump, proc, log, start = job
            running.remove(job)
            log.close()
            if proc.returncode != 0:
                tail = (dump / "train.log").read_text()[-4000:]
                raise RuntimeError(f"{mode} seed {seed} failed:\n{tail}")
            walls[(mode, seed)] = time.perf_counter() - start
            print(f"done {mode} seed {seed} in {walls[(mode, seed)]:.0f}s", file=sys.stderr)
    return walls


def read_run(dump: Path) -> dict[str, Any]:
    """A job's curves: per step the token-mean training loss and the tokens seen after it; per
    validation the held-out loss and the tokens seen; the documents trained."""
    with open(dump / "wlb_metrics" / "rank_0.jsonl") as f:
        steps = [json.loads(line) for line in f]
    # Tokens of documents (a one-token filler micro-batch of the drain holds none).
    per_step = [sum(sum(d) for d in r["micro_batch_doc_lens"] if d != [1]) for r in steps]
    tokens = np.cumsum(per_step).tolist()
    seen = {r["step"]: t for r, t in zip(steps, tokens, strict=True)}
    with open(dump / "wlb_validation.jsonl") as f:
        val = [json.loads(line) for line in f]
    docs = [i for r in steps for i in r["doc_ids"]]
    return {
        "steps": len(steps),
        "tokens": tokens[-1],
        "documents": len(docs),
        "documents_unique": len(set(docs)),
        "train_loss": [r["loss"] for r in steps],
        "train_tokens": tokens,
        "val_steps": [v["step"] for v in val],
        "val_tokens": [seen[v["step"]] for v in val],
        "val_loss": [v["loss"] for v in val],
        "final_val_loss": val[-1]["loss"],
        "val_set_tokens": val[-1]["tokens"],
    }


def summarize(runs: dict[str, dict[int, dict]]) -> dict[str, Any]:
    """Per mode the final held-out loss over seeds (mean, sample std, min, max), and whether
    WLB's mean lies within the baselines' seed range."""
    table = {}
    for mode, by_seed in runs.items():
        finals = [r["final_val_loss"] for r in by_seed.values()]
        table[mode] = {
            "seeds": len(finals),
            "final_val_loss_mean": statistics.fmean(finals),
            "final_val_loss_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_val_loss_min": min(finals),
            "final_val_loss_max": max(finals),
            "steps": [r["steps"] for r in by_seed.values()],
            # steps that trained no document (every micro-batch a filler): their loss is 0/0
            "empty_steps": [
                sum(x is None or x != x for x in r["train_loss"]) for r in by_seed.values()
            ],
            "tokens": [r["tokens"] for r in by_seed.values()],
        }
    base = [r["final_val_loss"] for m in BASELINES if m in runs for r in runs[m].values()]
    verdict = None
    if base and "wlb" in table:
        low, high = min(base), max(base)
        mean = table["wlb"]["final_val_loss_mean"]
        verdict = {
            "baseline_range": [low, high],
            "wlb_mean": mean,
            "wlb_within_baseline_spread": low <= mean <= high,
            "wlb_minus_baseline_mean": mean - statistics.fmean(base),
        }
    return {"table": table, "verdict": verdict}


def plot(runs: dict[str, dict[int, dict]], path: str) -> None:
    """Training loss (per token, a 9-step running mean) and held-out loss against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, by_step) = plt.subplots(1, 3, figsize=(17, 4.5))
    colors = dict(zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for mode, by_seed in runs.items():
        for k, r in enumerate(by_seed.values()):
            label = mode if k == 0 else None
            # A step without documents (its loss 0/0, null in JSON) is left out of the curve.
            kept = [(t, x) for t, x in zip(r["train_tokens"], r["train_loss"], strict=True) if x]
            tokens, loss = (np.array(v, dtype=float) for v in zip(*kept, strict=True))
            loss = np.convolve(loss, np.ones(9) / 9, mode="valid")
            left.plot(tokens[8:], loss, color=colors[mode], alpha=0.7, label=label)
            right.plot(r["val_tokens"], r["val_loss"], color=colors[mode], alpha=0.7, label=label)
            by_step.plot(r["val_steps"], r["val_loss"], color=colors[mode], alpha=0.7, label=label)
    panels = (
        (left, "training loss per token (9-step mean)", "tokens seen"),
        (right, "held-out loss", "tokens seen"),
        (by_step, "held-out loss by optimizer step", "step"),
    )
    for ax, title, xlabel in panels:
        ax.set_ylim(top=3.6)  # the first steps' losses (5-6 nats) would hide the differences
        ax.set_xlabel(xlabel)
        ax.set_ylabel("cross-entropy (nats / token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES and m not in VARIANTS]:
        p.error(f"--modes: {bad[0]!r} is not one of {', '.join([*MODES, *VARIANTS])}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds = {args.seeds!r} must be comma-separated integers")
    require_at_least(p, args, ("num_texts", "jobs", "val_freq", "val_steps", "micro_batches"))
    if args.from_json:
        return report(merge_results(args.from_json.split(",")), args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="convergence_"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "train.jsonl"
    chars = write_texts(data, args.num_texts)
    jobs = [
        (m, s, train_command(m, s, args, data, work / f"{m}_seed{s}"), work / f"{m}_seed{s}")
        for s in seeds
        for m in modes
    ]
    begin = time.perf_counter()
    walls = run_jobs(jobs, args.jobs)
    runs = {m: {s: read_run(work / f"{m}_seed{s}") for s in seeds} for m in modes}
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json_out", "plot")},
        "texts": args.num_texts,
        "characters": chars,
        "wall_s": time.perf_counter() - begin,
        "job_wall_s": {f"{m}_seed{s}": w for (m, s), w in walls.items()},
        **summarize(runs),
        "runs": {m: {str(s): r for s, r in by_seed.items()} for m, by_seed in runs.items()},
    }
    return report(result, args)


def merge_results(paths: list[str]) -> dict[str, Any]:
    """The runs of several result files (later files win per mode), summarized anew."""
    runs: dict[str, dict[int, dict]] = {}
    wall, config = 0.0, {}
    for path in paths:
        saved = json.loads(Path(path).read_text())
        wall += saved["wall_s"]
        config = config or {k: v for k, v in saved.get("config", {}).items() if k != "workdir"}
        for mode, by_seed in saved["runs"].items():
            runs[mode] = {int(s): r for s, r in by_seed.items()}
    result = {"sources": paths, "config": config, "wall_s": wall, **summarize(runs)}
    return {**result, "runs": runs}


def report(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Write the JSON and the figure asked for; print the table and the verdict."""
    if args.json_out:
        Path(args.json_out).write_text(json_text(result, indent=1) + "\n")
    if args.plot:
        runs = {m: {int(s): r for s, r in by_seed.items()} for m, by_seed in result["runs"].items()}
        plot(runs, args.plot)
    if args.json:
        print(json_text({k: result[k] for k in ("table", "verdict", "wall_s")}))
        return 0
    print("mode  steps  final held-out loss: mean  sd  min-max")
    for mode, row in result["table"].items():
        print(
            f"{mode}  {row['steps'][0]}  {row['final_val_loss_mean']:.4f}  "
            f"{row['final_val_loss_std']:.4f}  {row['final_val_loss_min']:.4f}-"
            f"{row['final_val_loss_max']:.4f}"
        )
    if (verdict := result["verdict"]) is not None:
        low, high = verdict["baseline_range"]
        inside = "within" if verdict["wlb_within_baseline_spread"] else "outside"
        print(
            f"wlb's mean {verdict['wlb_mean']:.4f} is {inside} the baselines' {low:.4f}-{high:.4f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
