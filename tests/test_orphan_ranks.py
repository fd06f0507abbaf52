"""No orphan ranks: when the launcher dies, its ranks stop within seconds and write nothing more.

torchrun gives every rank a session of its own, so SIGKILL of the launch's process group reaches
only torchrun. Without a watch, the two ranks below would go on training and write a checkpoint
every step.

The test waits on the processes themselves, not on a clock: on each rank's end (a pidfd turns
readable when its process ends), then on every process left in the ranks' sessions (whatever a
rank started). Once none is left, nothing can write into the run's folder any more; the time
bounds only fail the test, they never pass it.
"""

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")

pytestmark = pytest.mark.slow


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")  # zombies are dead
    except FileNotFoundError:
        return False


def _session_members(sessions):
    """Live processes in the given sessions: the ranks and whatever they started (a child keeps
    its parent's sid unless it calls setsid)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _ppid, _pgrp, sid = f.read().split(")")[-1].split()[:4]
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended while listed
        if int(sid) in sessions and state not in ("Z", "X"):
            members.append(int(entry))
    return members


def _wait_exits(pids, timeout):
    """Wait for every process in ``pids`` to end (its pidfd turns readable when it does); the
    processes still running after ``timeout`` seconds."""
    running = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # already gone
            running[os.pidfd_open(pid)] = pid
    poller = select.poll()
    for fd in running:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    try:
        while running and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                os.close(fd)
                del running[fd]
        return sorted(running.values())
    finally:
        for fd in running:
            os.close(fd)


def _snapshot(dump):
    audit = dump / "wlb_audit"
    ckpts = sorted(os.listdir(dump / "checkpoint")) if (dump / "checkpoint").exists() else []
    return ckpts, {p.name: p.stat().st_size for p in audit.iterdir()}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads rank states from /proc")
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on pidfds (Linux 5.3+)")
def test_ranks_stop_when_the_launcher_is_killed(tmp_path):
    dump = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--role", "rank",
        "-m", "torchtitan_wlb.train", "--job.config_file", DEBUG_CPU, "--model.flavor", "tiny",
        "--training.seq_len", "128", "--wlb.micro_batch_max_len", "160",
        "--training.global_batch_size", "4", "--training.steps", "500",
        "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0",
        "--job.dump_folder", str(dump),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    log = dump / "wlb_audit" / "rank_0.jsonl"
    ranks = []
    try:
        deadline = time.time() + 300
        while not (log.exists() and log.read_text().count('"event": "step"') >= 3):
            assert time.time() < deadline, "the run did not reach step 3"
            assert launcher.poll() is None, "the run ended early"
            time.sleep(0.1)
        ranks = [
            int(p)
            for p in subprocess.run(
                ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
            ).stdout.split()
        ]
        assert len(ranks) == 2
        # The ranks are outside the launcher's process group: the kill below does not reach them.
        assert all(os.getpgid(pid) != launcher.pid for pid in ranks)
        sessions = {os.getsid(pid) for pid in ranks}
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        left = _wait_exits(ranks, timeout=10)
        assert not left, f"ranks {left} still running 10 s after their launcher died"
        after = _snapshot(dump)
        # Whatever a rank started ends with it: once no process of the ranks' sessions is left,
        # nothing is left that could write into the run's folder.
        left = _wait_exits(_session_members(sessions), timeout=10)
        assert not left, f"processes {left} of the ranks' sessions outlive the ranks"
        assert not _session_members(sessions)
        assert _snapshot(dump) == after, "something was written after the ranks stopped"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
