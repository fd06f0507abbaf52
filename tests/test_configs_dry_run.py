"""Every shipped config builds its whole layout (fake-backend dry run) and the debug configs load."""

import glob
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LARGE = sorted(glob.glob(os.path.join(ROOT, "train_configs", "llama3_*.toml"))) + sorted(
    glob.glob(os.path.join(ROOT, "train_configs", "paper", "*.toml"))
)

pytestmark = pytest.mark.slow


def _large_configs():
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_wlb.tools.dry_run", *LARGE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def _debug_configs():
    debug = [os.path.join(ROOT, "train_configs", f"debug_{k}.toml") for k in ("cpu", "gpu")]
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_wlb.tools.dry_run", *debug, "--ngpu", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _fake_backend_step():
    """COMM_MODE=fake_backend as run_train.sh does it, with --training.steps 2: two real training
    steps of rank 0 of PP 2 (Interleaved1F1B, stages 0 and 2 on rank 0) x FSDP 2, fake
    collectives."""
    env = dict(
        os.environ, NGPU="4", LOCAL_RANK="0", WLB_PYTHON=sys.executable, COMM_MODE="fake_backend"
    )
    return subprocess.run(
        ["./run_train.sh", "--model.flavor", "debugmodel", "--training.seq_len", "256",
         "--wlb.micro_batch_max_len", "320", "--checkpoint.no-enable",
         "--parallelism.pipeline_parallel_degree", "2",
         "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
         "--training.steps", "2", "--job.dump_folder", "/tmp/wlb_fake_dry_run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _local_tensor_build():
    """COMM_MODE=local_tensor as run_train.sh does it: one process builds 4 ranks' trainer."""
    env = dict(
        os.environ, NGPU="4", LOCAL_RANK="0", WLB_PYTHON=sys.executable, COMM_MODE="local_tensor"
    )
    return subprocess.run(
        ["./run_train.sh", "--model.flavor", "tiny", "--training.seq_len", "256",
         "--wlb.micro_batch_max_len", "320", "--job.dump_folder", "/tmp/wlb_local_tensor_dry_run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


RUNS = {
    "test_table1_and_llama3_configs_build_with_fake_backend": _large_configs,
    "test_debug_configs_build_with_fake_backend": _debug_configs,
    "test_fake_backend_step_of_debug_config": _fake_backend_step,
    "test_local_tensor_build_of_debug_config": _local_tensor_build,
}


@pytest.fixture(scope="module")
def runs(request):
    """The selected tests' processes, started together two at a time (each is one process that
    spends most of its time importing TorchTitan on one core)."""
    selected = [
        item.originalname
        for item in request.session.items
        if item.module is sys.modules[__name__] and item.originalname in RUNS
    ]
    with ThreadPoolExecutor(2) as pool:
        yield {name: pool.submit(RUNS[name]) for name in selected}


def test_table1_and_llama3_configs_build_with_fake_backend(runs):
    assert len(LARGE) == 12  # Llama 3 8B/70B at 64K/128K, the paper's 8 Table 1 settings
    r = runs["test_table1_and_llama3_configs_build_with_fake_backend"].result()
    ok = [line for line in r.stdout.splitlines() if line.startswith("OK ")]
    assert r.returncode == 0 and len(ok) == len(LARGE), r.stdout + r.stderr[-4000:]
    sizes = {os.path.basename(line.split(":")[0]): line for line in ok}
    assert "256 ranks" in sizes["70b_128k.toml"]  # TP16 x CP4 x PP4
    # The model stays on the meta device: every layout, 70B included, is checked within 2 GiB.
    peaks = [float(line.split("peak memory ")[1].split()[0]) for line in ok]
    assert max(peaks) < 2.0, r.stdout
    assert r.stderr.strip() == "", r.stderr[-3000:]  # quiet: one line per config, nothing else


def test_debug_configs_build_with_fake_backend(runs):
    r = runs["test_debug_configs_build_with_fake_backend"].result()
    assert r.returncode == 0 and r.stdout.count("OK ") == 2, r.stdout + r.stderr[-3000:]


def test_fake_backend_step_of_debug_config(runs):
    """COMM_MODE=fake_backend as run_train.sh does it: the steps asked for, fake collectives, the
    pipeline schedule run by rank 0 with shapes its neighbours would have sent."""
    r = runs["test_fake_backend_step_of_debug_config"].result()
    out = r.stdout + r.stderr
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "step:  1/2" in out and "step:  2/2" in out, out[-3000:]
    assert "pp 2" in out, out[-3000:]


def test_local_tensor_build_of_debug_config(runs):
    """The data loader takes the symbolic DP rank of local-tensor mode, in which TorchTitan builds
    the trainer and trains no step."""
    r = runs["test_local_tensor_build_of_debug_config"].result()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "Local tensor mode enabled - skipping training execution" in r.stdout + r.stderr
