"""Simulator: pipeline timelines, per-layer timing, modes, CLI output and bad-input errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import torchtitan_wlb.cp
from torchtitan_wlb.models.catalogue import ModelSpec, get_model
from torchtitan_wlb.sim.cli import main as sim_main
from torchtitan_wlb.sim.config import MODES, SimConfig, epoch_steps
from torchtitan_wlb.sim.engine import simulate_mode, speedup
from torchtitan_wlb.sim.hardware import HardwareProfile, Layout, resolve_layout
from torchtitan_wlb.sim.timeline import build_schedule, simulate_pipeline
from torchtitan_wlb.sim.timing import causal_pairs, layer_costs, layers_per_vstage
from torchtitan_wlb.workloads import cut_stream, load_lengths, split_long


# ----------------------------------------------------------------------------------- timeline
def ideal_makespan(pp: int, m: int, v: int, f: float, b: float) -> float:
    """Equal micro-batches, no transfers (``f``, ``b``: one micro-batch on one physical stage)."""
    return m * (f + b) + (pp - 1) * (f + b) / v


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 2), (4, 4), (4, 8), (3, 7)])
def test_1f1b_equal_microbatches_matches_bubble_formula(pp, m):
    f, b = 1.0, 2.0
    sched = build_schedule(pp, m, 1)
    fwd = np.full((1, pp, m), f)
    res = simulate_pipeline(sched, fwd, 2 * fwd)
    assert res.makespan[0] == pytest.approx((m + pp - 1) * (f + b))
    assert res.bubble_fraction[0] == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp,m,v", [(2, 2, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (2, 6, 3)])
def test_interleaved_equal_microbatches_matches_closed_form(pp, m, v):
    # f, b: one micro-batch on one physical stage (all its v chunks).
    f, b = 1.0, 2.0
    sched = build_schedule(pp, m, v)
    fwd = np.full((1, pp * v, m), f / v)
    res = simulate_pipeline(sched, fwd, 2 * fwd)
    assert res.makespan[0] == pytest.approx(ideal_makespan(pp, m, v, f, b))
    assert res.makespan[0] == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / v)
    # Interleaving shrinks the bubble relative to plain 1F1B.
    assert res.makespan[0] < ideal_makespan(pp, m, 1, f, b)


def test_1f1b_unequal_microbatches_hand_computed():
    # PP=2, m=2, forward 1 and 3, backward twice the forward, on both stages.
    # stage 1: F0 [1,2] B0 [2,4] F1 [4,7] B1 [7,13];  stage 0: F0 [0,1] F1 [1,4] B0 [4,6] B1 [13,19]
    sched = build_schedule(2, 2, 1)
    fwd = np.array([[[1.0, 3.0], [1.0, 3.0]]])
    res = simulate_pipeline(sched, fwd, 2 * fwd)
    assert res.makespan[0] == pytest.approx(19.0)
    assert res.busy[0].tolist() == pytest.approx([12.0, 12.0])
    assert res.bubble_fraction[0] == pytest.approx(1 - 24 / 38)
    # 0.5 s per cross-stage transfer: stage 1 runs F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,7.5]
    # B1 [7.5,13.5]; stage 0 runs B0 [5,7] and B1 [14,20].
    res_p2p = simulate_pipeline(sched, fwd, 2 * fwd, p2p=0.5)
    assert res_p2p.makespan[0] == pytest.approx(20.0)


def test_pipeline_is_vectorised_over_a_batch_and_one_slow_microbatch_costs_more_than_itself():
    pp, m = 4, 4
    sched = build_schedule(pp, m, 1)
    fwd = np.ones((2, pp, m))
    fwd[1, :, 2] = 3.0  # pipeline 1: micro-batch 2 is 3x slower on every stage
    res = simulate_pipeline(sched, fwd, 2 * fwd)
    extra = res.makespan[1] - res.makespan[0]
    assert res.makespan[0] == pytest.approx(ideal_makespan(pp, m, 1, 1.0, 2.0))
    assert extra > 2.0 * 3.0  # more than its own extra (f+b) time: the delay propagates


def test_schedule_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divisible by PP"):
        build_schedule(4, 6, 2)
    with pytest.raises(ValueError, match="pp=0"):
        build_schedule(0, 4, 1)


# ------------------------------------------------------------------------------------- timing
def test_causal_pairs_and_layer_costs_hand_computed():
    assert causal_pairs(np.array([4]), np.array([4]))[0] == 10  # 1+2+3+4
    assert causal_pairs(np.array([2]), np.array([5]))[0] == 9  # 4+5 (bottom-right)
    model = ModelSpec(
        "t", dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=512, vocab_size=1000
    )
    hw = HardwareProfile(gemm_tflops=1.0, attn_tflops=1.0, hbm_gbps=1e12)
    lay = Layout(tp=2, cp=1)
    flat = lambda q, k, fl: fl / 1e12  # noqa: E731 - ideal kernel: FLOPs at 1 TFLOP/s
    c = layer_costs(
        model,
        lay,
        hw,
        np.array([0]),
        np.array([0]),
        np.array([128]),
        np.array([128]),
        np.array([[128]]),
        attention_time=flat,
    )
    attn_flops = 4 * 64 * (4 / 2) * (128 * 129 / 2)
    assert c.attn_fwd[0, 0] == pytest.approx(attn_flops / 1e12)
    gemm = 2 * 128 * model.params_per_layer / 2 / 1e12
    assert c.compute_fwd[0, 0] == pytest.approx(attn_flops / 1e12 + gemm, rel=1e-6)
    assert c.compute_bwd[0, 0] == pytest.approx(
        hw.bwd_attn_factor * attn_flops / 1e12 + hw.bwd_gemm_factor * gemm, rel=1e-6
    )
    assert c.comm_fwd[0] > 0  # TP=2 moves activations


def test_layers_per_vstage():
    assert layers_per_vstage(10, 4).tolist() == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="at least as many layers"):
        layers_per_vstage(4, 8)


def test_split_long_keeps_tokens():
    out = split_long(np.array([5, 10, 3]), 4)
    assert out.tolist() == [4, 1, 4, 4, 2, 3]


def test_cut_stream_is_torchtitans_loader():
    # Stream 5 | 10 | 3 cut every 4 tokens: [4] [1 3] [4] [3 1] [2] (the last window partial).
    out = cut_stream(np.array([5, 10, 3]), 4)
    assert out.tolist() == [4, 1, 3, 4, 3, 1, 2]
    windows = np.cumsum(out)
    assert set(range(4, 18, 4)) <= set(windows.tolist()) and out.sum() == 18


def test_torchtitan_loader_packs_full_sequences_from_the_cut_stream():
    from torchtitan_wlb.sim.engine import pack_steps

    cfg = SimConfig(
        model=get_model("550M"),
        layout=Layout(tp=1, cp=2, pp=2, dp=1),
        context_len=8192,
        steps=4,
        warmup_steps=0,
    )
    lengths = _workload(n=800)
    steps, _ = pack_steps(MODES["plain_4d_torchtitan"], lengths, cfg, 4)
    assert all(int(mb.sum()) == 8192 for step in steps for mb in step)
    whole, _ = pack_steps(MODES["plain_4d"], lengths, cfg, 4)
    assert any(int(mb.sum()) < 8192 for step in whole for mb in step)
    # The cut stream is the documents' own order: the first sequence starts with the first ones.
    first = steps[0][0]
    assert first[: len(first) - 1].tolist() == lengths[: len(first) - 1].tolist()


# -------------------------------------------------------------------------------- simulations
def _workload(n=6000, ctx=8192, seed=0):
    rng = np.random.default_rng(seed)
    body = rng.lognormal(np.log(300), 0.8, n)
    tail = rng.uniform(0.3 * ctx, ctx, n)
    return np.clip(np.where(rng.random(n) < 0.04, tail, body), 1, ctx).astype(np.int64)


@pytest.fixture(scope="module")
def small_results():
    cfg = SimConfig(
        model=get_model("550M"),
        layout=Layout(tp=1, cp=2, pp=2, dp=2),
        context_len=8192,
        steps=12,
        warmup_steps=2,
    )
    lengths = _workload()
    names = ("plain_4d", "fixed_4d", "wlb", "per_doc_cp", "varlen_packing", "wlb_no_delay")
    return cfg, {n: simulate_mode(MODES[n], lengths, cfg) for n in names}


def test_modes_order_and_shapes(small_results):
    cfg, res = small_results
    plain, wlb = res["plain_4d"], res["wlb"]
    assert plain.step_time_s.shape == (cfg.steps,)
    assert plain.rank_compute_s.shape == (cfg.steps, 2, 2, 2)
    assert plain.mb_rank_compute_s.shape == (cfg.steps, cfg.n_global, 2)
    # Workload-aware packing leaves less micro-batch imbalance than sequential fill ...
    assert wlb.imbalance.mean() < plain.imbalance.mean()
    assert res["varlen_packing"].imbalance.mean() < plain.imbalance.mean()
    # ... and WLB-LLM is faster than Plain-4D per token.
    assert speedup(plain, wlb) > 1.0
    # Per-document CP balances the CP ranks of every micro-batch (up to one token per slot).
    per_doc = res["per_doc_cp"].mb_rank_compute_s
    assert np.max(per_doc.max(axis=2) / per_doc.mean(axis=2)) < 1.01
    assert np.max(plain.mb_rank_compute_s.max(axis=2) / plain.mb_rank_compute_s.mean(axis=2)) > 1.01
    for r in res.values():
        assert np.all((r.bubble_fraction > 0) & (r.bubble_fraction < 1))
        assert r.tokens.min() > 0


def test_equal_documents_give_the_ideal_pipeline():
    # Every document the same length and micro-batches full: all micro-batches cost the same, so the
    # step is the closed-form 1F1B time plus transfers and the imbalance is 1.
    # A small vocabulary keeps the output layer from making the last stage the bottleneck.
    model = ModelSpec(
        "t", dim=1024, n_layers=8, n_heads=8, n_kv_heads=8, ffn_hidden_dim=4096, vocab_size=512
    )
    cfg = SimConfig(
        model=model,
        layout=Layout(tp=1, cp=1, pp=4, dp=1),
        context_len=4096,
        schedule="1f1b",
        steps=3,
        warmup_steps=0,
    )
    r = simulate_mode(MODES["plain_4d"], np.full(400, 1024), cfg)
    assert r.imbalance == pytest.approx(np.ones(3))
    assert np.allclose(r.step_time_s, r.step_time_s[0])
    assert r.bubble_fraction[0] == pytest.approx(3 / 7, abs=0.02)


# ------------------------------------------------------------------------------------ the CLI
WORKLOAD_ARGS = ["--context-len", "8192", "--tp", "1", "--cp", "2", "--pp", "2", "--dp", "1"]
WORKLOAD_ARGS += ["--model", "550M", "--steps", "6", "--warmup-steps", "1"]


def test_cli_json_keys(tmp_path, capsys):
    path = tmp_path / "lens.json"
    path.write_text(json.dumps(_workload(3000).tolist()))
    rc = sim_main(["--lengths", str(path), *WORKLOAD_ARGS, "--modes", "per_doc_cp", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for mode in ("plain_4d", "fixed_4d", "wlb", "per_doc_cp"):
        assert {"step_time_s", "imbalance", "bubble_fraction"} <= set(out[mode])
    assert out["speedup_wlb_vs_plain"] > 0 and out["speedup_wlb_vs_fixed"] > 0
    assert "speedup_per_doc_cp_vs_plain" in out


def test_cli_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "lens.txt"
    path.write_text("\n".join(str(x) for x in _workload(2000)))
    rc = sim_main(["--lengths", str(path), *WORKLOAD_ARGS, "--plot", str(tmp_path / "p")])
    assert rc == 0
    for name in ("latency_heatmap.png", "pipeline_gantt.png", "speedup.png"):
        assert (tmp_path / "p" / name).stat().st_size > 5000


def test_epoch_steps_cover_the_stream_once():
    # 10 steps of 2 x 8192 tokens, minus the warm-up.
    assert epoch_steps(10 * 2 * 8192 + 5, n_global=2, context_len=8192, warmup_steps=3) == 7
    with pytest.raises(ValueError, match="less than 4 steps"):
        epoch_steps(3 * 2 * 8192, n_global=2, context_len=8192, warmup_steps=3)


def test_cli_steps_epoch_reads_the_source_once(tmp_path, capsys):
    lens = _workload(3000)
    path = tmp_path / "lens.json"
    path.write_text(json.dumps(lens.tolist()))
    args = [a for a in WORKLOAD_ARGS if a not in ("--steps", "6")]
    rc = sim_main(["--lengths", str(path), *args, "--steps", "epoch", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    # N = PP x DP = 2 micro-batches of 8192 tokens per step, one warm-up step.
    expected = int(lens.sum()) // (2 * 8192) - 1
    assert f"{expected} steps" in out.splitlines()[0]
    res = json.loads(out.strip().splitlines()[-1])
    for mode in ("plain_4d", "wlb"):
        # The timed steps read about one pass: not more than the stream holds (the warm-up step
        # took its share), and most of it (next-fit leaves room unfilled at sequence ends).
        tokens = res[mode]["tokens_per_step"] * expected
        assert 0.8 * lens.sum() <= tokens <= lens.sum()


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--steps", "many"], "'many' is not a positive integer or 'epoch'"),
        (["--steps", "0"], "'0' is not a positive integer or 'epoch'"),
        (["--model", "13B"], "'13B'"),
        (["--gpus", "6"], "does not divide the GPU count 6"),
        (["--context-len", "8190"], "8190"),
        (["--modes", "fastest"], "'fastest'"),
    ],
)
def test_cli_bad_input_is_one_clear_message(tmp_path, capsys, extra, needle):
    path = tmp_path / "lens.json"
    path.write_text(json.dumps(_workload(500).tolist()))
    try:
        rc = sim_main(["--lengths", str(path), *WORKLOAD_ARGS, *extra])
    except SystemExit as exc:  # argparse rejects a bad value before main's own checks
        rc = exc.code
    err = capsys.readouterr().err
    assert rc != 0
    assert needle in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("a.json", "[100, 2.5, 7]", "2.5"),
        ("b.json", '[100, "x"]', "'x'"),
        ("c.txt", "100\n12a\n", "'12a'"),
        ("d.json", "[100, -3]", "-3"),
    ],
)
def test_lengths_file_with_non_integers(tmp_path, capsys, name, content, needle):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match="not"):
        load_lengths(path)
    rc = sim_main(["--lengths", str(path), *WORKLOAD_ARGS])
    err = capsys.readouterr().err
    assert rc != 0 and needle in err and "Traceback" not in err


def test_layout_resolution():
    assert resolve_layout(8, 16, 16, None, 8192).dp == 4
    with pytest.raises(ValueError, match="does not divide the GPU count 100"):
        resolve_layout(8, 2, 4, None, 100)
    with pytest.raises(ValueError, match="does not match the GPU count 128"):
        resolve_layout(8, 2, 4, 4, 128)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_model("1T")


def test_measured_cp_profile_times_attention_like_the_planner():
    from torchtitan_wlb.cp.profile import resolve_profile
    from torchtitan_wlb.sim.engine import attention_time_fn

    table = resolve_profile(None)  # the CP planner's packaged table
    model = get_model("7B")
    cfg = SimConfig(
        model=model,
        layout=Layout(tp=8, cp=2, pp=4),
        context_len=8192,
        cp_profile=str(Path(torchtitan_wlb.cp.__file__).parent / "profiles/cpu_default.json"),
    )
    q, kv = np.array([64, 300, 1000]), np.array([64, 900, 4000])
    heads = model.n_heads / 8
    fwd_flops = 4.0 * model.head_dim * heads * causal_pairs(q, kv)
    fwd = attention_time_fn(cfg)(q, kv, fwd_flops)
    total = fwd * (1 + cfg.hardware.bwd_attn_factor)
    scale = heads * model.head_dim / (table.n_heads * table.head_dim)
    assert total == pytest.approx(table.segment_seconds(q, kv) * scale, rel=1e-9)
    lengths = _workload(1500)
    r = simulate_mode(MODES["adaptive_cp"], lengths, replace(cfg, steps=2, warmup_steps=0))
    assert r.step_time_s.shape == (2,) and np.all(r.step_time_s > 0)


def test_cli_outlier_delay_off_changes_only_wlb(tmp_path, capsys):
    path = tmp_path / "lens.json"
    path.write_text(json.dumps(_workload(3000).tolist()))
    outs = []
    for flag in ("on", "off"):
        assert (
            sim_main(["--lengths", str(path), *WORKLOAD_ARGS, "--outlier-delay", flag, "--json"])
            == 0
        )
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    on, off = outs
    assert on["plain_4d"] == off["plain_4d"]  # deterministic, and untouched by the flag
    assert on["wlb"]["step_time_s"] != off["wlb"]["step_time_s"]


# ------------------------------------------------------------------------- the reproduction page
def test_reproduce_page_has_every_section_and_verdict(tmp_path):
    pytest.importorskip("matplotlib")
    from torchtitan_wlb.sim.reproduce import main as reproduce_main

    rng = np.random.default_rng(3)
    body = rng.lognormal(np.log(3000), 0.7, 6000)
    tail = rng.uniform(32 * 1024, 128 * 1024, 6000)
    lens = np.where(rng.random(6000) < 0.01, tail, body).clip(1).astype(np.int64)
    path = tmp_path / "lens.json"
    path.write_text(json.dumps(lens.tolist()))
    out = tmp_path / "repro.md"
    argv = ["--workload", str(path), "--out", str(out), "--figures", str(tmp_path / "fig")]
    rc = reproduce_main([*argv, "--quick", "--skip-table2", "--windows", "2"])
    assert rc == 0
    page = out.read_text()
    for heading in (
        "## Figure 12",
        "## Figure 13",
        "## How much the figures depend on the window",
        "## Figure 14",
        "## Figure 15",
        "## Scale",
    ):
        assert heading in page
    # Every target carries a verdict, and the sensitivity table has the paper's row and ours.
    assert "Targets: the average over the 8 configurations" in page
    assert "Targets (each within ±0.05 of the paper):" in page
    assert "| paper | 1.02x | 1.05x | 1.28x | 1.33x | 0.08 | 0.20 |" in page
    assert "| default H100 profile |" in page
    assert page.count("of 2 |") == 5  # five rows of the window table, two windows each
    assert len(list((tmp_path / "fig").glob("*.png"))) == 5


def test_reproduce_rejects_bad_window_arguments(tmp_path, capsys):
    from torchtitan_wlb.sim.reproduce import main as reproduce_main

    path = tmp_path / "lens.json"
    path.write_text(json.dumps(_workload(100).tolist()))
    rc = reproduce_main(
        ["--workload", str(path), "--out", str(tmp_path / "r.md"), "--windows", "-1"]
    )
    assert rc == 2
    assert "--windows -1" in capsys.readouterr().err


def test_wlb_sim_runs_on_the_builtin_workload_by_default(capsys):
    argv = ["--model", "550M", "--context-len", "16384", "--tp", "1", "--cp", "2", "--pp", "2"]
    assert sim_main([*argv, "--steps", "2", "--warmup-steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["speedup_wlb_vs_plain"] > 0


def test_reproduce_with_a_measured_table_says_so_and_rejects_a_missing_one(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from torchtitan_wlb.sim import reproduce

    path = tmp_path / "lens.json"
    path.write_text(json.dumps(_workload(3000).tolist()))
    table = reproduce.__file__.replace("sim/reproduce.py", "cp/profiles/h100.json")
    out = tmp_path / "r.md"
    argv = ["--workload", str(path), "--out", str(out), "--figures", str(tmp_path / "f")]
    argv += ["--quick", "--skip-table2", "--windows", "0"]
    try:
        assert reproduce.main([*argv, "--cp-profile", table]) == 0
        page = out.read_text()
        assert "timed with the attention table measured on NVIDIA H100" in page
        assert f"--cp-profile {table}" in page  # the command that rewrites the page
        assert "simulated" not in page.split("## Figure 15")[1].split("\n\n")[1]
        assert reproduce.main([*argv, "--cp-profile", str(tmp_path / "none.json")]) == 2
        assert "none.json" in capsys.readouterr().err
    finally:
        reproduce.CP_PROFILE = None  # main sets the module's table; later tests use the kernel
