"""``[wlb] cost_model = "online"`` end to end on two gloo ranks (DP = 2 or PP = 2), synthetic times.

One run of 6 steps refits after steps 4 and 6 (warm-up 1, window 3, hold-out 1, interval 2); the
refit after step 4 is adopted and, with a lag of 2, packs step 6. Both ranks, fed different times,
must hold the same coefficients bit for bit and pack with the same model at every step. Then a run
resumed from the checkpoint of step 4 (after the refit, before it takes effect) must pack and
train steps 5 and 6 exactly as the uninterrupted run: same documents, same coefficients, same
losses, the same refit after step 6. Under pipeline parallelism (PP = 2) the same refit must come
from the per-stage action times of each micro-batch, summed over the pipeline group.
"""

import itertools
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
LAUNCH = os.path.join(ROOT, "tests", "fork_launch.py")

pytestmark = pytest.mark.slow


def _train(dump, *extra, steps=6, nproc=2, times="plain"):
    """A run fed synthetic times of the given kind (tests/synthetic_times.py)."""
    cmd = [
        sys.executable, LAUNCH, f"--nproc_per_node={nproc}",
        "--job.config_file", DEBUG_CPU, "--job.dump_folder", str(dump), "--model.flavor", "tiny",
        "--training.seq_len", "256", "--wlb.micro_batch_max_len", "320",
        "--training.global_batch_size", "4", "--training.steps", str(steps),
        "--checkpoint.interval", "2", "--wlb.advanced.metrics_jsonl",
        "--metrics.disable_color_printing", "--wlb.cost_model", "online",
        "--wlb.online.warmup_steps", "1", "--wlb.online.window_steps", "3",
        "--wlb.online.holdout_steps", "1", "--wlb.online.interval_steps", "2",
        "--wlb.online.apply_lag_steps", "2", *extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", WLB_TEST_SYNTHETIC_TIMES=times)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout + r.stderr


def _records(dump, rank):
    with open(os.path.join(dump, "wlb_metrics", f"rank_{rank}.jsonl")) as f:
        return {rec["step"]: rec for rec in map(json.loads, f)}


REFIT_KEYS = ("wlb/cost_refit_a", "wlb/cost_refit_b", "wlb/cost_refit_c", "wlb/cost_refit_error")


def _check_refit(log, dump, steps=6, nproc=2):
    """The refit after step 4 adopted for step 6: the same coefficients on every rank, bit for
    bit, the synthetic attention coefficient recovered, packing with it from step 6 on all."""
    assert "online cost model refit after step 4" in log and "adopted for step 6" in log
    runs = [_records(dump, rank) for rank in range(nproc)]
    for recs in runs:
        assert sorted(recs) == list(range(1, steps + 1))
        assert recs[4]["wlb/cost_refit_adopted"] == 1.0
        assert recs[4]["wlb/cost_refit_effective_step"] == 6.0
        assert "wlb/cost_refit_adopted" in recs[6] and "wlb/cost_refit_adopted" not in recs[5]
    # Different timings on the two ranks (tests/synthetic_times.py), the same coefficients bit for bit.
    for step, recs in itertools.product((4, 6), runs[1:]):
        assert [runs[0][step][k] for k in REFIT_KEYS] == [recs[step][k] for k in REFIT_KEYS]
    rank0 = runs[0]
    a = rank0[4]["wlb/cost_refit_a"]
    assert a == pytest.approx(1e-7, rel=0.05)  # the synthetic truth, through the real pipeline
    # Steps 1-5 packed with the analytic model, step 6 with the refit (both ranks alike).
    analytic = rank0[1]["wlb/cost_attn_coef"]
    for recs in runs:
        assert [recs[s]["wlb/cost_attn_coef"] for s in range(1, 6)] == [analytic] * 5
        assert [recs[s]["wlb/cost_attn_coef"] for s in range(6, steps + 1)] == [a] * (steps - 5)
    return runs


def test_online_refit_is_identical_on_every_rank_and_resumes_exactly(tmp_path):
    ref = tmp_path / "ref"
    runs = _check_refit(_train(ref), ref)
    # Resume from the checkpoint of step 4: the refit is decided, not yet in effect.
    resumed = tmp_path / "resumed"
    shutil.copytree(ref / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    log = _train(resumed)
    assert "resuming from step 4" in log
    for rank in (0, 1):
        again, full = _records(resumed, rank), runs[rank]
        assert sorted(again) == [5, 6]
        for step in (5, 6):
            for key in ("loss", "doc_ids", "micro_batch_doc_lens", "wlb/cost_attn_coef"):
                assert again[step][key] == full[step][key], (rank, step, key)
        assert [again[6][k] for k in REFIT_KEYS] == [full[6][k] for k in REFIT_KEYS]


def test_online_refit_under_pipeline_parallelism(tmp_path):
    """PP = 2 x DP = 2: one fit row per micro-batch from the per-stage action times (synthetic, a
    different share on each stage and different noise on each rank), summed over each pipeline
    group, then each stage sums the two pipelines' statistics over its own ranks: all four ranks
    must agree bit for bit."""
    args = ("--parallelism.pipeline_parallel_degree", "2", "--checkpoint.no-enable",
            "--parallelism.data_parallel_shard_degree", "2")  # fmt: skip
    log = _train(tmp_path, *args, nproc=4, times="stage")
    _check_refit(log, tmp_path, nproc=4)


def test_online_refit_under_context_parallelism_chooses_the_cp_plans(tmp_path):
    """CP = 2, adaptive sharding: the fit prices local and all-gathered tokens apart, and from the
    step the refit packs, both CP ranks choose every micro-batch's sharding by it instead of by
    the throughput profile. A slow link makes the profile pick hybrid where it gathers least
    (documents over 64 tokens are split, shorter ones stay local), and the synthetic gathered token
    costs a fifth of a local one, so the fitted model picks the balanced all-gathered plan."""
    import numpy as np

    from torchtitan_wlb.cp.adaptive import build_cp_plan
    from torchtitan_wlb.tools.e2e_bench import write_jsonl

    data = tmp_path / "docs.jsonl"  # several documents a micro-batch, on both sides of 64 tokens
    write_jsonl(np.random.default_rng(0).integers(10, 150, 600), data, seed=0)
    cp = {"hybrid_max_len": 64, "bandwidth_gbps": 1e-3}
    args = ("--parallelism.context_parallel_degree", "2", "--wlb.cp_sharding", "adaptive",
            "--wlb.advanced.cp_hybrid_max_len", "64", "--wlb.advanced.cp_bandwidth_gbps", "0.001",
            "--training.dataset", "jsonl", "--training.dataset_path", str(data),
            "--checkpoint.no-enable")  # fmt: skip
    # Seven steps: one of steps 6-7 may release a group of outliers, one a micro-batch (where
    # every strategy is the same plan); the other has several documents a micro-batch.
    runs = _check_refit(_train(tmp_path, *args, steps=7, times="gather"), tmp_path, steps=7)
    refit = runs[0][4]
    a, b, g = (refit[f"wlb/cost_refit_{k}"] for k in "abg")
    assert b == pytest.approx(1e-5, rel=0.05) and g == pytest.approx(b / 5, rel=0.05)
    fitted, profile = [], []
    for step, coefficients in ((5, None), (6, (a, b, g)), (7, (a, b, g))):
        lens = [np.array(d) for d in runs[0][step]["micro_batch_doc_lens"]]
        chosen = [
            build_cp_plan(d, 2, "adaptive", coefficients=coefficients, **cp).strategy for d in lens
        ]
        for recs in runs:
            assert recs[step]["micro_batch_cp_strategy"] == chosen, step
            share = recs[step]["wlb/cp_hybrid_share"]
            assert share == pytest.approx(chosen.count("hybrid") / len(lens))
        if coefficients is not None:  # under the profile, other plans: the fit made the choice
            several = [i for i, d in enumerate(lens) if d.size > 1]
            fitted += [chosen[i] for i in several]
            profile += [build_cp_plan(lens[i], 2, "adaptive", **cp).strategy for i in several]
    assert fitted and set(fitted) == {"per_document"} and profile != fitted
