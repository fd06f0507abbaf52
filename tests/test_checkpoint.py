"""``WLBCheckpointManager``: TorchTitan's CheckpointManager, plus the hook told of each checkpoint
complete on disk (the audit log's record), the last step's save purged like the interval saves,
and a failed load as one line naming the checkpoint. One process, a one-rank gloo group."""

import os

import pytest
import torch
import torch.distributed as dist
from torchtitan.config.job_config import Checkpoint

from torchtitan_wlb.checkpoint import WLBCheckpointManager
from torchtitan_wlb.resume import CheckpointError


class _Empty:
    """A stateful part with no state (stands in for the optimizers, schedulers and loader)."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def _manager(dump, on_saved=None, width=2, **checkpoint):
    config = Checkpoint(**{"enable": True, "interval": 2, "keep_latest_k": 2, **checkpoint})
    return WLBCheckpointManager(
        dataloader=_Empty(),
        model_parts=[torch.nn.Linear(width, width)],
        optimizers=_Empty(),
        lr_schedulers=_Empty(),
        states={"train_state": _Empty()},
        checkpoint_config=config,
        sd_adapter=None,
        base_folder=str(dump),
        on_saved=on_saved,
    )


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def _train(manager, steps):
    """TorchTitan's loop's saves: after every step, the last one flagged."""
    try:
        for step in range(1, steps + 1):
            manager.save(step, last_step=step == steps)
    finally:
        manager.close()  # the purge thread's deletions are done when it returns


def test_complete_checkpoints_are_reported_and_the_last_save_purges(tmp_path, one_rank):
    saved = []
    _train(_manager(tmp_path, saved.append), 7)
    assert saved == [2, 4, 6, 7]
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-6", "step-7"]


def test_a_seed_checkpoint_purges_nothing(tmp_path, one_rank):
    manager = _manager(tmp_path, keep_latest_k=2)
    for step in (2, 4):
        manager.save(step)
    manager.save(0, last_step=True)  # TorchTitan's --checkpoint.create_seed_checkpoint
    manager.close()
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-0", "step-2", "step-4"]


def test_checkpoints_off_save_and_report_nothing(tmp_path):
    saved = []
    _train(_manager(tmp_path, saved.append, enable=False), 4)
    assert saved == [] and not (tmp_path / "checkpoint").exists()


def test_a_failed_load_is_one_line_naming_the_checkpoint(tmp_path, one_rank):
    _train(_manager(tmp_path), 2)
    other = _manager(tmp_path, width=3)  # a model of another shape
    try:
        with pytest.raises(CheckpointError) as raised:
            other.load(step=2)
    finally:
        other.close()
    message = str(raised.value)
    assert message.startswith(f"loading checkpoint {tmp_path}/checkpoint/step-2 failed (")
    assert "(ValueError: Size mismatch" in message  # the failing rank's error, not DCP's wrapper
    assert message.endswith("the process stops before training on a partly loaded state")
    assert "\n" not in message
