"""Rank entry point of the kill tests: ``torchtitan_wlb.train`` with a SIGKILL at a chosen moment.

``WLB_TEST_KILL="<where>:<step>:<rank>"`` makes global rank ``<rank>`` kill itself with SIGKILL

  - ``mid_step``: during step ``<step>``, right after its first micro-batch's forward and backward
    (data consumed, no optimizer update);
  - ``checkpoint``: while the checkpoint of step ``<step>`` is being written, right after this
    rank's shard file is on disk and before the checkpoint's ``.metadata`` is.

The tests launch it through ``tests/fork_launch.py``, which installs the hook in each forked rank;
``torchrun ... tests/kill_points.py ARGS`` runs it as a script. Either way the package needs no
test hooks.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_wlb import train  # noqa: E402  (activates CPU support first)


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(spec: str) -> None:
    where, step, rank = spec.split(":")
    step, rank = int(step), int(rank)
    if int(os.environ.get("RANK", "0")) != rank:
        return
    if where == "mid_step":
        from torchtitan_wlb.trainer import WLBTrainer

        original = WLBTrainer.forward_backward_step

        def forward_backward_step(self, **kwargs):
            loss = original(self, **kwargs)
            if self.step == step:
                _die()
            return loss

        WLBTrainer.forward_backward_step = forward_backward_step
    elif where == "checkpoint":
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        original = FileSystemWriter.write_data

        def write_data(self, plan, planner):
            fut = original(self, plan, planner)
            fut.wait()
            if os.path.basename(os.path.normpath(str(self.path))) == f"step-{step}":
                _die()
            return fut

        FileSystemWriter.write_data = write_data
    else:
        raise ValueError(f"WLB_TEST_KILL = {spec!r}: where must be mid_step or checkpoint")


if __name__ == "__main__":
    if os.environ.get("WLB_TEST_KILL"):
        install(os.environ["WLB_TEST_KILL"])
    train.exit_now(train.main())
