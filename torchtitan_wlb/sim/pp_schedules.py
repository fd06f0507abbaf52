"""Pipeline bubbles of torch's schedules on packed micro-batches: each schedule's action order,
read from torch (``torchtitan_wlb.pipeline.orders``), replayed on the simulator's per-stage times
of the micro-batches each mode packs (docs/simulator.md, "Pipeline schedules").

    python -m torchtitan_wlb.sim.pp_schedules --lengths FILE --model 7B --context-len 131072 \\
        --tp 8 --cp 2 --pp 4 --micro-batches 8 --json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from torchtitan_wlb.sim import timing
from torchtitan_wlb.sim.cli import add_setup_args, config_from_args
from torchtitan_wlb.sim.config import MODES, SimConfig
from torchtitan_wlb.sim.engine import cp_shards, pack_steps, shard_costs
from torchtitan_wlb.sim.timeline import build_action_timeline, simulate_actions
from torchtitan_wlb.workloads import (
    DEFAULT_NUM_DOCS,
    GENERATORS,
    generate,
    load_lengths,
    steps_arg,
)

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble", "LoopedBFS")
COMPARED_MODES = ("fixed_4d", "wlb")


def build_parser() -> argparse.ArgumentParser:
    """``wlb-sim``'s model, layout and packer options (its ``--schedule`` and ``--v`` have no
    effect: every schedule of ``--schedules`` runs, the multi-stage ones with 2 stages per rank)."""
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_wlb.sim.pp_schedules",
        description="Bubble fraction of torch's pipeline schedules on Fixed-4D- and WLB-packed "
        "micro-batches.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", help="document lengths: JSON list, .npy, or one integer per line")
    src.add_argument(
        "--generator", default="longtail", help=f"built-in workload ({', '.join(GENERATORS)})"
    )
    add_setup_args(p)
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated torch names")
    p.add_argument("--modes", default=",".join(COMPARED_MODES), help="comma-separated sim modes")
    p.add_argument(
        "--steps",
        type=steps_arg,
        default=20,
        help="timed steps, or 'epoch': one pass over the source",
    )
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--smax-factor", type=float, default=1.25, help="S_max / context length")
    p.add_argument(
        "--queue-thresholds", default=None, help="comma-separated tokens (default: auto)"
    )
    p.add_argument(
        "--cp-profile", default=None, metavar="FILE", help="measured CP throughput profile"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def mode_stage_times(mode_name: str, lengths, cfg: SimConfig) -> tuple[dict[int, tuple], float]:
    """Per stages-per-rank count (1, 2): [steps x DP, stages, m] forward, backward and weight-grad
    seconds and [steps x DP, m] transfer seconds of the micro-batches ``mode_name`` packs; and
    their mean tokens per step (modes pack different token counts)."""
    steps, _ = pack_steps(MODES[mode_name], lengths, cfg, cfg.warmup_steps + cfg.steps)
    steps = steps[cfg.warmup_steps :]
    tokens = float(np.mean([sum(int(np.sum(mb)) for mb in s) for s in steps]))
    flat = [np.asarray(mb, dtype=np.int64) for s in steps for mb in s]
    mode = MODES[mode_name]
    costs = shard_costs(cp_shards(flat, cfg, mode.cp_strategy, mode.cp_candidates), cfg)
    model, lay, hw, m = cfg.model, cfg.layout, cfg.hardware, cfg.m
    out = {}
    for chunks in (1, 2):
        fwd, bwd, p2p = timing.stage_times(model, lay, hw, chunks, costs)
        wgt = timing.weight_grad_times(model, lay, hw, chunks, costs)
        n_v = fwd.shape[1]
        # [steps * N, V] -> [steps * dp, V, m], as the simulator's engine lays them out
        f, b, w = (x.reshape(-1, m, n_v).transpose(0, 2, 1) for x in (fwd, bwd, wgt))
        out[chunks] = (f, b, w, p2p.reshape(-1, m))
    return out, tokens


def schedule_bubbles(name: str, times: dict[int, tuple], cfg: SimConfig) -> dict[str, float]:
    """One schedule on one mode's micro-batches: the idle share of the slowest DP replica's
    pipeline (as the simulator's ``bubble_fraction``) and its step time, means over steps."""
    from torchtitan_wlb.pipeline.orders import VARLEN_SCHEDULES, schedule_actions

    chunks = 1 if VARLEN_SCHEDULES[name] == "single" else 2
    pp, m, dp = cfg.layout.pp, cfg.m, cfg.layout.dp
    tl = build_action_timeline(schedule_actions(name, pp, m, chunks), pp * chunks, m)
    res = simulate_actions(tl, *times[chunks])
    makespan = res.makespan.reshape(-1, dp)
    slowest = makespan.argmax(axis=1)
    bubble = res.bubble_fraction.reshape(-1, dp)[np.arange(makespan.shape[0]), slowest]
    return {
        "bubble_fraction": float(bubble.mean()),
        "pipeline_time_s": float(makespan.max(axis=1).mean()),
    }


def run(args: argparse.Namespace) -> dict:
    """The JSON object: the configuration, then per schedule and mode its bubble and time."""
    # The pipeline package imports torch: not for --help or a bad flag.
    from torchtitan_wlb.pipeline.orders import VARLEN_SCHEDULES, canonical_name

    if args.pp < 2:
        raise ValueError(f"--pp {args.pp}: pipeline schedules need --pp >= 2")
    names = [canonical_name(s.strip()) for s in args.schedules.split(",") if s.strip()]
    if bad := [n for n in names if n not in VARLEN_SCHEDULES]:
        raise ValueError(f"unknown schedule {bad[0]!r}; accepted: {', '.join(VARLEN_SCHEDULES)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        raise ValueError(f"unknown mode {bad[0]!r}; accepted: {', '.join(MODES)}")
    lengths = (
        load_lengths(args.lengths)
        if args.lengths
        else generate(args.generator, DEFAULT_NUM_DOCS, args.context_len, seed=args.seed)
    )
    # The packing does not depend on the schedule; 1F1B passes every micro-batch count.
    cfg = config_from_args(replace_schedule(args), int(np.asarray(lengths).sum()))
    times = {mode: mode_stage_times(mode, lengths, cfg) for mode in modes}
    table = {
        name: {mode: schedule_bubbles(name, times[mode][0], cfg) for mode in modes}
        for name in names
    }
    config = {"model": cfg.model.name, "context_len": cfg.context_len, "layout": cfg.layout.label}
    config |= {"micro_batches": cfg.m, "steps": cfg.steps, "hardware": cfg.hardware.name}
    tokens = {mode: times[mode][1] for mode in modes}
    return {"config": config, "tokens_per_step": tokens, "schedules": table}


def replace_schedule(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the simulator's 1F1B, which takes every micro-batch count."""
    return argparse.Namespace(**(vars(args) | {"schedule": "1f1b"}))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    c = out["config"]
    print(
        f"{c['model']}  context {c['context_len']}  {c['layout']}  {c['micro_batches']} "
        f"micro-batches  {c['steps']} steps  hardware {c['hardware']}"
    )
    modes = list(out["tokens_per_step"])
    print(
        "tokens per step: " + ", ".join(f"{m} {t:.0f}" for m, t in out["tokens_per_step"].items())
    )
    print(f"{'schedule':<24}" + "".join(f"{m + ' bubble':>18}{m + ' s':>14}" for m in modes))
    for name, row in out["schedules"].items():
        cells = "".join(
            f"{row[m]['bubble_fraction']:>18.3f}{row[m]['pipeline_time_s']:>14.3f}" for m in modes
        )
        print(f"{name:<24}{cells}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
