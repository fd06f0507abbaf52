"""Kills at the worst moments: every document still trained exactly once, losses unchanged.

One pass over a small dataset (``[wlb] epochs = 1``, so the pass is finite) on two CPU ranks, for
DP = 2 (from the dataset pre-tokenized into an indexed corpus, its documents in a seeded order:
``[wlb] shuffle_seed``), PP = 2 and CP = 2 (from the jsonl text), launched by
``tests/fork_launch.py`` (torchrun's agent, ranks forked from it: twelve launches would otherwise
import torch and TorchTitan 24 times). Each layout runs once uninterrupted and, side by side with
it, as a chain of launches in one dump folder, each killed with SIGKILL of one rank
(tests/kill_points.py) and rerun with the same command, which resumes from the latest complete
checkpoint:

  1. mid-step, in step 3, with outliers sitting in the packer's queues since step 2: resumes from
     the checkpoint of step 2, the queued outliers restored from it;
  2. while the checkpoint of step 6 is being written (one shard on disk, no ``.metadata``), with
     outliers queued again: resumes from the checkpoint of step 4;
  3. to the end of the data.

Then ``python -m torchtitan_wlb.tools.audit --require-complete`` must prove, from every rank's
audit log across the three launches, that each document of the pass was trained exactly once, and
every step's loss must equal the uninterrupted run's (CPU, fp32: bitwise).
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from torchtitan_wlb.audit_log import read_audit_logs
from torchtitan_wlb.tools.audit import main as audit_main
from torchtitan_wlb.tools.pretokenize import main as pretokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
LAUNCH = os.path.join(ROOT, "tests", "fork_launch.py")

pytestmark = pytest.mark.slow

INDEXED = "{indexed}"  # replaced by the indexed corpus's prefix
LAYOUTS = {
    "dp2": [
        "--training.dataset",
        "indexed",
        "--training.dataset_path",
        INDEXED,
        "--wlb.shuffle_seed",
        "6",
    ],  # fmt: skip
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
    "cp2": ["--parallelism.context_parallel_degree", "2", "--wlb.cp_sharding", "per_document"],
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """58 documents with a long tail (some split into pieces): 10 steps of 4 micro-batches."""
    rng = np.random.default_rng(0)
    words = np.array(["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"])
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    with open(path, "w") as f:
        for _ in range(58):
            n = int(min(rng.pareto(1.2) * 8 + 3, 60))
            f.write(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n")
    prefix = str(path.parent / "docs")
    assert (
        pretokenize([prefix, "--dataset", "jsonl", "--dataset-path", str(path), "--workers", "1"])
        == 0
    )
    return path


def _start(dump, dataset, layout, kill=None):
    """Start one launch; its output goes to a log file beside the dump folder."""
    cmd = [
        sys.executable, LAUNCH, "--nproc_per_node=2", "--job.config_file", DEBUG_CPU,
        "--model.flavor", "tiny", "--training.seq_len", "128",
        "--wlb.micro_batch_max_len", "160", "--training.global_batch_size", "4",
        "--training.dataset", "jsonl", "--training.dataset_path", str(dataset),
        "--wlb.epochs", "1", "--training.steps", "1000", "--checkpoint.interval", "2",
        "--checkpoint.keep_latest_k", "0", "--wlb.advanced.metrics_jsonl",
        "--metrics.disable_color_printing", "--debug.seed", "7", "--job.dump_folder", str(dump),
        *(str(dataset.parent / "docs") if a == INDEXED else a for a in LAYOUTS[layout]),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WLB_TEST_KILL", None)
    if kill:
        env["WLB_TEST_KILL"] = kill
    log = open(f"{dump}.{kill or 'run'}.log", "w+")  # noqa: SIM115  (closed by _finish)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, log, kill


def _finish(launch, timeout=400):
    """Wait for a launch (killing it past ``timeout``): killed where asked, else exit 0."""
    proc, log, kill = launch
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        out = log.read()
        log.close()
    if kill:
        assert proc.returncode != 0, f"{kill}: the run was not killed\n{out[-3000:]}"
    else:
        assert proc.returncode == 0, out[-4000:]
    return out


def _launch(dump, dataset, layout, kill=None):
    return _finish(_start(dump, dataset, layout, kill))


def _metrics(dump):
    """Per step, the metrics record of the rank that holds the loss (a later launch's wins)."""
    out = {}
    folder = os.path.join(dump, "wlb_metrics")
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            for rec in map(json.loads, f):
                if rec["loss"] > 0:
                    out[rec["step"]] = rec
    return out


def _queued(record):
    """Outliers waiting in the packer's queues after this step."""
    return sum(v for k, v in record.items() if k.startswith("wlb/queue_depths"))


def _starts(dump):
    """``resumed_from`` of every launch that started training, in order."""
    starts = {}
    for rec in read_audit_logs(str(dump)):
        if rec["event"] == "start":
            starts[rec["launch"]] = (rec["launch_time"], rec["resumed_from"])
    return [resumed for _, resumed in sorted(starts.values())]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_killed_at_the_worst_moments_trains_each_document_once(tmp_path, dataset, layout, capsys):
    # The uninterrupted reference runs beside the chain of launches (its own dump folder): each
    # launch spends seconds on one core importing TorchTitan, the other core is free meanwhile.
    ref = tmp_path / "ref"
    reference_launch = _start(ref, dataset, layout)
    try:
        run = tmp_path / "run"
        _launch(run, dataset, layout, kill="mid_step:3:1")
        _launch(run, dataset, layout, kill="checkpoint:6:0")
        partial = run / "checkpoint" / "step-6"
        assert any(partial.glob("*.distcp")) and not (partial / ".metadata").exists()
        out = _launch(run, dataset, layout)
        assert "Training starts at step 5" in out
    except BaseException:  # stop the reference: the chain's failure is the one to report
        proc, log, _ = reference_launch
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        raise
    _finish(reference_launch)
    assert audit_main([str(ref), "--require-complete"]) == 0
    reference = _metrics(ref)
    # The moments are the worst ones for this data: outliers queued at both kills.
    assert _queued(reference[2]) > 0 and _queued(reference[6]) > 0 and max(reference) > 8

    assert _starts(run) == [0, 2, 4]
    capsys.readouterr()
    assert audit_main([str(run), "--require-complete"]) == 0
    verdict = capsys.readouterr().out
    assert verdict.startswith("exactly once:") and "3 launches" in verdict, verdict
    assert "re-trained after resume: steps 5-6" in verdict, verdict
    losses = {step: rec["loss"] for step, rec in _metrics(run).items()}
    assert losses == {step: rec["loss"] for step, rec in reference.items()}
