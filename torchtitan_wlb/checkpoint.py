"""``WLBCheckpointManager``: TorchTitan's CheckpointManager with a hook told of every checkpoint
once it is complete on disk (the audit log's record), a failed load as one line naming the
checkpoint, the last step's save purged like the interval saves, and a resume that passes over a
model-only last checkpoint for the full one before it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.tools.logging import logger

from torchtitan_wlb.resume import CheckpointError, latest_checkpoint_step, latest_full_step


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

    def load(self, step: int = -1) -> bool:
        """TorchTitan's load; with no ``load_step``, from the latest checkpoint that holds the
        training state. TorchTitan's default ``last_save_model_only`` writes the model alone at
        the last step, and TorchTitan would resume from it and fail on the missing data-loader
        state; the full checkpoint before it resumes exactly (``resume.check_resume`` refuses when
        there is none)."""
        if step == -1 and self.enable and os.path.isdir(self.folder):
            latest, full = latest_checkpoint_step(self.folder), latest_full_step(self.folder)
            if 0 < full < latest:
                logger.warning(
                    f"resuming from {self._create_checkpoint_id(full)}, the latest full "
                    f"checkpoint: {self._create_checkpoint_id(latest)} holds only the model "
                    "([checkpoint] last_save_model_only), not the optimizer state and data position"
                )
                step = full
        return super().load(step)

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
