"""torch's pipeline schedules as action lists, their replay on per-stage times, and the bubble
tool on packed micro-batches (single process, no process group)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from torchtitan_wlb.pipeline import VARLEN_SCHEDULES
from torchtitan_wlb.pipeline.orders import schedule_actions, stages_of_rank
from torchtitan_wlb.sim.pp_schedules import main as pp_schedules_main
from torchtitan_wlb.sim.timeline import (
    build_action_timeline,
    build_schedule,
    simulate_actions,
    simulate_pipeline,
)

ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


def _chunks(name: str) -> int:
    return 1 if VARLEN_SCHEDULES[name] == "single" else 2


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (3, 2)])
def test_every_stage_runs_every_microbatch_once_on_its_rank(pp, m):
    for name in VARLEN_SCHEDULES:
        if name == "1F1B" and m < pp:
            continue
        orders = schedule_actions(name, pp, m)
        count = Counter()
        for rank, actions in enumerate(orders):
            assert {a.stage for a in actions} == set(stages_of_rank(name, pp, rank, _chunks(name)))
            count.update((a.kind, a.stage, a.mb) for a in actions)
        kinds = ("F", "I", "W") if name in ZERO_BUBBLE else ("F", "B")
        expected = {(k, s, b) for k in kinds for s in range(pp * _chunks(name)) for b in range(m)}
        assert set(count) == expected and set(count.values()) == {1}, name
    assert stages_of_rank("ZBVZeroBubble", 2, 0, 2) == [0, 3]  # the V: first and last stage
    with pytest.raises(ValueError, match="not supported with variable-length"):
        schedule_actions("DualPipeV", 2, 4)


def test_replay_of_torch_orders_matches_the_simulators_timelines():
    """Random per-micro-batch costs: torch's 1F1B and Interleaved1F1B orders, replayed, time as
    the simulator's own (Megatron-ordered) timelines; with equal costs the textbook bubbles."""
    rng = np.random.default_rng(0)
    pp, m = 4, 8
    for name, v in (("1F1B", 1), ("Interleaved1F1B", 2)):
        fwd = rng.uniform(0.5, 2.0, (3, pp * v, m))
        bwd = 2 * fwd
        tl = build_action_timeline(schedule_actions(name, pp, m), pp * v, m)
        got = simulate_actions(tl, fwd, bwd, 0.5 * bwd, p2p=0.1)
        want = simulate_pipeline(build_schedule(pp, m, v), fwd, bwd, p2p=0.1)
        np.testing.assert_allclose(got.makespan, want.makespan)
        equal = np.ones((1, pp * v, m)) / v
        res = simulate_actions(tl, equal, 2 * equal, equal)
        assert res.bubble_fraction[0] == pytest.approx((pp - 1) / (v * m + pp - 1))
    # Splitting the backward fills the bubble: zero-bubble schedules idle less than interleaving.
    for name in ZERO_BUBBLE:
        tl = build_action_timeline(schedule_actions(name, pp, m), 2 * pp, m)
        equal = np.full((1, 2 * pp, m), 0.5)
        res = simulate_actions(tl, equal, 2 * equal, equal)
        assert res.bubble_fraction[0] < 0.5 * (pp - 1) / (2 * m + pp - 1), name
    # ZBV passes stages 1 -> 2 (rank 1) and 3's input gradient to 2 on the rank: no transfer.
    zbv = build_action_timeline(schedule_actions("ZBVZeroBubble", 2, 4), 4, 4)
    local = zbv.remote[(zbv.kind == 0) & (zbv.stage == 2)]
    assert local.size == 4 and not local.any()
    assert zbv.remote[(zbv.kind == 0) & (zbv.stage == 3)].all()


def test_bubble_tool_on_packed_microbatches(capsys):
    args = "--generator longtail --model tiny --n-layers 4 --context-len 512 --tp 1 --cp 1 --pp 2 "
    args += "--micro-batches 4 --steps 2 --warmup-steps 1 --json"
    assert pp_schedules_main(args.split()) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["tokens_per_step"]) == {"fixed_4d", "wlb"}
    assert list(out["schedules"]) == [
        "1F1B",
        "Interleaved1F1B",
        "ZBVZeroBubble",
        "InterleavedZeroBubble",
        "LoopedBFS",
    ]
    for row in out["schedules"].values():
        assert set(row) == {"fixed_4d", "wlb"}
        for cell in row.values():
            assert 0.0 <= cell["bubble_fraction"] < 1.0 and cell["pipeline_time_s"] > 0
    assert pp_schedules_main([*args.split(), "--schedules", "DualPipeV"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown schedule 'DualPipeV'" in err[0]


@pytest.mark.parametrize(
    "schedule, extra, error",
    [
        ("ZBVZeroBubble", [], None),
        ("InterleavedZeroBubble", ["--training.global_batch_size", "5"], "a multiple of max(1"),
        ("ZBVZeroBubble", ["--compile.enable"], "zero-bubble schedules do not run compiled"),
    ],
)
def test_validate_takes_zero_bubble_schedules(
    tmp_path, capsys, monkeypatch, schedule, extra, error
):
    """The pre-flight check passes a zero-bubble PP = 2 job, and refuses in one line what torch
    would refuse only inside the ranks."""
    from torchtitan_wlb.validate import main

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "word " * (3 + i % 40)}) + "\n" for i in range(40)))
    monkeypatch.setenv("NGPU", "2")
    args = [
        "--job.config_file", "train_configs/debug_cpu.toml", "--model.flavor", "tiny",
        "--training.seq_len", "128", "--wlb.micro_batch_max_len", "160",
        "--training.global_batch_size", "4", "--training.dataset", "jsonl",
        "--training.dataset_path", str(data), "--job.dump_folder", str(tmp_path / "run"),
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", schedule, *extra,
    ]  # fmt: skip
    assert main(args) == (0 if error is None else 2)
    err = capsys.readouterr().err
    if error is None:
        assert err == ""
    else:
        assert err.count("\n") == 1 and err.startswith("error: ") and error in err, err
        assert schedule in err
