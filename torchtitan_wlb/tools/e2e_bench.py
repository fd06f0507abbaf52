"""End-to-end: the time the paper's three systems take to train the same documents, through
the real trainer, on this machine.

    python -m torchtitan_wlb.tools.e2e_bench --json                  # 2 ranks, PP = 2
    python -m torchtitan_wlb.tools.e2e_bench --parallel cp2 --json   # 2 ranks, CP = 2
    python -m torchtitan_wlb.tools.e2e_bench --parallel cp2 --modes wlb \
        --cp-sharding per_document,hybrid --json   # CP shardings, same packing

Runs ``plain_4d`` (original packing + per-sequence CP), ``fixed_4d`` (fixed-length greedy packing
+ per-document CP), ``wlb`` (variable-length packing with outlier queues + adaptive CP) and
``wlb_online`` (``wlb`` with ``[wlb] cost_model = "online"``: the cost model refitted to the
measured micro-batch times while training; ``--fit-*``) one after the other, each as a real ``torchtitan_wlb.train`` job on 2 CPU ranks (gloo), and reads the
per-rank metrics log (``[wlb] metrics_jsonl``).

What users pay is measured: every mode trains one fixed set of documents exactly once
(``[wlb] epochs = 1``; ``--steps epoch``, the default), the end of the data and the drain of the
outlier queues included, and the documents each rank trained are checked against the set. The
headline ``speedup_wlb_vs_plain`` / ``speedup_wlb_vs_fixed`` is the ratio of the time to train
the set (the sum over every step of the slowest rank's step time); the median-step ratios, which
hide deferred work, are kept as ``median_step_speedup_*``. ``--runs R`` repeats everything and
reports each run and the spread.

Per mode: ``time_to_train_s``, ``tokens_per_s`` (the set's tokens over that time), ``steps``,
``step_time_s`` (median), ``peak_mem_mb`` (largest per-rank peak), ``predicted_imbalance`` (the
packer's max/mean micro-batch workload, time-weighted: Σ max / Σ mean over steps; ``imbalance`` is
the mean of the per-step ratios), ``measured_imbalance`` (the same measure over measured
forward+backward times: per micro-batch without PP, taking the slowest CP rank; per stage and
micro-batch with PP), ``docs_trained`` and ``docs_repeated``.

The noise floor comes first (``--floor-steps``, default 20): a run whose every micro-batch is the
same single full-context document, so any measured imbalance is the machine's noise; its
``measured_imbalance`` is reported as ``measured_imbalance_floor`` beside the modes'. ``--cost-model
online`` makes the fixed-model modes refit too. A mode that refits reports ``refits``,
``refits_adopted``, the last adopted ``fit_coefficients`` (``a``, ``b``, ``c``: seconds per Σd²,
per Σd, per micro-batch) and ``fit_mean_abs_error``: their mean absolute relative error predicting
every recorded micro-batch's time. ``speedup_online_vs_wlb``: time to train, wlb over wlb_online.

Documents: a long-tailed length mix shaped like WLB-LLM's 128K workload, scaled to the benchmark's
context (``--generator longtail``; or ``--lengths FILE``, scaled by ``context_len / --scale-from``),
with random characters (time does not depend on the values). The default set is sized for about
50 steps per mode. Both ranks share this machine's cores, so absolute times depend on what else
runs; compare modes within one invocation, and read the spread over runs.

``--cp-sharding a,b`` (with ``--parallel cp2``) compares CP shardings instead: every mode runs once
per sharding with the mode's packer, labelled ``<mode>+<sharding>``, and ``speedup_b_vs_a`` (and
``median_step_speedup_b_vs_a``; suffixed ``_<mode>`` when several modes run) is the ratio of the
times to train against the first sharding.

The last line printed is one JSON object: ``modes -> {plain_4d, fixed_4d, wlb, wlb_online} ->
{...}`` (the last run's), ``runs`` (every run's per-mode figures and speedups), ``speedup_wlb_vs_plain``,
``speedup_wlb_vs_fixed``, ``speedup_online_vs_wlb``, ``measured_imbalance_floor`` (mean over runs)
with ``*_min`` / ``*_max``, ``median_step_speedup_*``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_wlb.config import MODE_PRESETS
from torchtitan_wlb.cp.adaptive import STRATEGIES as CP_STRATEGIES
from torchtitan_wlb.tools.cli import ToolParser, progress
from torchtitan_wlb.workloads import GENERATORS, generate, load_lengths, steps_arg

ROOT = Path(__file__).resolve().parents[2]
MODES = ("plain_4d", "fixed_4d", "wlb", "wlb_online")
# Each mode's [wlb] settings. "wlb_online" is "wlb" with the cost model refitted while training.
MODE_ARGS = {
    "plain_4d": ["--wlb.mode", "plain_4d"],
    "fixed_4d": ["--wlb.mode", "fixed_4d"],
    "wlb": ["--wlb.mode", "wlb"],
    "wlb_online": ["--wlb.mode", "wlb", "--wlb.cost_model", "online"],
}
FLOOR = "floor"  # the noise-floor run: every micro-batch one full-context document
STEP_LINE = re.compile(r"step:\s*(\d+)/")  # the trainer's step line, "step:  3/14  loss: ..."
PARALLEL = {
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
    "dp2": [],
}


def make_documents(args: argparse.Namespace) -> np.ndarray:
    """Document lengths (tokens incl. BOS/EOS) for the benchmark, deterministic in the seed."""
    if args.lengths:
        lengths = load_lengths(args.lengths)
    else:
        lengths = generate(args.generator, args.num_docs, args.scale_from, args.seed)
    scaled = np.rint(lengths * (args.context_len / args.scale_from)).astype(np.int64)
    return np.clip(scaled, 3, args.context_len)


def write_jsonl(lengths: np.ndarray, path: Path, seed: int) -> None:
    """One document per line whose byte-tokenized length (+ BOS/EOS) is the given length."""
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    with open(path, "w") as f:
        for n in lengths.tolist():
            text = alphabet[rng.integers(0, alphabet.size, n - 2)].tobytes().decode()
            f.write(json.dumps({"text": "x" + text[1:] if n > 2 else "x"}) + "\n")


def _run_with_progress(cmd: list[str], env: dict[str, str], bar: Any, mode: str) -> tuple[int, str]:
    """Run one training job, advancing ``bar`` on each new step it logs; returns (status, output
    tail). Both ranks' output is merged; a step counts once."""
    tail: collections.deque[str] = collections.deque(maxlen=200)
    seen: set[int] = set()
    bar.set_postfix_str(mode)
    with subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            if (m := STEP_LINE.search(line)) and int(m.group(1)) not in seen:
                seen.add(int(m.group(1)))
                bar.update(1)
    return proc.returncode, "".join(tail)


def mode_args(mode: str, args: argparse.Namespace, cp_sharding: str = "") -> list[str]:
    """The trainer flags of ``mode``: its preset, and ``--cost-model`` for the fixed-model modes.

    The floor run packs with "original" (sequential fill): its documents are exactly one context
    long, so every micro-batch is the same single document."""
    if mode == FLOOR:
        return ["--wlb.packing", "original", "--wlb.cp_sharding", "per_document"]
    fit = [
        "--wlb.fit_warmup_steps", str(args.fit_warmup), "--wlb.fit_window_steps",
        str(args.fit_window), "--wlb.fit_holdout_steps", str(max(1, args.fit_window // 4)),
        "--wlb.fit_interval_steps", str(args.fit_interval),
    ]  # fmt: skip
    preset = MODE_ARGS[mode]
    if (
        cp_sharding
    ):  # the mode's packer with another CP sharding: no preset, which would override it
        sharding = [
            "--wlb.packing",
            MODE_PRESETS[MODE_ARGS[mode][1]][0],
            "--wlb.cp_sharding",
            cp_sharding,
        ]
        preset = ["--wlb.mode", "", *sharding, *preset[2:]]
    if mode == "wlb_online":
        return preset + fit
    return preset + ["--wlb.cost_model", args.cost_model] + fit


def run_mode(
    mode: str,
    args: argparse.Namespace,
    data: Path,
    workdir: Path,
    bar: Any,
    cp_sharding: str = "",
) -> dict[str, Any]:
    """One training job of ``mode``; with ``cp_sharding``, the mode's packer with that
    ``[wlb] cp_sharding`` instead of the mode's own (the preset would override it)."""
    label = f"{mode}+{cp_sharding}" if cp_sharding else mode
    dump = workdir / label
    if mode == FLOOR:
        steps = ["--training.steps", str(args.floor_steps)]
    elif args.steps == "epoch":
        steps = ["--training.steps", "100000", "--wlb.epochs", "1"]
    else:
        steps = ["--training.steps", str(args.steps)]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--role", "rank",
        "-m", "torchtitan_wlb.train",
        "--job.config_file", str(ROOT / "train_configs" / "debug_cpu.toml"),
        "--job.dump_folder", str(dump), "--model.flavor", args.model,
        "--training.dataset", "jsonl", "--training.dataset_path", str(data),
        "--training.seq_len", str(args.context_len),
        "--training.global_batch_size", str(args.micro_batches),
        *steps, *mode_args(mode, args, cp_sharding),
        "--wlb.micro_batch_max_len", str(int(args.context_len * args.smax_factor)),
        "--wlb.metrics_jsonl", "--checkpoint.no-enable", "--metrics.log_freq", "1",
        "--metrics.disable_color_printing", "--debug.seed", str(args.seed),
        "--lr_scheduler.warmup_steps", "1",
        *PARALLEL[args.parallel],
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_rank))
    start = time.perf_counter()
    status, output = _run_with_progress(cmd, env, bar, label)
    wall = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"mode {label} failed:\n{output[-6000:]}")
    per_rank = []
    for log in sorted((dump / "wlb_metrics").glob("rank_*.jsonl")):
        per_rank.append({rec["step"]: rec for rec in map(json.loads, log.open())})
    steps_done = sorted(set.intersection(*(set(r) for r in per_rank)))
    timed = [s for s in steps_done if s > args.warmup] or steps_done
    step_times = [max(r[s]["wlb/step_time_s"] for r in per_rank) for s in steps_done]
    median = statistics.median([max(r[s]["wlb/step_time_s"] for r in per_rank) for s in timed])
    tokens = sum(per_rank[0][s].get("wlb/tokens", 0.0) for s in steps_done)
    # Pipeline stages and CP ranks share their micro-batches: only DP ranks train different ones.
    dp_ranks = per_rank if args.parallel == "dp2" else per_rank[:1]
    trained = [i for r in dp_ranks for s in steps_done for i in r[s].get("doc_ids", [])]
    first = per_rank[0]
    top = sum(first[s].get("wlb/max_workload", 0.0) for s in steps_done)
    mean = sum(first[s].get("wlb/mean_workload", 0.0) for s in steps_done)
    out = {
        "time_to_train_s": sum(step_times),
        "tokens_per_s": tokens / sum(step_times),
        "steps": len(steps_done),
        "step_time_s": median,
        "step_times_s": step_times,
        "peak_mem_mb": max(r[s]["peak_mem_gib"] for r in per_rank for s in steps_done) * 1024,
        "imbalance": float(np.mean([first[s]["wlb/imbalance"] for s in steps_done])),
        "predicted_imbalance": top / mean if mean else 1.0,
        "measured_imbalance": measured_imbalance(per_rank, steps_done, args.parallel),
        "max_tokens_per_microbatch": max(first[s]["wlb/max_tokens"] for s in steps_done),
        "docs_trained": len(set(trained)),
        "docs_repeated": len(trained) - len(set(trained)),
        "wall_s": wall,
    }
    out["records"] = calibration_records(per_rank, timed)
    for key in ("cp_per_document_share", "cp_hybrid_share"):
        shares = [first[s][f"wlb/{key}"] for s in steps_done if f"wlb/{key}" in first[s]]
        if shares:
            out[key] = float(np.mean(shares))
    refits = [first[s] for s in steps_done if "wlb/cost_refit_adopted" in first[s]]
    if refits:
        adopted = [r for r in refits if r["wlb/cost_refit_adopted"]]
        out["refits"] = len(refits)
        out["refits_adopted"] = len(adopted)
        if adopted:
            last = adopted[-1]
            coef = [last["wlb/cost_refit_a"], last["wlb/cost_refit_b"], last["wlb/cost_refit_c"]]
            out["fit_coefficients"] = dict(zip("abc", coef, strict=True))
            out["fit_mean_abs_error"] = fit_error(
                out["records"]["microbatches"], coef, 2 if args.parallel == "cp2" else 1
            )
    return out


def fit_error(micro_batches: list[dict[str, Any]], coef: list[float], cp: int) -> float:
    """Mean absolute relative error of ``t = a Σd² + b Σd + c`` on recorded micro-batches.

    Under CP a rank's time is predicted from its share of the work, taken as ``1 / cp`` of the
    micro-batch (the trainer's fit uses the plan's exact per-rank share)."""
    if not micro_batches:
        return float("nan")
    sq = np.array([float(np.square(np.asarray(m["doc_lens"], float)).sum()) for m in micro_batches])
    lin = np.array([float(np.sum(m["doc_lens"])) for m in micro_batches])
    t = np.array([m["seconds"] for m in micro_batches])
    pred = (coef[0] * sq + coef[1] * lin) / cp + coef[2]
    return float(np.mean(np.abs(pred - t) / t))


def measured_imbalance(per_rank: list[dict[int, dict]], steps: list[int], parallel: str) -> float:
    """Measured micro-batch imbalance, time-weighted: Σ over steps of the slowest micro-batch's
    forward+backward over Σ of the mean.

    With PP each stage's micro-batches are compared (a stage waits for its slowest); with CP the
    ranks run the same micro-batches, so a micro-batch's time is its slowest rank's; otherwise
    every rank's micro-batches are pooled.
    """
    top = total = 0.0
    for s in steps:
        groups: list[np.ndarray] = []
        if parallel == "pp2":
            for r in per_rank:
                for act in r[s].get("pp_actions", []):
                    for fwd, bwd in zip(act["fwd_s"], act["bwd_s"], strict=True):
                        groups.append(np.add(fwd, bwd))
        elif parallel == "cp2":
            groups.append(np.max([r[s]["micro_batch_times_s"] for r in per_rank], axis=0))
        else:
            groups.append(np.concatenate([r[s]["micro_batch_times_s"] for r in per_rank]))
        for times in groups:
            if times.size:
                top += float(times.max())
                total += float(times.mean())
    return top / total if total else 1.0


def calibration_records(per_rank: list[dict[int, dict]], steps: list[int]) -> dict[str, Any]:
    """Measured micro-batches and steps in the simulator's calibration format (docs/simulator.md).

    Each rank's micro-batches are timed on that rank; a step's time is the slowest rank's. Under
    pipeline parallelism (the log has ``pp_actions``) there is one record per micro-batch *and
    stage*: ``seconds`` is that stage's forward + backward, with ``fwd_s``, ``bwd_s``, ``stage`` and
    ``mb`` (the micro-batch's index in the step, the order the schedule runs them) added.
    """
    micro_batches = []
    for rank, rank_log in enumerate(per_rank):
        for s in steps:
            rec = rank_log[s]
            if rec.get("pp_actions"):
                for act in rec["pp_actions"]:
                    lens_list = act.get("doc_lens") or []
                    for stage, fwd, bwd in zip(
                        act["stages"], act["fwd_s"], act["bwd_s"], strict=True
                    ):
                        for mb, (lens, f, b) in enumerate(zip(lens_list, fwd, bwd, strict=False)):
                            micro_batches.append(
                                {"doc_lens": lens, "seconds": f + b, "fwd_s": f, "bwd_s": b,
                                 "stage": stage, "mb": mb, "step": s, "rank": rank}
                            )  # fmt: skip
                continue
            for lens, sec in zip(
                rec.get("micro_batch_doc_lens", []), rec["micro_batch_times_s"], strict=False
            ):
                micro_batches.append({"doc_lens": lens, "seconds": sec, "step": s, "rank": rank})
    step_times = [
        {"step": s, "seconds": max(r[s]["wlb/step_time_s"] for r in per_rank)} for s in steps
    ]
    return {"microbatches": micro_batches, "steps": step_times}


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.e2e_bench", __doc__)
    p.add_argument("--parallel", choices=sorted(PARALLEL), default="pp2", help="2-rank layout")
    p.add_argument("--model", default="tiny", help="llama3_wlb flavor (default: tiny)")
    p.add_argument("--context-len", type=int, default=8192, help="context length L")
    p.add_argument("--micro-batches", type=int, default=8, help="N per optimizer step")
    p.add_argument(
        "--steps",
        type=steps_arg,
        default="epoch",
        help="'epoch' (default): train the document set exactly once; or a fixed step count "
        "(a partial window of the set)",
    )
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median step")
    p.add_argument("--runs", type=int, default=1, help="repeat every mode this many times")
    p.add_argument("--smax-factor", type=float, default=1.25, help="S_max / context (wlb)")
    p.add_argument("--lengths", default="", help="JSON / .npy / text file of document lengths")
    p.add_argument("--generator", choices=list(GENERATORS), default="longtail")
    p.add_argument(
        "--num-docs", type=int, default=9000, help="documents to generate (~50 steps by default)"
    )
    p.add_argument("--scale-from", type=int, default=131072, help="context the lengths are for")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of modes")
    p.add_argument(
        "--cost-model",
        choices=["analytic", "online"],
        default="analytic",
        help="[wlb] cost_model of plain_4d, fixed_4d and wlb (wlb_online is always online)",
    )
    p.add_argument("--fit-warmup", type=int, default=2, help="online: [wlb] fit_warmup_steps")
    p.add_argument(
        "--fit-window",
        type=int,
        default=8,
        help="online: [wlb] fit_window_steps (the last quarter is held out)",
    )
    p.add_argument("--fit-interval", type=int, default=4, help="online: [wlb] fit_interval_steps")
    p.add_argument(
        "--floor-steps",
        type=int,
        default=20,
        help="steps of the noise-floor run (identical micro-batches); 0 skips it",
    )
    p.add_argument(
        "--cp-sharding",
        default="",
        help="comma-separated [wlb] cp_sharding values (e.g. per_document,hybrid): run every mode "
        "once per sharding, with the mode's packer, as '<mode>+<sharding>'",
    )
    p.add_argument("--threads-per-rank", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="", help="keep runs here (default: a temp dir)")
    p.add_argument(
        "--records-out",
        default="",
        help="directory for records_<mode>.json: measured micro-batch and step times in "
        "the format of python -m torchtitan_wlb.sim.calibrate --records",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON (last line)")
    return p


def speedups(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """WLB against each baseline: time to train the set, median step, peak memory."""
    out: dict[str, float] = {}
    if "wlb" not in results:
        return out
    wlb = results["wlb"]
    for base in ("plain", "fixed"):
        other = results.get(f"{base}_4d")
        if other is None:
            continue
        out[f"speedup_wlb_vs_{base}"] = other["time_to_train_s"] / wlb["time_to_train_s"]
        out[f"median_step_speedup_wlb_vs_{base}"] = other["step_time_s"] / wlb["step_time_s"]
        out[f"mem_wlb_vs_{base}"] = wlb["peak_mem_mb"] / other["peak_mem_mb"]
    if "wlb_online" in results:
        online = results["wlb_online"]
        out["speedup_online_vs_wlb"] = wlb["time_to_train_s"] / online["time_to_train_s"]
    return out


def sharding_speedups(
    results: dict[str, dict[str, Any]], modes: list[str], shardings: list[str]
) -> dict[str, float]:
    """Each CP sharding against the first one, per mode: time to train the set, median step."""
    out: dict[str, float] = {}
    base = shardings[0]
    for mode in modes:
        ref = results[f"{mode}+{base}"]
        suffix = "" if len(modes) == 1 else f"_{mode}"
        for other in shardings[1:]:
            res = results[f"{mode}+{other}"]
            key = f"{other}_vs_{base}{suffix}"
            out[f"speedup_{key}"] = ref["time_to_train_s"] / res["time_to_train_s"]
            out[f"median_step_speedup_{key}"] = ref["step_time_s"] / res["step_time_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser().error(
            f"--modes {args.modes!r}: use a comma-separated subset of {', '.join(MODES)}"
        )
    if args.floor_steps < 0 or 0 < args.floor_steps <= args.warmup:
        parser().error(f"--floor-steps {args.floor_steps} must be 0 or exceed --warmup")
    shardings = [s for s in args.cp_sharding.split(",") if s]
    bad = [s for s in shardings if s not in CP_STRATEGIES]
    if bad or (args.cp_sharding and len(set(shardings)) != len(shardings)):
        parser().error(
            f"--cp-sharding {args.cp_sharding!r}: use distinct values of {', '.join(CP_STRATEGIES)}"
        )
    if shardings and args.parallel != "cp2":
        parser().error(f"--cp-sharding needs --parallel cp2 (got --parallel {args.parallel})")
    for name in ("context_len", "micro_batches", "num_docs", "scale_from", "runs"):
        if getattr(args, name) < 1:
            parser().error(f"--{name.replace('_', '-')} = {getattr(args, name)} must be >= 1")
    if args.steps != "epoch" and args.steps <= args.warmup:
        parser().error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    try:
        lengths = make_documents(args)
    except ValueError as e:
        parser().error(str(e))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        data = workdir / "docs.jsonl"
        write_jsonl(lengths, data, args.seed)
        bar = progress(desc="e2e_bench", unit="step")
        floor_data = workdir / "floor.jsonl"
        floors: list[float] = []
        if args.floor_steps:
            n_docs = args.floor_steps * args.micro_batches
            write_jsonl(np.full(n_docs, args.context_len, np.int64), floor_data, args.seed)
        for run in range(args.runs):
            if args.floor_steps:
                floor = run_mode(FLOOR, args, floor_data, workdir / f"run{run}", bar)
                floors.append(floor["measured_imbalance"])
                bar.write(
                    f"run {run + 1}/{args.runs} floor     {floor['steps']} steps of identical "
                    f"micro-batches: measured imbalance {floors[-1]:.3f}",
                    file=sys.stderr,
                )
            results = {}
            for mode, sharding in [(m, s) for m in modes for s in shardings or [""]]:
                label = f"{mode}+{sharding}" if sharding else mode
                results[label] = run_mode(mode, args, data, workdir / f"run{run}", bar, sharding)
                res = results[label]
                bar.write(
                    f"run {run + 1}/{args.runs} {label:9s} {res['steps']} steps, "
                    f"{res['time_to_train_s']:.1f}s to train  median step "
                    f"{res['step_time_s']:.3f}s  imbalance predicted "
                    f"{res['predicted_imbalance']:.3f} measured {res['measured_imbalance']:.3f}  "
                    f"peak {res['peak_mem_mb']:.0f} MB",
                    file=sys.stderr,
                )
            floor_key = {"measured_imbalance_floor": floors[-1]} if floors else {}
            extra = sharding_speedups(results, modes, shardings) if shardings else {}
            runs.append({"modes": results, **speedups(results), **floor_key, **extra})
        bar.close()
    last = runs[-1]["modes"]
    records = {mode: last[mode].pop("records") for mode in last}
    for run in runs[:-1]:
        for res in run["modes"].values():
            res.pop("records")
    if args.records_out:
        out_dir = Path(args.records_out)
        out_dir.mkdir(parents=True, exist_ok=True)
        for mode, rec in records.items():
            with open(out_dir / f"records_{mode}.json", "w") as f:
                layout = {"tp": 1, "cp": 1, "pp": 1, "dp": 1}
                layout[args.parallel[:2]] = 2
                # The flavor is not a simulator preset: the calibration fits coefficients only.
                json.dump({**rec, "layout": layout, "flavor": args.model}, f)
    summary: dict[str, Any] = {
        "parallel": args.parallel,
        "model": args.model,
        "context_len": args.context_len,
        "micro_batches": args.micro_batches,
        "steps": args.steps,
        "warmup": args.warmup,
        "documents": {"count": int(lengths.size), "tokens": int(lengths.sum())},
        "modes": last,
        "runs": [{k: v for k, v in run.items() if k != "modes"} for run in runs],
    }
    for key in runs[0]:
        if key == "modes":
            continue
        values = [run[key] for run in runs]
        summary[key] = float(np.mean(values))
        if len(values) > 1:
            summary[f"{key}_min"] = float(np.min(values))
            summary[f"{key}_max"] = float(np.max(values))
    for mode, res in last.items():
        if args.steps == "epoch" and res["docs_trained"] != lengths.size:
            print(
                f"error: {mode} trained {res['docs_trained']} of {lengths.size} documents",
                file=sys.stderr,
            )
            return 1
    if args.json:
        print(json.dumps(summary))
    else:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
