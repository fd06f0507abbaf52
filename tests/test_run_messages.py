"""What a run says: nothing-to-do, resume step, the step line's N/M and eta, quiet warnings."""

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from torchtitan.config import ConfigManager

from torchtitan_wlb import log_filter
from torchtitan_wlb.metrics import eta_seconds, format_duration
from torchtitan_wlb.resume import latest_checkpoint_step, resume_step
from torchtitan_wlb.run_messages import nothing_to_do, run_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")


def _config(dump, *overrides):
    return ConfigManager().parse_args(
        ["--job.config_file", DEBUG_CPU, "--job.dump_folder", str(dump), *overrides]
    )


def _checkpoint(dump, step, complete=True):
    folder = dump / "checkpoint" / f"step-{step}"
    folder.mkdir(parents=True)
    if complete:
        (folder / ".metadata").write_bytes(b"")


def test_latest_checkpoint_ignores_incomplete_folders(tmp_path):
    assert latest_checkpoint_step(str(tmp_path / "nowhere")) == -1
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 30, complete=False)  # an interrupted save: TorchTitan skips it too
    (tmp_path / "checkpoint" / "step-x").mkdir()
    assert latest_checkpoint_step(str(tmp_path / "checkpoint")) == 10


def test_nothing_to_do_once_the_checkpoint_reaches_training_steps(tmp_path):
    assert nothing_to_do(_config(tmp_path)) is None  # no checkpoint: train
    _checkpoint(tmp_path, 20)
    assert resume_step(_config(tmp_path)) == 20
    line = nothing_to_do(_config(tmp_path))  # debug_cpu: 20 steps
    assert line.startswith("nothing to do:") and "step 20 >= training.steps = 20" in line
    assert "\n" not in line
    assert nothing_to_do(_config(tmp_path, "--training.steps", "40")) is None
    assert nothing_to_do(_config(tmp_path, "--checkpoint.no-enable")) is None
    assert nothing_to_do(_config(tmp_path, "--comm.mode", "fake_backend")) is None


def test_second_run_says_nothing_to_do_in_one_line_before_building(tmp_path):
    _checkpoint(tmp_path, 20)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_wlb.train",
            "--job.config_file",
            DEBUG_CPU,
            "--job.dump_folder",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and "nothing to do: the checkpoint" in lines[0], lines


def test_run_summary_names_layout_packer_dataset_checkpoints_and_start(tmp_path):
    pd = SimpleNamespace(
        dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, world_size=2, cp_enabled=False
    )
    job_config = _config(tmp_path)
    assert run_summary(job_config, pd, "cpu", -1) == [
        "run: 2 cpu ranks over gloo: dp_shard 2; llama3_wlb debugmodel; 20 steps",
        "data: dataset 'wlb_builtin' (built-in corpus); packing 'wlb', 4 micro-batches per step of "
        "up to 2,560 tokens (context 2,048)",
        f"checkpoints: {tmp_path}/checkpoint, every 10 steps and at the last, keeping the latest 2",
        f"starting at step 1 (no checkpoint in {tmp_path}/checkpoint)",
    ]
    resumed = run_summary(job_config, pd, "cpu", 10)
    assert resumed[-1] == f"resuming from step 10 ({tmp_path}/checkpoint/step-10)"


def test_run_summary_says_which_preset_fields_the_user_set(tmp_path):
    pd = SimpleNamespace(
        dp_replicate=1, dp_shard=1, cp=2, tp=1, pp=1, world_size=2, cp_enabled=True
    )
    data = run_summary(_config(tmp_path, "--wlb.cp_sharding", "per_document"), pd, "cpu", -1)[1]
    assert data.startswith("data: dataset 'wlb_builtin' (built-in corpus); packing 'wlb', ")
    assert data.endswith("; CP sharding 'per_document' (set; mode 'wlb' has 'adaptive')")
    data = run_summary(_config(tmp_path, "--wlb.packing", "solver"), pd, "cpu", -1)[1]
    assert "packing 'solver' (set; mode 'wlb' has 'wlb'), " in data
    assert data.endswith("; CP sharding 'adaptive'")
    data = run_summary(_config(tmp_path, "--wlb.mode", "plain_4d"), pd, "cpu", -1)[1]
    assert "packing 'original', " in data and data.endswith("; CP sharding 'per_sequence'")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (45.4, "45s"), (185, "3m05s"), (7440, "2h04m"), (273600, "3d04h")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_eta_leaves_out_the_warm_up_step():
    assert eta_seconds(1, 20, [9.0]) == 19 * 9.0
    assert eta_seconds(3, 20, [9.0, 2.0, 4.0]) == 17 * 3.0
    assert eta_seconds(20, 20, [1.0, 1.0]) == 0.0


def test_log_filter_drops_only_inapplicable_lines():
    flt = log_filter.InapplicableWarnings()

    def passes(msg, level=logging.WARNING):
        record = logging.LogRecord("root", level, __file__, 1, msg, None, None)
        return flt.filter(record), record.getMessage()

    assert passes("HF assets path  does not exist!")[0] is False
    assert passes("HF assets path /data/llama does not exist!")[0] is True  # a real path: warn
    assert passes("something else went wrong")[0] is True
    # The suite runs on CPU (conftest activates CPU support).
    assert passes("Error running lspci: [Errno 2] No such file")[0] is False
    assert passes("Peak flops undefined for: AMD EPYC x2, fallback to A100")[0] is False
    assert passes("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3")[0] is False
    # TorchTitan's peak, which its MFU no longer divides by (torchtitan_wlb.mfu logs its own).
    assert passes("Peak FLOPS used for computing MFU: 3.120e+14", logging.INFO)[0] is False
