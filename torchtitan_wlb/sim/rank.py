"""One rank of a training config: its predicted peak memory and compute time per step.

    python -m torchtitan_wlb.sim.rank --config train_configs/llama3_8b_128k.toml
    python -m torchtitan_wlb.sim.rank --config train_configs/paper/7b_128k.toml --rank 3 --json
    python -m torchtitan_wlb.sim.rank --config train_configs/debug_cpu.toml \\
        --metrics outputs/run/wlb_metrics/rank_0.jsonl -- --training.seq_len 1024

The config is read as the trainer reads it (TorchTitan's flags follow ``--``). Memory comes from
:mod:`torchtitan_wlb.sim.memory`; compute time from the simulator's per-layer model for this
rank's layers, TP share and CP shard, without communication: what ``COMM_MODE=fake_backend``
measures on rank 0. Options and JSON keys: docs/simulator.md, "One rank".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_wlb.sim.memory import GIB, RankShape, rank_memory, shape_dict

_STRATEGIES = ("per_sequence", "per_document", "hybrid")


@dataclass(frozen=True)
class RankSetup:
    """A config's layout seen from one rank: the memory model's shape plus what timing needs."""

    shape: RankShape
    rank: int
    world: int
    pp_rank: int
    cp_rank: int
    stages: list[int]
    stage_layers: list[int]
    schedule: str
    micro_batches: int
    seq_len: int
    cp_sharding: str
    dp: int


def load_job_config(config_file: str, overrides: list[str]) -> Any:
    """The job config exactly as the trainer parses it (TorchTitan's parser, our [wlb] section)."""
    from torchtitan_wlb import cpu_support

    cpu_support.activate()
    from torchtitan.config import ConfigManager

    logging.disable(logging.WARNING)  # TorchTitan's warnings about the run (no tokenizer, ...)
    try:
        return ConfigManager().parse_args(["--job.config_file", config_file, *overrides])
    finally:
        logging.disable(logging.NOTSET)


def _in_flight(schedule: str, pp: int, m: int, spr: int, pp_rank: int, layers: dict) -> tuple:
    """Most (layer, micro-batch) and (stage, micro-batch) pairs run forward and not yet backward
    on ``pp_rank``, in torch's own action order for ``schedule``."""
    if pp == 1:
        return layers[0], 1  # gradient accumulation: one micro-batch at a time
    from torchtitan_wlb.pipeline.orders import schedule_actions

    held: set[tuple[int, int]] = set()
    most_layers = most_chunks = 0
    for action in schedule_actions(schedule, pp, m, spr)[pp_rank]:
        key = (action.stage, action.mb)
        if action.kind == "F":
            held.add(key)
            most_layers = max(most_layers, sum(layers[s] for s, _ in held))
            most_chunks = max(most_chunks, len(held))
        elif action.kind in ("B", "W"):
            held.discard(key)
    return most_layers, most_chunks


def rank_setup(job: Any, rank: int = 0, world: int | None = None) -> RankSetup:
    """Which layers, tokens and micro-batches ``rank`` of ``job``'s layout has (rank order as
    TorchTitan's mesh: pp, dp_replicate, dp_shard, cp, tp, TP innermost)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    from torchtitan_wlb.models.catalogue import get_model
    from torchtitan_wlb.models.llama3_wlb import FLAVORS
    from torchtitan_wlb.pipeline.orders import stages_of_rank

    p, t = job.parallelism, job.training
    if job.model.flavor not in FLAVORS:
        raise ValueError(f"[model] flavor {job.model.flavor!r} is not one of {', '.join(FLAVORS)}")
    model = get_model(FLAVORS[job.model.flavor])
    tp, cp, pp, dpr = (
        p.tensor_parallel_degree,
        p.context_parallel_degree,
        p.pipeline_parallel_degree,
        p.data_parallel_replicate_degree,
    )
    inner = tp * cp * pp * dpr
    world = world or inner * max(p.data_parallel_shard_degree, 1)
    dps = p.data_parallel_shard_degree if p.data_parallel_shard_degree > 0 else world // inner
    if inner * dps != world or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world {world} does not fit the layout {p}")
    dp = dpr * dps
    n = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp
    m = n // dp
    schedule = p.pipeline_parallel_schedule
    single = pp == 1 or issubclass(get_schedule_class(schedule), PipelineScheduleSingle)
    spr = 1 if single else 2
    if pp > 1 and p.pipeline_parallel_layers_per_stage is not None:
        extra = p.pipeline_parallel_first_stage_less_layers
        extra += p.pipeline_parallel_last_stage_less_layers
        spr = -(-(model.n_layers + extra) // p.pipeline_parallel_layers_per_stage) // pp
    n_stages = pp * spr
    fqns = generate_llm_fqn_per_model_part(
        n_stages,
        model.n_layers,
        p.pipeline_parallel_first_stage_less_layers,
        p.pipeline_parallel_last_stage_less_layers,
    )
    per_stage = [sum(f.startswith("layers.") for f in part) for part in fqns]
    pp_rank, cp_rank = rank // (world // pp), (rank // tp) % cp
    stages = stages_of_rank(schedule, pp, pp_rank, spr) if pp > 1 else [0]
    held = _in_flight(schedule, pp, m, spr, pp_rank, dict(enumerate(per_stage)))
    wlb = job.wlb
    variable = str(wlb.packing) in ("wlb", "wlb_paper")
    smax = wlb.micro_batch_max_len or int(1.25 * t.seq_len)
    shape = RankShape(
        model=model,
        tp=tp,
        cp=cp,
        fsdp=dps * cp,
        layers=sum(per_stage[s] for s in stages),
        has_embedding=0 in stages,
        has_output=n_stages - 1 in stages,
        tokens=max(smax, t.seq_len) if variable else t.seq_len,
        held_layer_inputs=held[0],
        held_stage_outputs=held[1],
        pipelined=pp > 1,
        compute_bytes=2 if t.mixed_precision_param == "bfloat16" else 4,
        full_ac=job.activation_checkpoint.mode == "full",
    )
    return RankSetup(
        shape, rank, world, pp_rank, cp_rank, stages, [per_stage[s] for s in stages], schedule,
        m, t.seq_len, str(wlb.cp_sharding), dp,
    )  # fmt: skip


def _padded(lens: np.ndarray, tp: int, cp: int) -> np.ndarray:
    """A micro-batch as the trainer shards it: padded with one ignored document to a multiple of
    ``tp x 2 cp`` tokens under TP, or to at least ``2 cp`` under CP alone."""
    lens = np.asarray(lens, dtype=np.int64)
    unit = tp * 2 * cp if tp > 1 else 2 * cp
    pad = -int(lens.sum()) % unit if tp > 1 else max(0, unit - int(lens.sum()))
    return np.append(lens, pad) if pad else lens


def compute_seconds(
    setup: RankSetup, hardware: Any, micro_batches: list, strategies: list[str] | None = None
) -> dict[str, float]:
    """Predicted compute of this rank over one step's ``micro_batches`` (each a list of document
    lengths): forward, backward and, under full activation checkpointing, the recomputed forward,
    of its layers on its CP shard with its TP share; the output layer on the last stage. Each
    micro-batch is sharded by its ``strategies`` entry (the trainer's choice, from its metrics),
    else by the config's ``cp_sharding`` ("adaptive" as the simulator chooses)."""
    from torchtitan_wlb.sim.config import SimConfig
    from torchtitan_wlb.sim.engine import cp_shards, shard_costs
    from torchtitan_wlb.sim.hardware import Layout

    s = setup.shape
    cfg = SimConfig(
        model=s.model,
        layout=Layout(tp=s.tp, cp=s.cp, pp=1, dp=1),
        context_len=setup.seq_len,
        hardware=hardware,
        schedule="1f1b",
        v=1,
    )
    mbs = [_padded(x, s.tp, s.cp) for x in micro_batches]
    chosen = list(strategies or [setup.cp_sharding] * len(mbs))
    fwd = np.zeros(len(mbs))
    bwd = np.zeros(len(mbs))
    out = np.zeros(len(mbs))
    for strategy in dict.fromkeys(chosen):
        idx = [i for i, c in enumerate(chosen) if c == strategy]
        if s.cp == 1:
            strategy = "per_sequence"
        costs = shard_costs(cp_shards([mbs[i] for i in idx], cfg, strategy), cfg)
        c = setup.cp_rank
        fwd[idx] = costs.compute_fwd[:, c] * s.layers
        bwd[idx] = costs.compute_bwd[:, c] * s.layers
        if s.has_output:
            tokens = costs.local_tokens[:, c]
            gemm = hardware.gemm_tflops * 1e12
            out[idx] = 2.0 * tokens * s.model.dim * s.model.vocab_size / s.tp / gemm
    recompute = fwd.sum() if s.full_ac else 0.0
    fwd_s = float(fwd.sum() + out.sum())
    bwd_s = float(bwd.sum() + hardware.bwd_gemm_factor * out.sum() + recompute)
    return {
        "fwd_s": fwd_s,
        "bwd_s": bwd_s,
        "recompute_s": float(recompute),
        "step_s": fwd_s + bwd_s,
    }


def default_micro_batches(setup: RankSetup, doc_len: int | None) -> list[list[int]]:
    """Without measured micro-batches: each one full, ``shape.tokens`` tokens, in documents of
    ``doc_len`` tokens (default the context length) and a shorter last one."""
    d = doc_len or setup.seq_len
    k, rest = divmod(setup.shape.tokens, d)
    one = [d] * k + ([rest] if rest else [])
    return [one] * setup.micro_batches


def measured_steps(path: str) -> list[dict]:
    """Per logged step of a metrics JSONL (``[wlb.advanced] metrics_jsonl``): its micro-batches'
    document lengths and the CP strategies the trainer chose (steps without lengths are left
    out: the log names them only when the step's micro-batches were whole)."""
    steps = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        lens = [a.get("doc_lens") for a in rec.get("pp_actions", [])]
        mbs = lens[0] if lens and lens[0] else rec.get("micro_batch_doc_lens")
        if not mbs:
            continue
        strategies = rec.get("micro_batch_cp_strategy") or None
        if strategies is not None and len(strategies) != len(mbs):
            strategies = None
        steps.append({"step": rec["step"], "micro_batches": mbs, "strategies": strategies})
    return steps


def predict(setup: RankSetup, hardware: Any, steps: list[dict] | None, doc_len: int | None) -> dict:
    """The JSON object of the CLI (docs/simulator.md, "One rank")."""
    memory = rank_memory(setup.shape)
    out: dict[str, Any] = {
        "rank": setup.rank,
        "world": setup.world,
        "pp_rank": setup.pp_rank,
        "cp_rank": setup.cp_rank,
        "stages": setup.stages,
        "stage_layers": setup.stage_layers,
        "schedule": setup.schedule,
        "micro_batches": setup.micro_batches,
        "hardware": hardware.name,
        "shape": shape_dict(setup.shape),
        "memory_bytes": memory,
        "peak_memory_gib": memory["total"] / GIB,
    }
    if steps:
        per_step = []
        for st in steps:
            times = compute_seconds(setup, hardware, st["micro_batches"], st["strategies"])
            per_step.append({"step": st["step"], **times})
        out["steps"] = per_step
        # The same memory with the largest micro-batch these steps really had (packed micro-batches
        # are often shorter than S_max).
        most = max(int(_padded(mb, 1, 1).sum()) for st in steps for mb in st["micro_batches"])
        measured = rank_memory(dataclasses.replace(setup.shape, tokens=most))
        out["measured_tokens_max"] = most
        out["peak_memory_gib_at_measured_tokens"] = measured["total"] / GIB
        later = [s for s in per_step if s["step"] > 1] or per_step
        out["compute_s"] = {
            k: float(np.mean([s[k] for s in later])) for k in per_step[0] if k != "step"
        }
    else:
        out["compute_s"] = compute_seconds(setup, hardware, default_micro_batches(setup, doc_len))
    return out


def _table(out: dict) -> list[str]:
    lines = [
        f"rank {out['rank']} of {out['world']}: pp rank {out['pp_rank']} (stages {out['stages']}, "
        f"{sum(out['stage_layers'])} layers), cp rank {out['cp_rank']}, {out['micro_batches']} "
        f"micro-batches of up to {out['shape']['tokens']} tokens, hardware {out['hardware']}"
    ]
    for name, value in out["memory_bytes"].items():
        lines.append(f"  {name:<18}{value / GIB:>9.2f} GiB")
    c = out["compute_s"]
    lines.append(
        f"  compute per step  {c['step_s']:.3f} s (forward {c['fwd_s']:.3f}, backward "
        f"{c['bwd_s']:.3f}, of which recompute {c['recompute_s']:.3f})"
    )
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_wlb.sim.rank",
        description=__doc__.strip().splitlines()[0],
        epilog="examples:\n" + "\n".join(__doc__.split("\n\n")[1].splitlines()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="TOML config, as run_train.sh's CONFIG_FILE")
    p.add_argument("--rank", type=int, default=0, help="global rank (0)")
    p.add_argument("--ngpu", type=int, default=None, help="world size (default: from degrees)")
    p.add_argument("--hardware", default="h100", help="profile name (h100, h200) or JSON file")
    p.add_argument("--metrics", default=None, metavar="JSONL", help="predict these logged steps")
    p.add_argument("--doc-len", type=int, default=None, help="document length without --metrics")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # TorchTitan's flags follow "--"
    args = parser().parse_args(argv[:cut])
    from torchtitan_wlb.sim.hardware import get_hardware

    try:
        if not Path(args.config).is_file():
            raise ValueError(f"--config {args.config}: no such file")
        if args.metrics and not Path(args.metrics).is_file():
            raise ValueError(f"--metrics {args.metrics}: no such file")
        hardware = get_hardware(args.hardware)
        setup = rank_setup(load_job_config(args.config, argv[cut + 1 :]), args.rank, args.ngpu)
        steps = measured_steps(args.metrics) if args.metrics else None
        if args.metrics and not steps:
            raise ValueError(f"--metrics {args.metrics}: no step names its micro-batches' lengths")
        out = predict(setup, hardware, steps, args.doc_len)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(_table(out)))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
