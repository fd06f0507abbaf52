"""The logged step time divides by the steps the interval covers, also right after a resume; the
logged ``wlb/step`` is the step."""

import json
import types

import pytest

from torchtitan_wlb import metrics
from torchtitan_wlb.metrics import WLBMetricsProcessor, steps_since_last_log
from torchtitan_wlb.validate import parse_job_config


@pytest.mark.parametrize(
    "step, last_logged, log_freq, expected",
    [
        (1, None, 5, 1),  # a fresh run's first step
        (10, 5, 5, 5),  # the schedule
        (5, 4, 5, 1),  # resumed from the step-4 checkpoint: step 5 is the only step since
        (10, 7, 5, 3),  # resumed from step 7, first log at step 10
        (10, None, 5, 5),  # no start recorded: TorchTitan's schedule
    ],
)
def test_steps_since_last_log(step, last_logged, log_freq, expected):
    assert steps_since_last_log(step, last_logged, log_freq) == expected


def test_step_time_after_a_resume(tmp_path, monkeypatch):
    cfg = parse_job_config(
        [
            "--job.config_file",
            "train_configs/debug_cpu.toml",
            "--metrics.log_freq",
            "5",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    dims = types.SimpleNamespace(non_data_parallel_size=1, pp_enabled=False, tp=1, pp=1)
    proc = WLBMetricsProcessor(cfg, dims)
    proc.num_flops_per_token = 1
    # start_at; log at step 5 and TorchTitan resetting its clock; the same at step 10
    clock = iter([100.0, 102.0, 102.0, 112.0, 112.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    proc.start_at(5)  # resumed from the step-4 checkpoint
    logged = []
    monkeypatch.setattr(
        metrics.MetricsProcessor,
        "log",
        lambda self, step, *a, extra_metrics: (
            logged.append(extra_metrics["wlb/step_time_s"])
            or setattr(self, "time_last_log", next(clock))
        ),
    )
    # TorchTitan's own log is replaced above, so there is no console line to extend.
    monkeypatch.setattr(WLBMetricsProcessor, "_log_step_line", lambda self, step, m: None)
    proc.log(5, 1.0, 1.0, 1.0)  # one step in 2 s
    proc.log(10, 1.0, 1.0, 1.0)  # five steps in 10 s
    assert logged == [pytest.approx(2.0), pytest.approx(2.0)]


def test_wlb_step_is_the_step(tmp_path, monkeypatch):
    """What TensorBoard (any of TorchTitan's loggers) receives as ``wlb/step`` for steps 1-3 of a
    run, whose packer numbers its plans from 0, and after a resume from step 4's checkpoint."""
    cfg = parse_job_config(
        [
            "--job.config_file",
            "train_configs/debug_cpu.toml",
            "--job.dump_folder",
            str(tmp_path),
            "--wlb.advanced.metrics_jsonl",
        ]
    )
    dims = types.SimpleNamespace(non_data_parallel_size=1, pp_enabled=False, tp=1, pp=1)
    proc = WLBMetricsProcessor(cfg, dims)
    proc.num_flops_per_token = 1
    received = []
    proc._tap.inner = types.SimpleNamespace(log=lambda m, step: received.append((step, m)))
    for plan in range(3):
        proc.ntokens_since_last_log, proc.data_loading_times = 100, [0.0]
        proc.record({"step": plan, "imbalance": 1.0})  # the packing node's statistics
        proc.log(plan + 1, 1.0, 1.0, 1.0)
    proc.start_at(5)
    proc.ntokens_since_last_log, proc.data_loading_times = 100, [0.0]
    proc.record({"step": 0, "imbalance": 1.0})  # a resumed node's own count
    proc.log(5, 1.0, 1.0, 1.0)
    assert [(step, m["wlb/step"]) for step, m in received] == [(1, 1), (2, 2), (3, 3), (5, 5)]
    with open(tmp_path / "wlb_metrics" / "rank_0.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [(r["step"], r["wlb/step"]) for r in records] == [(1, 1), (2, 2), (3, 3), (5, 5)]
