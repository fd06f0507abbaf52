"""Data parallelism on CPU (gloo): DDP, FSDP and HSDP give step 1 the gradients of one process.

TorchTitan scales each rank's loss by the global count of valid tokens, so the data-parallel
reduction must sum the ranks' gradients (FSDP's division is turned off for that reason). Every run
starts from the same seed checkpoint and, the packing plan being global, trains step 1 on the same
documents; ``tests/grad_dump.py`` writes the gradients the optimizer receives.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
LAUNCH = os.path.join(ROOT, "tests", "fork_launch.py")

pytestmark = pytest.mark.slow

COMMON = [
    "--job.config_file", DEBUG_CPU, "--model.flavor", "tiny", "--training.seq_len", "128",
    "--wlb.micro_batch_max_len", "160", "--training.global_batch_size", "4",
    "--metrics.disable_color_printing", "--checkpoint.enable", "--checkpoint.interval", "1000",
    "--checkpoint.no-last-save-model-only", "--debug.seed", "7", "--training.steps", "1",
]  # fmt: skip

LAYOUTS = {
    "ddp2": (2, ["--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "2"]),
}  # fmt: skip


def _run(nproc, dump, *args, grads=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WLB_TEST_GRADS", None)
    if grads is not None:
        env["WLB_TEST_GRADS"] = str(grads)
    cmd = [
        sys.executable,
        LAUNCH,
        f"--nproc_per_node={nproc}",
        *COMMON,
        "--job.dump_folder",
        str(dump),
        *args,
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """A seed checkpoint and the gradients of one process from it."""
    base = tmp_path_factory.mktemp("dp")
    seed = base / "seed"
    _run(1, seed, "--checkpoint.create_seed_checkpoint")
    ref = base / "ref"
    shutil.copytree(seed / "checkpoint", ref / "checkpoint")
    _run(1, ref, "--parallelism.data_parallel_shard_degree", "1", grads=base / "ref.pt")
    return base, seed, torch.load(base / "ref.pt")


def _relative(got: dict, ref: dict) -> float:
    diff = sum(float((got[n] - ref[n]).double().norm() ** 2) for n in ref) ** 0.5
    return diff / sum(float(ref[n].double().norm() ** 2) for n in ref) ** 0.5


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_step_one_gradients_match_one_process(seeded, layout):
    base, seed, ref = seeded
    nproc, args = LAYOUTS[layout]
    run = base / layout
    shutil.copytree(seed / "checkpoint", run / "checkpoint")
    _run(nproc, run, *args, grads=base / f"{layout}.pt")
    got = torch.load(base / f"{layout}.pt")
    assert sorted(got) == sorted(ref)
    assert _relative(got, ref) < 1e-6, layout
    for name in ref:  # no parameter off by a factor the norm would hide
        assert torch.allclose(got[name], ref[name], rtol=1e-4, atol=1e-8), name
