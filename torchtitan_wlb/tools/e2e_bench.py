"""End-to-end: the time the paper's systems take to train the same documents, each mode a real
``torchtitan_wlb.train`` job on 2 CPU ranks (gloo), read back from its metrics log
(``[wlb.advanced] metrics_jsonl``).

    python -m torchtitan_wlb.tools.e2e_bench --json                  # 2 ranks, PP = 2
    python -m torchtitan_wlb.tools.e2e_bench --parallel cp2 --json   # 2 ranks, CP = 2
    python -m torchtitan_wlb.tools.e2e_bench --parallel cp2 --modes wlb \
        --cp-sharding per_document,hybrid --json   # CP shardings, same packing

Modes, the noise-floor run, measures and JSON keys: docs/benchmarks_e2e.md.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from subprocess import PIPE, STDOUT
from typing import Any

import numpy as np

from torchtitan_wlb.config import MODE_PRESETS, ConfigError, OnlineCostModel
from torchtitan_wlb.cp.adaptive import STRATEGIES as CP_STRATEGIES
from torchtitan_wlb.tools.analysis import (
    FIT_ERROR_FLOOR_KEYS,
    across_runs,
    fit_error,
    fit_error_floor,
    half_gap,
    in_use_error,
    measured_imbalance,
    pipeline_balance_loss,
    predicted_imbalance,
    stage_totals,
)
from torchtitan_wlb.tools.cli import ToolParser, json_text, progress, require_at_least
from torchtitan_wlb.workloads import GENERATORS, generate, load_lengths, steps_arg

ROOT = Path(__file__).resolve().parents[2]
MODES = ("plain_4d", "fixed_4d", "wlb", "wlb_online")  # [wlb] mode presets, and wlb_online
FLOOR = "floor"  # the noise-floor run: every micro-batch one full-context document
STEP_LINE = re.compile(r"step:\s*(\d+)/")  # the trainer's step line, "step:  3/14  loss: ..."
MIN_PASS_STEPS = 40  # fewer steps in a pass and one outlier release can swing time to train
# each 2-rank layout: the [parallelism] degree set to 2
PARALLEL = {"pp2": "pipeline_parallel", "cp2": "context_parallel", "dp2": "data_parallel_shard"}


def make_documents(args: argparse.Namespace) -> np.ndarray:
    """Document lengths (tokens incl. BOS/EOS) for the benchmark, deterministic in the seed."""
    if args.lengths:
        lengths = load_lengths(args.lengths)
    else:
        lengths = generate(args.generator, args.num_docs, args.scale_from, args.seed)
    scaled = np.rint(lengths * (args.context_len / args.scale_from)).astype(np.int64)
    return np.clip(scaled, 3, args.context_len)


def floor_doc_len(lengths: np.ndarray, context_len: int, asked: int = 0) -> int:
    """Length of the noise floor's documents: ``asked``, else ``context_len // k``, ``k`` the
    workload's token-weighted mean documents per context, so that a floor micro-batch costs what a
    typical one does (a full-context document under-measures the floor: docs/benchmarks_e2e.md)."""
    if asked:
        return min(int(asked), context_len)
    lens = np.asarray(lengths, np.float64)
    typical = float((lens * lens).sum() / lens.sum()) if lens.sum() > 0 else float(context_len)
    k = max(1, round(context_len / max(typical, 1.0)))
    k = min(k, max(1, int(np.sqrt(context_len)) - 1))  # k + 1 documents never fit one context
    return context_len // k


def write_jsonl(lengths: np.ndarray, path: Path, seed: int) -> None:
    """One document per line whose byte-tokenized length (+ BOS/EOS) is the given one."""
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    with open(path, "w") as f:
        for n in lengths.tolist():
            text = alphabet[rng.integers(0, alphabet.size, n - 2)].tobytes().decode()
            f.write(json.dumps({"text": "x" + text[1:] if n > 2 else "x"}) + "\n")


def mode_args(mode: str, args: argparse.Namespace, cp_sharding: str = "") -> list[str]:
    """The trainer flags of ``mode`` (with ``cp_sharding``: its packer and that sharding), its cost
    model and the online fit's settings; the floor packs one document per micro-batch."""
    if mode == FLOOR:
        return ["--wlb.packing", "original", "--wlb.cp_sharding", "per_document"]
    preset = "wlb" if mode == "wlb_online" else mode
    flags = ["--wlb.mode", preset]
    if cp_sharding:
        packer = MODE_PRESETS[preset][0]
        flags = ["--wlb.mode", "", "--wlb.packing", packer, "--wlb.cp_sharding", cp_sharding]
    cost = ["--wlb.cost_model", "online" if mode == "wlb_online" else args.cost_model]
    fit = [x for k, v in fit_fields(args).items() for x in (f"--wlb.online.{k}", str(v))]
    return flags + cost + fit


def fit_fields(args: argparse.Namespace) -> dict[str, int]:
    """The ``[wlb.online]`` fields every job gets (the last quarter of the window held out)."""
    return {
        "warmup_steps": args.fit_warmup,
        "window_steps": args.fit_window,
        "holdout_steps": max(1, args.fit_window // 4),
        "interval_steps": args.fit_interval,
    }


def micro_batch_max_len(mode: str, args: argparse.Namespace, floor_len: int) -> int:
    """``[wlb] micro_batch_max_len``: S_max for the modes; for the floor, room for exactly
    ``context // floor_len`` of its documents (identical micro-batches under next-fit packing)."""
    smax = int(args.context_len * args.smax_factor)
    if mode != FLOOR:
        return smax
    k = args.context_len // floor_len
    return max(k * floor_len, min(smax, (k + 1) * floor_len - 1))


def run_mode(
    mode: str,
    args: argparse.Namespace,
    data: Path,
    workdir: Path,
    bar: Any,
    cp_sharding: str = "",
    floor_len: int = 0,
) -> dict[str, Any]:
    """One training job of ``mode`` and its figures, read from every rank's metrics log."""
    label = f"{mode}+{cp_sharding}" if cp_sharding else mode
    dump = workdir / label
    cmd = train_command(mode, args, data, dump, cp_sharding, floor_len)
    wall = run_job(cmd, label, args.threads_per_rank, bar)
    logs = sorted((dump / "wlb_metrics").glob("rank_*.jsonl"))
    per_rank = [{rec["step"]: rec for rec in map(json.loads, log.open())} for log in logs]
    return mode_figures(mode, args, per_rank, wall)


def job_command(nproc: int, args: argparse.Namespace, data: Path, dump: Path) -> list[str]:
    """``torch.distributed.run`` of ``nproc`` ranks training the default CPU job's config on the
    jsonl ``data`` (``args``: model, context_len, micro_batches), dumping to ``dump``."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--role", "rank",
        "-m", "torchtitan_wlb.train",
        "--job.config_file", str(ROOT / "train_configs" / "debug_cpu.toml"),
        "--job.dump_folder", str(dump), "--model.flavor", args.model,
        "--training.dataset", "jsonl", "--training.dataset_path", str(data),
        "--training.seq_len", str(args.context_len),
        "--training.global_batch_size", str(args.micro_batches),
    ]  # fmt: skip


def train_command(
    mode: str, args: argparse.Namespace, data: Path, dump: Path, cp_sharding: str, floor_len: int
) -> list[str]:
    """The 2-rank ``torch.distributed.run`` command line of ``mode``'s training job."""
    n_steps = args.floor_steps if mode == FLOOR else args.steps
    epoch = ["--training.steps", "100000", "--wlb.epochs", "1"]
    steps = epoch if n_steps == "epoch" else ["--training.steps", str(n_steps)]
    return [
        *job_command(2, args, data, dump),
        *steps, *mode_args(mode, args, cp_sharding),
        "--wlb.micro_batch_max_len", str(micro_batch_max_len(mode, args, floor_len)),
        "--wlb.advanced.metrics_jsonl", "--checkpoint.no-enable", "--metrics.log_freq", "1",
        "--metrics.disable_color_printing", "--debug.seed", str(args.seed),
        "--lr_scheduler.warmup_steps", "1",
        f"--parallelism.{PARALLEL[args.parallel]}_degree", "2",
    ]  # fmt: skip


def run_job(cmd: list[str], label: str, threads_per_rank: int, bar: Any) -> float:
    """Run a training job, one tick of ``bar`` per step either rank logs; its wall time (s).
    Raises RuntimeError with the output's tail when the job fails."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank))
    tail: collections.deque[str] = collections.deque(maxlen=200)
    seen: set[int] = set()
    bar.set_postfix_str(label)
    start = time.perf_counter()
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=PIPE, stderr=STDOUT, text=True) as proc:
        for line in proc.stdout:
            tail.append(line)
            if (m := STEP_LINE.search(line)) and int(m.group(1)) not in seen:
                seen.add(int(m.group(1)))
                bar.update(1)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"mode {label} failed:\n{''.join(tail)[-6000:]}")
    return wall


def mode_figures(
    mode: str, args: argparse.Namespace, per_rank: list[dict[int, dict]], wall: float
) -> dict[str, Any]:
    """A job's figures (docs/benchmarks_e2e.md) from its ranks' metrics logs (step -> record)."""
    steps_done = sorted(set.intersection(*(set(r) for r in per_rank)))
    timed = [s for s in steps_done if s > args.warmup] or steps_done
    step_time = {s: max(r[s]["wlb/step_time_s"] for r in per_rank) for s in steps_done}
    step_times = list(step_time.values())
    tokens = sum(per_rank[0][s].get("wlb/tokens", 0.0) for s in steps_done)
    # Pipeline stages and CP ranks share their micro-batches: only DP ranks train different ones.
    dp_ranks = per_rank if args.parallel == "dp2" else per_rank[:1]
    trained = [i for r in dp_ranks for s in steps_done for i in r[s].get("doc_ids", [])]
    first = [per_rank[0][s] for s in steps_done]
    out = {
        "time_to_train_s": sum(step_times),
        "tokens_per_s": tokens / sum(step_times),
        "steps": len(steps_done),
        "step_time_s": statistics.median(step_time[s] for s in timed),
        "step_times_s": step_times,
        "peak_mem_mb": max(r[s]["peak_mem_gib"] for r in per_rank for s in steps_done) * 1024,
        "imbalance": float(np.mean([rec["wlb/imbalance"] for rec in first])),
        "predicted_imbalance": predicted_imbalance(first, [step_time[s] for s in steps_done]),
        "measured_imbalance": measured_imbalance(per_rank, timed, args.parallel),
        "measured_imbalance_device": measured_imbalance(per_rank, timed, args.parallel, True),
        "device_clock": per_rank[0][steps_done[0]].get("device_clock", "wall"),
        "max_tokens_per_microbatch": max(rec["wlb/max_tokens"] for rec in first),
        "docs_trained": len(set(trained)),
        "docs_repeated": len(trained) - len(set(trained)),
        "wall_s": wall,
        "records": calibration_records(per_rank, timed),
    }
    if args.parallel == "pp2":
        out["balance_loss"] = pipeline_balance_loss(out["records"])
    if mode == FLOOR and (gap := half_gap(per_rank, timed, args.parallel)) is not None:
        out["half_gap"] = gap
        out["half_gap_device"] = half_gap(per_rank, timed, args.parallel, True)
    if mode == FLOOR:
        mbs = out["records"]["microbatches"]
        out.update(fit_error_floor(mbs, args.parallel, args.fit_window))
    for key in ("cp_per_document_share", "cp_hybrid_share"):
        shares = [v for rec in first if (v := rec.get(f"wlb/{key}")) is not None]
        if shares:
            out[key] = float(np.mean(shares))
    out.update(refit_figures(first, out["records"]["microbatches"], args.parallel))
    return out


def refit_figures(
    first: list[dict[str, Any]], micro_batches: list[dict[str, Any]], parallel: str
) -> dict[str, Any]:
    """The online model's refits (one rank's records, every step) and its adopted models' fit
    errors on the measured ``micro_batches``; nothing without a refit."""
    out: dict[str, Any] = {}
    refits = [rec for rec in first if "wlb/cost_refit_adopted" in rec]
    adopted = [rec for rec in refits if rec["wlb/cost_refit_adopted"]]
    if refits:
        out.update(refits=len(refits), refits_adopted=len(adopted))
        # When each adopted model took effect: the steps packed by the initial model before it.
        out["refits_effective_steps"] = [int(r["wlb/cost_refit_effective_step"]) for r in adopted]
    if not adopted:
        return out
    last = adopted[-1]
    coef = refit_coefficients(last)
    terms = "abcg"[: len(coef)]  # g: under CP, per gathered token
    out["fit_coefficients"] = dict(zip(terms, coef, strict=True))
    if "g" in terms:
        out["fit_coefficients"]["gathered_share"] = last["wlb/cost_refit_gathered_share"]
    cp = 2 if parallel == "cp2" else 1
    mbs = micro_batches
    if parallel == "pp2":
        # The trainer fits a micro-batch's time through every stage; judged per stage too,
        # each stage taken as half the micro-batch.
        half = [v / 2 for v in coef]
        out["fit_mean_abs_error_per_stage"] = fit_error(mbs, half, 1, "device_s")
        mbs = stage_totals(mbs)
    # On the clock the fit used (the device clock), and on the wall clock beside it.
    out["fit_mean_abs_error"] = fit_error(mbs, coef, cp, key="device_s")
    out["fit_mean_abs_error_wall"] = fit_error(mbs, coef, cp)
    in_use = [(int(r["wlb/cost_refit_effective_step"]), refit_coefficients(r)) for r in adopted]
    out["fit_mean_abs_error_in_use"] = in_use_error(mbs, in_use, cp, key="device_s")
    return out


def refit_coefficients(rec: dict[str, Any]) -> list[float]:
    """An adopted refit's ``(a, b, c[, g])`` from its metrics record (``g``: under CP)."""
    return [rec[f"wlb/cost_refit_{k}"] for k in "abcg" if f"wlb/cost_refit_{k}" in rec]


def calibration_records(per_rank: list[dict[int, dict]], steps: list[int]) -> dict[str, Any]:
    """Measured micro-batches (per micro-batch *and stage* under PP) and steps (the slowest rank's
    time) in the simulator's calibration format, docs/simulator.md."""
    micro_batches = []
    for (rank, rank_log), s in itertools.product(enumerate(per_rank), steps):
        rec, where = rank_log[s], {"step": s, "rank": rank}
        if not rec.get("pp_actions"):
            times = zip(rec["micro_batch_times_s"], rec["micro_batch_device_times_s"], strict=True)
            features = rec.get("micro_batch_fit_features") or []
            for i, (lens, (sec, dev)) in enumerate(
                zip(rec.get("micro_batch_doc_lens", []), times, strict=False)
            ):
                mb = {"doc_lens": lens, "seconds": sec, "device_s": dev, **where}
                if len(features) == len(rec["micro_batch_times_s"]):
                    mb["fit_features"] = features[i]
                micro_batches.append(mb)
            continue
        for act in rec["pp_actions"]:
            per_stage = zip(
                act["stages"],
                act["fwd_s"],
                act["bwd_s"],
                act["fwd_device_s"],
                act["bwd_device_s"],
                strict=True,
            )
            for stage, *times in per_stage:
                lens_times = zip(act.get("doc_lens") or [], *times, strict=False)
                for mb, (lens, f, b, fd, bd) in enumerate(lens_times):
                    micro_batches.append(
                        {
                            "doc_lens": lens,
                            "seconds": f + b,
                            "fwd_s": f,
                            "bwd_s": b,
                            "device_s": fd + bd,
                            "fwd_device_s": fd,
                            "bwd_device_s": bd,
                            "stage": stage,
                            "mb": mb,
                            **where,
                        }
                    )
    step_times = [
        {"step": s, "seconds": max(r[s]["wlb/step_time_s"] for r in per_rank)} for s in steps
    ]
    return {"microbatches": micro_batches, "steps": step_times}


def write_records(out_dir: Path, records: dict[str, dict], parallel: str, flavor: str) -> None:
    """``records_<mode>.json`` per mode: the calibration file ``sim.calibrate --records`` reads,
    with the 2-rank layout (the flavor is not a simulator preset: the fit is of coefficients)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = {"tp": 1, "cp": 1, "pp": 1, "dp": 1, parallel[:2]: 2}
    for mode, rec in records.items():
        with open(out_dir / f"records_{mode}.json", "w") as f:
            json.dump({**rec, "layout": layout, "flavor": flavor}, f)


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.e2e_bench", __doc__)
    p.add_argument("--parallel", choices=sorted(PARALLEL), default="pp2", help="2-rank layout")
    p.add_argument("--model", default="tiny", help="llama3_wlb flavor (default: tiny)")
    p.add_argument("--context-len", type=int, default=8192, help="context length L")
    p.add_argument("--micro-batches", type=int, default=8, help="N per optimizer step")
    p.add_argument("--steps", type=steps_arg, default="epoch", help="'epoch' or a step count")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median step")
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat every mode this many times (the modes' order reversed every other run)",
    )
    p.add_argument("--smax-factor", type=float, default=1.25, help="S_max / context (wlb)")
    p.add_argument("--lengths", default="", help="JSON / .npy / text file of document lengths")
    p.add_argument("--generator", choices=list(GENERATORS), default="longtail")
    p.add_argument("--num-docs", type=int, default=9000, help="documents to generate")
    p.add_argument("--scale-from", type=int, default=131072, help="context the lengths are for")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of modes")
    p.add_argument("--cost-model", choices=["analytic", "online"], default="analytic")
    for name, default in (("warmup", 2), ("window", 8), ("interval", 4)):
        p.add_argument(
            f"--fit-{name}", type=int, default=default, help=f"[wlb.online] {name}_steps"
        )
    p.add_argument("--floor-steps", type=int, default=20, help="noise-floor steps; 0: none")
    p.add_argument(
        "--floor-doc-len",
        type=int,
        default=0,
        help="floor documents' length (0: context / k, k typical documents per context)",
    )
    p.add_argument("--cp-sharding", default="", help="comma-separated [wlb] cp_sharding values")
    p.add_argument("--threads-per-rank", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="", help="keep runs here (default: a temp dir)")
    p.add_argument("--records-out", default="", help="directory for records_<mode>.json")
    p.add_argument("--json", action="store_true", help="print the result as JSON (last line)")
    return p


def speedups(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """WLB against each baseline: time to train the set, median step, peak memory."""
    out: dict[str, float] = {}
    wlb = results.get("wlb")
    for base in ("plain", "fixed") if wlb else ():
        if (other := results.get(f"{base}_4d")) is not None:
            out[f"speedup_wlb_vs_{base}"] = other["time_to_train_s"] / wlb["time_to_train_s"]
            out[f"median_step_speedup_wlb_vs_{base}"] = other["step_time_s"] / wlb["step_time_s"]
            out[f"mem_wlb_vs_{base}"] = wlb["peak_mem_mb"] / other["peak_mem_mb"]
    if wlb and "wlb_online" in results:
        online = results["wlb_online"]
        out["speedup_online_vs_wlb"] = wlb["time_to_train_s"] / online["time_to_train_s"]
    return out


# Each mode's figures a run reports as ``<figure>_<mode>`` beside its speedups, so that --runs
# gives their mean and interval (the whole ``modes`` block is the last run's alone).
PER_RUN_FIGURES = (
    "time_to_train_s",
    "measured_imbalance",
    "measured_imbalance_device",
    "fit_mean_abs_error",
    "fit_mean_abs_error_in_use",
    "docs_trained",
    "docs_repeated",
)


def per_run_figures(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """``<figure>_<mode>`` for each of :data:`PER_RUN_FIGURES` a mode reports."""
    return {
        f"{key}_{label}": float(res[key])
        for label, res in results.items()
        for key in PER_RUN_FIGURES
        if key in res
    }


def not_exactly_once(runs: list[dict[str, Any]], count: int) -> list[str]:
    """An error line for each mode of each run that did not train the ``count`` documents exactly
    once (a whole pass, ``--steps epoch``): every run is checked, not the last alone."""
    return [
        f"error: run {i + 1}: {mode} trained {res['docs_trained']} of {count} documents, "
        f"{res['docs_repeated']} repeated"
        for i, run in enumerate(runs)
        for mode, res in run["modes"].items()
        if res["docs_trained"] != count or res["docs_repeated"]
    ]


def over_floor(results: dict[str, dict[str, Any]], floor: dict[str, Any]) -> dict[str, float]:
    """Each mode's ``measured_imbalance`` less the noise floor's of the same run, on the wall clock
    and on the device's: what the online cost model's target is stated in (docs/cost_model.md)."""
    out: dict[str, float] = {}
    for label, res in results.items():
        for clock in ("", "_device"):
            excess = res[f"measured_imbalance{clock}"] - floor[f"measured_imbalance{clock}"]
            out[f"imbalance_over_floor{clock}_{label}"] = excess
    return out


def short_passes(results: dict[str, dict[str, Any]]) -> list[str]:
    """A warning per mode whose whole pass took fewer than ``MIN_PASS_STEPS`` steps."""
    return [
        f"warning: {mode} trained the set in {res['steps']} steps (< {MIN_PASS_STEPS}): one "
        "outlier release can swing its time to train; raise --num-docs"
        for mode, res in results.items()
        if res["steps"] < MIN_PASS_STEPS
    ]


def sharding_speedups(
    results: dict[str, dict[str, Any]], modes: list[str], shardings: list[str]
) -> dict[str, float]:
    """Each CP sharding against the first one, per mode: time to train the set, median step."""
    out: dict[str, float] = {}
    base = shardings[0]
    for mode, other in itertools.product(modes, shardings[1:]):
        ref, res = results[f"{mode}+{base}"], results[f"{mode}+{other}"]
        key = f"{other}_vs_{base}" + ("" if len(modes) == 1 else f"_{mode}")
        out[f"speedup_{key}"] = ref["time_to_train_s"] / res["time_to_train_s"]
        out[f"median_step_speedup_{key}"] = ref["step_time_s"] / res["step_time_s"]
    return out


def _check(p: ToolParser, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The modes and CP shardings asked for; one error line for a bad command line."""
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes {args.modes!r}: use a comma-separated subset of {', '.join(MODES)}")
    if args.floor_steps < 0 or 0 < args.floor_steps <= args.warmup:
        p.error(f"--floor-steps {args.floor_steps} must be 0 or exceed --warmup")
    if not 0 <= args.floor_doc_len <= args.context_len:
        p.error(f"--floor-doc-len {args.floor_doc_len} must be in [0, --context-len] (0: auto)")
    shardings = [s for s in args.cp_sharding.split(",") if s]
    if set(shardings) - set(CP_STRATEGIES) or len(set(shardings)) != len(shardings):
        values = ", ".join(CP_STRATEGIES)
        p.error(f"--cp-sharding {args.cp_sharding!r}: use distinct values of {values}")
    if shardings and args.parallel != "cp2":
        p.error(f"--cp-sharding needs --parallel cp2 (got --parallel {args.parallel})")
    require_at_least(p, args, ("context_len", "micro_batches", "num_docs", "scale_from", "runs"))
    if args.steps != "epoch" and args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    try:  # the jobs' [wlb.online] fields, checked before any job starts
        OnlineCostModel(**fit_fields(args))
    except ConfigError as e:
        p.error(
            f"--fit-warmup {args.fit_warmup} --fit-window {args.fit_window} --fit-interval "
            f"{args.fit_interval}: {e}"
        )
    return modes, shardings


def label_of(job: tuple[str, str, Path]) -> str:
    """A job's key in the results: its mode, and its CP sharding where several are compared."""
    mode, sharding, _ = job
    return f"{mode}+{sharding}" if sharding else mode


def run_order(jobs: list[tuple[str, str, Path]], run: int) -> list[tuple[str, str, Path]]:
    """The jobs of run ``run`` (0-based) in the order they train: the noise floor first, then the
    modes as ``--modes`` lists them, reversed every other run. The machine's speed drifts within
    a run by a few per cent; one fixed order would hand that drift to the same mode every run,
    alternating splits it between them over an even number of runs."""
    floor = [job for job in jobs if job[0] == FLOOR]
    modes = [job for job in jobs if job[0] != FLOOR]
    return floor + (modes[::-1] if run % 2 else modes)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    modes, shardings = _check(p, args)
    try:
        lengths = make_documents(args)
    except ValueError as e:
        p.error(str(e))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        data, floor_data = workdir / "docs.jsonl", workdir / "floor.jsonl"
        write_jsonl(lengths, data, args.seed)
        jobs = [(m, s, data) for m in modes for s in shardings or [""]]
        floor_len = floor_doc_len(lengths, args.context_len, args.floor_doc_len)
        if args.floor_steps:  # first, the noise floor's identical micro-batches
            n_docs = args.floor_steps * args.micro_batches * (args.context_len // floor_len)
            write_jsonl(np.full(n_docs, floor_len, np.int64), floor_data, args.seed)
            jobs.insert(0, (FLOOR, "", floor_data))
        bar = progress(desc="e2e_bench", unit="step")
        floor_records: dict[int, dict[str, Any]] = {}
        for run in range(args.runs):
            results, rundir = {}, workdir / f"run{run}"
            for mode, sharding, docs in run_order(jobs, run):
                label = label_of((mode, sharding, docs))
                res = run_mode(mode, args, docs, rundir, bar, sharding, floor_len)
                results[label] = res
                bar.write(
                    f"run {run + 1}/{args.runs} {label:9s} {res['steps']} steps, "
                    f"{res['time_to_train_s']:.1f}s to train  median step {res['step_time_s']:.3f}s  "
                    f"imbalance predicted {res['predicted_imbalance']:.3f} measured "
                    f"{res['measured_imbalance']:.3f} (device clock "
                    f"{res['measured_imbalance_device']:.3f})  peak {res['peak_mem_mb']:.0f} MB",
                    file=sys.stderr,
                )
            results = {label_of(job): results[label_of(job)] for job in jobs}  # as asked
            floor_key = {}
            if floor := results.pop(FLOOR, None):
                # Kept for --records-out: identical micro-batches' own timing noise, to set beside
                # the modes' fit residuals (docs/benchmarks_e2e.md).
                floor_records[run] = floor.pop("records")
                floor_key["floor_doc_len"] = floor_len
                floor_key["measured_imbalance_floor"] = floor["measured_imbalance"]
                floor_key["measured_imbalance_floor_device"] = floor["measured_imbalance_device"]
                if "half_gap" in floor:
                    floor_key["floor_half_gap"] = floor["half_gap"]
                    floor_key["floor_half_gap_device"] = floor["half_gap_device"]
                floor_key.update({k: floor[k] for k in FIT_ERROR_FLOOR_KEYS if k in floor})
                floor_key.update(over_floor(results, floor))
            extra = sharding_speedups(results, modes, shardings) if shardings else {}
            figures = per_run_figures(results)
            runs.append({"modes": results, **speedups(results), **floor_key, **extra, **figures})
        bar.close()
    records = [{mode: res.pop("records") for mode, res in run["modes"].items()} for run in runs]
    last = runs[-1]["modes"]
    if args.records_out:
        last_records = records[-1]
        if floor_records:
            last_records[FLOOR] = floor_records[len(runs) - 1]
        write_records(Path(args.records_out), last_records, args.parallel, args.model)
    shown = ("parallel", "model", "context_len", "micro_batches", "steps", "warmup")
    summary: dict[str, Any] = {
        **{key: getattr(args, key) for key in shown},
        "documents": {"count": int(lengths.size), "tokens": int(lengths.sum())},
        "modes": last,
        "runs": [{k: v for k, v in run.items() if k != "modes"} for run in runs],
    }
    summary.update(across_runs(runs))
    if args.steps == "epoch" and (errors := not_exactly_once(runs, int(lengths.size))):
        print("\n".join(errors), file=sys.stderr)
        return 1
    for line in short_passes(last) if args.steps == "epoch" else ():
        print(line, file=sys.stderr)
    print(json_text(summary, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
