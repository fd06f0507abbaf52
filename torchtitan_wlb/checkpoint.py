"""``WLBCheckpointManager``: TorchTitan's CheckpointManager with a hook told of every checkpoint
once it is complete on disk (the audit log's record), a failed load as one line naming the
checkpoint, and the last step's save purged like the interval saves."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torchtitan.components.checkpoint import CheckpointManager

from torchtitan_wlb.resume import CheckpointError


class WLBCheckpointManager(CheckpointManager):
    """TorchTitan 0.2.2's CheckpointManager (same arguments), plus ``on_saved``."""

    def __init__(self, *args: Any, on_saved: Callable[[int], None] | None = None, **kwargs: Any):
        # Set first: TorchTitan's __init__ returns early when checkpoints are off.
        self.on_saved = on_saved
        """Called with the step of each checkpoint this process saw complete on disk."""
        super().__init__(*args, **kwargs)

    @classmethod
    def adopt(
        cls, built: CheckpointManager, on_saved: Callable[[int], None] | None = None
    ) -> WLBCheckpointManager:
        """The manager TorchTitan's ``Trainer.__init__`` built, made this subclass in place.

        TorchTitan constructs its CheckpointManager inline and offers no way to choose the class.
        Building a second one would run the constructor's side effects twice (the purge thread,
        the async modes' gloo process group, its log lines); the subclass adds only methods and
        ``on_saved``, so the built instance's state is exactly what this class needs."""
        built.__class__ = cls
        built.on_saved = on_saved
        return built

    def save(self, curr_step: int, last_step: bool = False) -> None:
        super().save(curr_step, last_step=last_step)
        if not self.enable:  # TorchTitan sets up no folder when checkpoints are off
            return
        complete = os.path.isfile(os.path.join(self.folder, f"step-{curr_step}", ".metadata"))
        if self.on_saved is not None and complete:
            self.on_saved(curr_step)
        if last_step and curr_step > 0 and not self.load_only:
            # TorchTitan purges after interval saves only; the last step's is one more (a seed
            # checkpoint, step 0, is not a training save).
            self._purge_stale_checkpoints()

    def dcp_load(
        self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        """Whatever still goes wrong inside TorchTitan's load (a damaged tensor shard, a model of
        another shape) ends as one line naming the checkpoint, not a traceback per rank."""
        try:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        except (Exception, DCPException) as e:  # noqa: BLE001 -- reported with the name
            cause = e
            if isinstance(e, DCPException) and e.failures:  # a BaseException, not an Exception
                cause = next(iter(e.failures.values()))[0]  # the first failing rank's error
            first = (str(cause).strip().splitlines() or [""])[0][:300]
            raise CheckpointError(
                f"loading checkpoint {checkpoint_id} failed ({type(cause).__name__}: {first}); "
                "the process stops before training on a partly loaded state"
            ) from e
