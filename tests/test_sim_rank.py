"""One rank's predicted memory and compute (torchtitan_wlb.sim.memory / sim.rank)."""

import os
import subprocess
import sys

import numpy as np

from torchtitan_wlb.models.catalogue import get_model
from torchtitan_wlb.sim.memory import RankShape, layer_working_set, rank_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_shape() -> RankShape:
    return RankShape(
        model=get_model("tiny"),  # dim 128, 4 heads of 32, 2 KV heads, ffn 384, vocab 264
        tp=2,
        cp=2,
        fsdp=2,
        layers=1,
        has_embedding=True,
        has_output=False,
        tokens=64,
        held_layer_inputs=3,
        held_stage_outputs=2,
        pipelined=True,
    )


def test_memory_of_a_tiny_rank_matches_a_hand_count():
    mem = rank_memory(_tiny_shape())
    # One block: wq + wo 2*128*128, wk + wv 2*128*64, MLP 3*128*384; plus the embedding 264*128.
    block = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384
    assert block == 196_608
    per_tp = (block + 264 * 128) // 2  # TP halves every matrix
    shard = per_tp // 2  # FSDP over dp_shard x cp = 2
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * shard, 4 * shard, 8 * shard)
    assert mem["params_unsharded"] == 2 * per_tp  # bf16, gathered for the step under PP
    assert mem["grads_unsharded"] == 4 * per_tp  # fp32 accumulation over the micro-batches
    token_dim = (64 // 2 // 2) * 128 * 2  # one sequence-parallel activation: 16 tokens, bf16
    assert mem["activations"] == 3 * token_dim and mem["stage_outputs"] == 2 * token_dim
    # One block on the CP rank's 32 tokens: 4 x (32 x 128) gathered inputs and unreduced outputs,
    # 3 x (32 x 64) Q, rotated Q, attention out, 3 x (32 x 32) K, V, rotated K (1 KV head per TP
    # rank), the gathered K and V of all 64 tokens 2 x (64 x 32), the MLP's 4 x (32 x 192), in
    # bf16; the fp32 log-sum-exp of 32 tokens x 2 heads.
    elements = 4 * 32 * 128 + 3 * 32 * 64 + 3 * 32 * 32 + 2 * 64 * 32 + 4 * 32 * 192
    assert layer_working_set(_tiny_shape()) == 2 * elements + 32 * 2 * 4
    assert mem["layer_working_set"] == 2 * (2 * elements + 256)  # forward + its gradients
    assert mem["output_and_loss"] == 0
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total") == 1_850_880


def test_last_stage_adds_the_output_layer_and_no_fsdp_gathers_nothing():
    base = _tiny_shape()
    last = RankShape(**{**base.__dict__, "has_embedding": False, "has_output": True, "fsdp": 1})
    mem = rank_memory(last)
    # logits of 32 tokens x 132 vocabulary rows per TP rank: bf16, fp32 copy, fp32 gradient;
    # plus the gathered input 32 x 128 in bf16
    assert mem["output_and_loss"] == 32 * 132 * (2 + 4 + 4) + 32 * 128 * 2
    assert mem["params_unsharded"] == mem["grads_unsharded"] == 0


def test_in_flight_micro_batches_follow_the_schedule():
    from torchtitan_wlb.sim.rank import _in_flight

    layers = {0: 3, 1: 3, 2: 3, 3: 3}
    assert _in_flight("1F1B", 4, 8, 1, 0, layers) == (12, 4)  # 4 forwards before the 1st backward
    assert _in_flight("1F1B", 4, 8, 1, 3, layers) == (3, 1)
    eight = {s: 2 for s in range(8)}
    # Interleaved 1F1B, rank 0: (v - 1) pp + 2 (pp - 1) = 10 warm-up forwards, then one more
    assert _in_flight("Interleaved1F1B", 4, 8, 2, 0, eight) == (22, 11)


def test_rank_setup_and_compute_of_the_llama3_8b_config():
    from torchtitan_wlb.sim.hardware import get_hardware
    from torchtitan_wlb.sim.rank import compute_seconds, load_job_config, rank_setup

    job = load_job_config(os.path.join(ROOT, "train_configs", "llama3_8b_128k.toml"), [])
    setup = rank_setup(job, 0, 64)
    s = setup.shape
    assert setup.stages == [0, 4] and setup.cp_rank == 0 and setup.micro_batches == 8
    assert s.has_embedding and not s.has_output and s.layers == sum(setup.stage_layers)
    assert (s.tp, s.cp, s.fsdp, s.tokens, s.compute_bytes) == (8, 2, 2, 163840, 2)
    last = rank_setup(job, 63, 64)  # pp rank 3 holds stages 3 and 7, the last
    assert last.stages == [3, 7] and last.shape.has_output and last.cp_rank == 1
    hw = get_hardware("h100")
    short = compute_seconds(setup, hw, [[4096] * 32] * 8, ["per_sequence"] * 8)
    long = compute_seconds(setup, hw, [[131072]] * 8, ["per_sequence"] * 8)
    assert 0 < short["step_s"] < long["step_s"]  # the same tokens, more attention
    assert np.isclose(long["recompute_s"], long["fwd_s"])  # full AC recomputes the forward


def test_cli_reports_a_missing_config_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "torchtitan_wlb.sim.rank", "--config", "nope.toml"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip() == "error: --config nope.toml: no such file"
