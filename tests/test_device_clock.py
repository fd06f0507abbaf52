"""The device clock (torchtitan_wlb.device_clock) and what reads it: the pipeline's action timer
and the trainer's micro-batch timing, whose device-clock readings feed the online cost model.

A sleep inside a timed region stands for time the OS gives to another process: it passes on the
wall clock but costs the thread no CPU time, so it must not show on the device clock on CPU. The
inequalities below hold by construction (the region sleeps ``SLEEP`` and burns ``BURN`` of CPU),
not by the machine's speed.
"""

import time
import types

import numpy as np
import pytest
import torch
from torchtitan.train import Trainer

from torchtitan_wlb import device_clock
from torchtitan_wlb.device_clock import DeviceClock, clock_kind
from torchtitan_wlb.online_fit import FitReduction, OnlineFit
from torchtitan_wlb.pipeline.varlen import _ActionTimer
from torchtitan_wlb.trainer import WLBTrainer

SLEEP, BURN = 0.1, 0.01


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setattr(device_clock.torch, "get_num_threads", lambda: 1)


@pytest.mark.parametrize(
    ("device", "threads", "kind"),
    [("cpu", 1, "thread_cpu"), ("cpu", 2, "wall"), ("cuda", 1, "cuda"), ("meta", 1, "wall")],
)
def test_clock_kind(monkeypatch, device, threads, kind):
    monkeypatch.setattr(device_clock.torch, "get_num_threads", lambda: threads)
    assert clock_kind(device) == kind
    assert DeviceClock(device).kind == kind


def test_sleep_shows_on_the_wall_not_on_the_thread_cpu_clock(one_thread):
    clock = DeviceClock("cpu")
    start = clock.read()
    time.sleep(SLEEP)
    _burn(BURN)
    wall, device = clock.since(start)
    assert wall >= SLEEP and BURN <= device < SLEEP


def test_wall_clock_with_several_intra_op_threads(monkeypatch):
    monkeypatch.setattr(device_clock.torch, "get_num_threads", lambda: 4)
    clock = DeviceClock("cpu")
    start = clock.read()
    time.sleep(SLEEP)
    wall, device = clock.since(start)
    assert device == wall >= SLEEP


class _SleepyStage:
    """A pipeline stage stand-in: its forward waits (as on a neighbour), its backward computes."""

    stage_index, device, is_last = 0, torch.device("cpu"), False

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        time.sleep(SLEEP)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        _burn(BURN)


def test_pipeline_action_times_on_both_clocks(one_thread):
    stage = _SleepyStage()
    timer = _ActionTimer(types.SimpleNamespace(), [stage], n_mb=2)
    timer.install()
    for mb in (0, 1):
        stage.forward_one_chunk(mb)
        stage.backward_one_chunk(mb)
    timer.remove()
    times = timer.result()
    assert all(t >= SLEEP for t in times.fwd_s[0]) and all(t < SLEEP for t in times.fwd_device_s[0])
    assert all(t >= BURN for t in times.bwd_device_s[0])
    assert "forward_one_chunk" not in vars(stage)


def test_trainer_fits_device_times_and_records_both(one_thread, monkeypatch):
    """No PP: the fit row of a micro-batch holds its device seconds; the metrics get wall and device."""

    def fake_forward_backward(self, **kwargs):
        time.sleep(SLEEP)
        _burn(BURN)
        return torch.zeros(())

    monkeypatch.setattr(Trainer, "forward_backward_step", fake_forward_backward)
    recorded = []
    fitter = types.SimpleNamespace(schedule=types.SimpleNamespace(release=lambda: None))
    fit = OnlineFit(
        fitter, FitReduction(rows_here=True, exchange=False), torch.device("cpu"), False
    )
    fit.features = (34.0, 8.0, 0.0)
    trainer = WLBTrainer.__new__(WLBTrainer)  # only what forward_backward_step reads
    trainer.__dict__.update(
        _micro_batches_done=0,
        gradient_accumulation_steps=2,
        _clock=DeviceClock("cpu"),
        _pp_runner=None,
        _last_doc_lens=[3, 5],
        _fit=fit,
        _ddp_ranks=1,
        _cp_stats=[],
        device=torch.device("cpu"),
        metrics_processor=types.SimpleNamespace(
            record_micro_batch_time=lambda *a, **kw: recorded.append((a, kw))
        ),
    )
    trainer.forward_backward_step(input_dict={}, labels=None, global_valid_tokens=None)
    [((wall, doc_lens), kw)] = recorded
    assert doc_lens == [3, 5] and wall >= SLEEP
    assert fit.rows == [(34.0, 8.0, 0.0, kw["device_seconds"])]
    assert BURN <= kw["device_seconds"] < SLEEP


def _sum_worker(rank: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    from torchtitan_wlb.online_fit import sum_over_group

    torch.set_num_threads(1)
    init = f"file://{os.path.join(out_dir, 'store')}"  # a file store: no port to lose
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        values = np.array([0.1, 0.2, 0.3]) * (rank + 1) + 1e-17 * rank  # stage times per rank
        total = sum_over_group(values, None, torch.device("cpu"))
        np.save(os.path.join(out_dir, f"rank{rank}.npy"), total)
    finally:
        dist.destroy_process_group()


def test_pipeline_rows_are_summed_over_the_stages_identically_on_every_rank(tmp_path):
    """Under PP the online fit's row is a micro-batch's time through every stage: each rank's
    stage times, summed over the group in rank order, the same bits on both ranks."""
    import torch.multiprocessing as mp

    # fork: the children inherit the imported trainer (spawning re-imports torchtitan, ~10 s)
    mp.start_processes(_sum_worker, (str(tmp_path),), nprocs=2, start_method="fork")
    ranks = [np.load(tmp_path / f"rank{r}.npy") for r in (0, 1)]
    reference = np.array([0.1, 0.2, 0.3]) + (np.array([0.1, 0.2, 0.3]) * 2 + 1e-17)
    assert ranks[0].tobytes() == ranks[1].tobytes()
    np.testing.assert_array_equal(ranks[0], reference)
