"""``wlb-sim`` (``python -m torchtitan_wlb.sim``): simulate 4D training steps under each mode
(options and JSON keys: docs/simulator.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from torchtitan_wlb.models.catalogue import DIM_FIELDS, MODELS, ModelSpec, get_model
from torchtitan_wlb.sim.config import MODES, REQUIRED_MODES, SimConfig, epoch_steps
from torchtitan_wlb.sim.engine import ModeResult, simulate_mode, speedup
from torchtitan_wlb.sim.hardware import get_hardware, resolve_layout
from torchtitan_wlb.workloads import DEFAULT_NUM_DOCS, GENERATORS, generate, load_lengths, steps_arg


# fmt: off
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wlb-sim", description="Simulate WLB-LLM vs Plain-4D / "
                                "Fixed-4D step times on a 4D-parallel layout.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", help="document lengths: JSON list, .npy, or one integer per line")
    src.add_argument("--generator", default="longtail", help=f"built-in workload ({', '.join(GENERATORS)})")
    add_setup_args(p)
    p.add_argument("--modes", default=",".join(REQUIRED_MODES), help=f"comma-separated, or 'all' ({', '.join(MODES)})")
    p.add_argument("--outlier-delay", choices=["on", "off"], default="on", help="of the 'wlb' mode")
    p.add_argument("--steps", type=steps_arg, default=20, help="timed steps, or 'epoch': one pass over the source")
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--smax-factor", type=float, default=1.25, help="S_max / context length")
    p.add_argument("--queue-thresholds", default=None, help="comma-separated tokens (default: auto)")
    p.add_argument("--cp-profile", default=None, metavar="FILE", help="measured CP throughput profile")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures into DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def add_setup_args(p: argparse.ArgumentParser) -> None:
    """The model, layout, hardware and packer options (``wlb-analyze`` takes them too)."""
    p.add_argument("--model", default="7B", help=f"preset: {', '.join(MODELS)} or 'custom'")
    for dim in DIM_FIELDS:
        p.add_argument(f"--{dim.replace('_', '-')}", type=int, default=None, help=f"custom model {dim}")
    p.add_argument("--context-len", type=int, default=131072)
    for name, default in (("tp", 8), ("cp", 2), ("pp", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dp", type=int, default=None, help="default: --gpus / (TP*CP*PP), else 1")
    p.add_argument("--gpus", type=int, default=None, help="GPU count the layout must divide")
    p.add_argument("--schedule", default="interleaved_1f1b", choices=["1f1b", "interleaved_1f1b"])
    p.add_argument("--v", type=int, default=2, help="model chunks per stage (interleaved 1F1B)")
    p.add_argument("--micro-batches", type=int, default=None, help="per pipeline per step (default: PP)")
    p.add_argument("--hardware", default="h100", help="profile name (h100, h200) or JSON file")
    p.add_argument("--max-delay", type=int, default=4, help="longest outlier wait (steps)")
    p.add_argument("--cost-model", choices=["profiled", "analytic"], default="profiled")
    p.add_argument("--seed", type=int, default=0)
# fmt: on


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """A preset, a preset with some dims replaced, or fully custom dims."""
    overrides = {d: getattr(args, d) for d in DIM_FIELDS if getattr(args, d) is not None}
    if args.model.lower() == "custom":
        if missing := ["--" + d.replace("_", "-") for d in DIM_FIELDS if d not in overrides]:
            raise ValueError("--model custom needs " + ", ".join(missing))
        return ModelSpec("custom", **overrides)
    try:
        base = get_model(args.model)
    except ValueError as exc:
        raise ValueError(f"{exc} (or 'custom' with --dim/--n-layers/--n-heads/...)") from None
    return ModelSpec(f"{base.name}-custom", **(base.dims() | overrides)) if overrides else base


def config_from_args(args: argparse.Namespace, total_tokens: int | None = None) -> SimConfig:
    """The SimConfig of the command line; ``total_tokens`` of the source resolves ``--steps epoch``."""
    text, epoch = args.queue_thresholds, args.steps == "epoch"
    try:
        thresholds = tuple(int(t) for t in text.split(",")) if text else None
    except ValueError:
        raise ValueError(f"--queue-thresholds {text!r} must be comma-separated integers") from None
    cfg = SimConfig(
        layout=resolve_layout(args.tp, args.cp, args.pp, args.dp, args.gpus),
        model=model_from_args(args),
        context_len=args.context_len,
        hardware=get_hardware(args.hardware),
        schedule=args.schedule,
        v=args.v,
        steps=1 if epoch else args.steps,
        warmup_steps=args.warmup_steps,
        micro_batches=args.micro_batches,
        smax_factor=args.smax_factor,
        queue_thresholds=thresholds,
        max_delay_steps=args.max_delay,
        seed=args.seed,
        cost_model=args.cost_model,
        cp_profile=getattr(args, "cp_profile", None),
    )
    if not epoch:
        return cfg
    return replace(
        cfg, steps=epoch_steps(total_tokens, cfg.n_global, cfg.context_len, cfg.warmup_steps)
    )


def summarize(results: dict[str, ModeResult]) -> dict:
    """The JSON object: every mode's summary, then the speedups (time per token)."""
    plain, wlb = results["plain_4d"], results["wlb"]
    out: dict = {name: r.summary() for name, r in results.items()}
    out["speedup_wlb_vs_plain"] = speedup(plain, wlb)
    out["speedup_wlb_vs_fixed"] = speedup(results["fixed_4d"], wlb)
    return out | {
        f"speedup_{n}_vs_plain": speedup(plain, r) for n, r in results.items() if n != "plain_4d"
    }


def run(args: argparse.Namespace) -> tuple[dict, dict[str, ModeResult], SimConfig]:
    lengths = (
        load_lengths(args.lengths)
        if args.lengths
        else generate(args.generator, DEFAULT_NUM_DOCS, args.context_len, seed=args.seed)
    )
    cfg = config_from_args(args, int(np.asarray(lengths).sum()))
    asked = list(MODES) if args.modes == "all" else [m.strip() for m in args.modes.split(",") if m]
    if unknown := [n for n in asked if n not in MODES]:
        raise ValueError(f"unknown mode {unknown[0]!r}; accepted: {', '.join(MODES)}")
    # The JSON object always carries the paper's three systems, first.
    modes = [MODES[n] for n in dict.fromkeys([*REQUIRED_MODES, *asked])]
    if args.outlier_delay == "off":
        modes = [
            replace(m, outlier_delay=False, description=m.description + " (no delay)")
            if m.name == "wlb"
            else m
            for m in modes
        ]
    results = {m.name: simulate_mode(m, lengths, cfg) for m in modes}
    return summarize(results), results, cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        out, results, cfg = run(args)
        if args.plot:
            from torchtitan_wlb.sim import plots

            d = Path(args.plot)
            d.mkdir(parents=True, exist_ok=True)
            plots.latency_heatmap(list(results.values()), d / "latency_heatmap.png")
            plots.gantt(list(results.values()), d / "pipeline_gantt.png")
            label = f"{cfg.model.name} {cfg.context_len // 1024}K {cfg.layout.label}"
            speedups = {n: out[f"speedup_{n}_vs_plain"] for n in results if n != "plain_4d"}
            plots.speedup_bars({label: speedups}, d / "speedup.png")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out["sim_seconds"] = time.perf_counter() - t0
    print(
        f"{cfg.model.name}  context {cfg.context_len}  {cfg.layout.label}  {cfg.schedule} "
        f"(v={cfg.chunks})  {cfg.steps} steps  hardware {cfg.hardware.name}"
    )
    w = max(16, *(len(n) + 2 for n in results))
    print(f"{'mode':<{w}}{'step_s':>9}{'imbal':>8}{'bubble':>8}{'speedup':>9}")
    for name in results:
        s, sp = out[name], out.get(f"speedup_{name}_vs_plain", 1.0)
        print(
            f"{name:<{w}}{s['step_time_s']:>9.3f}{s['imbalance']:>8.3f}"
            f"{s['bubble_fraction']:>8.3f}{sp:>8.3f}x"
        )
    print(
        f"WLB vs Plain-4D {out['speedup_wlb_vs_plain']:.3f}x, vs Fixed-4D "
        f"{out['speedup_wlb_vs_fixed']:.3f}x  ({out['sim_seconds']:.1f} s)"
    )
    if args.json:
        print(json.dumps(out))
    return 0
