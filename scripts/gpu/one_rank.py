"""Rank 0 of the real layouts, measured against the simulator's prediction for that rank.

For each config, runs ``COMM_MODE=fake_backend NGPU=<world> ./run_train.sh`` for a few steps (rank
0 alone, its collectives faked, on the built-in corpus and byte tokenizer, offline), then
``torchtitan_wlb.sim.rank`` on the same config and the steps' own micro-batches. Prints a table
and one JSON object last (also written to ``OUT/one_rank.json``):

    python scripts/gpu/one_rank.py --out outputs/one_rank                      # on the GPU
    python scripts/gpu/one_rank.py --rehearsal --out /tmp/one_rank_rehearsal  # any CPU, < 1 min

Measured, per step after the first (warm-up): ``peak_active_gib`` / ``peak_mem_gib`` of the
metrics log (on a CPU the resident set), and the compute time of the rank: its pipeline actions'
forward and backward on the device clock (CUDA events; on a CPU the thread's CPU time), no waits
and no optimizer. Predicted: ``peak_memory_gib`` (S_max tokens per micro-batch) and
``peak_memory_gib_at_measured_tokens`` (the longest micro-batch the run had), and ``compute_s``
of the logged micro-batches. ``--rehearsal`` shrinks each config (byte_1B model, 128-token
context, fp32, 4 micro-batches a step, 2 steps) so that the whole script runs on a CPU; the
layouts stay the configs' own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "llama3_8b_128k": "train_configs/llama3_8b_128k.toml",
    "paper_7b_128k": "train_configs/paper/7b_128k.toml",
}
OFFLINE = [
    "--model.hf_assets_path", "", "--training.dataset", "wlb_builtin",
    "--training.dataset_path", "", "--checkpoint.no-enable", "--metrics.log_freq", "1",
    "--metrics.no-enable-tensorboard", "--wlb.advanced.metrics_jsonl",
]  # fmt: skip
REHEARSAL = [
    "--model.flavor", "byte_1B", "--training.seq_len", "128", "--wlb.micro_batch_max_len", "160",
    "--training.mixed_precision_param", "float32", "--training.dtype", "float32",
    "--training.global_batch_size", "4",
]  # fmt: skip
GIB = 2**30


def world_size(overrides: list[str], config: str) -> int:
    """The layout's rank count (data_parallel_shard_degree = -1 counts as 1)."""
    from torchtitan_wlb.sim.rank import load_job_config
    from torchtitan_wlb.validate import layout_world_size

    return layout_world_size(load_job_config(config, overrides).parallelism)


def run_rank0(config: str, overrides: list[str], world: int, log: Path, timeout: int) -> int:
    """The fake-backend run of rank 0; its output goes to ``log``; returns the exit status."""
    env = dict(os.environ, COMM_MODE="fake_backend", NGPU=str(world), CONFIG_FILE=config)
    env.setdefault("WLB_PYTHON", sys.executable)
    with log.open("w") as f:
        try:
            return subprocess.run(
                ["./run_train.sh", *overrides], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            f.write(f"\none_rank.py: stopped after {timeout} s\n")
            return 124


def measured(jsonl: Path) -> list[dict]:
    """Per logged step: peak memory and the rank's compute seconds on the device clock."""
    steps = []
    for line in jsonl.read_text().splitlines():
        rec = json.loads(line)
        actions = rec.get("pp_actions") or []
        if actions:
            a = actions[0]
            compute = sum(map(sum, a["fwd_device_s"])) + sum(map(sum, a["bwd_device_s"]))
        else:
            compute = sum(rec.get("micro_batch_device_times_s") or [])
        steps.append(
            {
                "step": rec["step"],
                "compute_s": compute,
                "peak_active_gib": rec.get("peak_active_gib", rec["peak_mem_gib"]),
                "peak_reserved_gib": rec["peak_mem_gib"],
                "step_time_s": rec.get("wlb/step_time_s"),
                "device_clock": rec.get("device_clock"),
            }
        )
    return steps


def one_config(name: str, config: str, args: argparse.Namespace) -> dict:
    """Run, read and predict one config; a failed run is reported, not raised."""
    from torchtitan_wlb.sim.hardware import get_hardware
    from torchtitan_wlb.sim.rank import load_job_config, measured_steps, predict, rank_setup

    dump = Path(args.out, name)
    extra = REHEARSAL if args.rehearsal else []
    overrides = [*OFFLINE, *extra, "--job.dump_folder", str(dump), "--training.steps",
                 str(args.steps)]  # fmt: skip
    world = world_size(overrides, config)
    start = time.perf_counter()
    rc = run_rank0(config, overrides, world, Path(args.out, f"{name}.log"), args.timeout)
    result: dict = {"config": config, "world": world, "rc": rc}
    result["run_s"] = time.perf_counter() - start
    jsonl = dump / "wlb_metrics" / "rank_0.jsonl"
    if not jsonl.is_file():
        return result | {"error": f"no metrics log; see {name}.log"}
    steps = measured(jsonl)
    later = [s for s in steps if s["step"] > 1] or steps
    result["measured"] = {
        "steps": steps,
        "compute_s": sum(s["compute_s"] for s in later) / len(later),
        "peak_active_gib": max(s["peak_active_gib"] for s in later),
        "peak_reserved_gib": max(s["peak_reserved_gib"] for s in later),
    }
    setup = rank_setup(load_job_config(config, overrides), 0, world)
    result["predicted"] = predict(setup, get_hardware(args.hardware), measured_steps(jsonl), None)
    return result


def table(results: dict) -> list[str]:
    """Measured against predicted, with their ratio, one row per config and figure."""
    rows = [f"{'config':<16}{'figure':<22}{'measured':>10}{'predicted':>11}{'ratio':>10}"]
    for name, r in results.items():
        if "measured" not in r:
            rows.append(f"{name:<16}failed (exit status {r['rc']}): {r.get('error', '')}")
            continue
        m, p = r["measured"], r["predicted"]
        for label, a, b in (
            ("peak memory GiB", m["peak_active_gib"], p["peak_memory_gib_at_measured_tokens"]),
            ("peak memory@Smax GiB", m["peak_active_gib"], p["peak_memory_gib"]),
            ("compute s/step", m["compute_s"], p["compute_s"]["step_s"]),
        ):
            ratio = a / b if b else float("nan")
            rows.append(f"{name:<16}{label:<22}{a:>10.4g}{b:>11.4g}{ratio:>10.3g}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/one_rank", help="run folders, logs, one_rank.json")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument(
        "--steps", type=int, default=None, help="per run, the first a warm-up (4; rehearsal 2)"
    )
    p.add_argument("--hardware", default="h200", help="simulator profile (h200)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per run (240)")
    p.add_argument("--rehearsal", action="store_true", help="shrunk configs, for a CPU")
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.rehearsal else 4)
    names = [n for n in args.configs.split(",") if n]
    if unknown := [n for n in names if n not in CONFIGS]:
        p.error(f"--configs: unknown {unknown[0]!r}; accepted: {', '.join(CONFIGS)}")
    if args.steps < 2:
        p.error(f"--steps {args.steps} must be >= 2 (the first is a warm-up)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = {n: one_config(n, CONFIGS[n], args) for n in names}
    print("\n".join(table(results)))
    out = {"rehearsal": args.rehearsal, "hardware": args.hardware, "configs": results}
    Path(args.out, "one_rank.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return 0 if all("measured" in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
