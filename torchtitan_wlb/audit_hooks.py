"""When the trainer writes the exactly-once audit log (``audit_log.AuditLog``; its records:
docs/data.md): the launch's start, each micro-batch's documents, each completed step, each
checkpoint complete on disk, and the end of training."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from torchtitan_wlb.audit_log import AuditLog


class AuditHooks:
    """One rank's audit log, written at the trainer's hook points."""

    def __init__(self, log: AuditLog, loader: Any) -> None:
        self.log = log
        self.loader = loader
        """The document dataloader: its ``accounting()`` gives the pending documents."""
        self.completed_step = 0
        """The last step this launch completed (TorchTitan advances the step before running it)."""

    @classmethod
    def build(cls, job_config: Any, loader: Any) -> AuditHooks | None:
        """Every rank's hooks, for the document loader on real process groups; else None."""
        if job_config.comm.mode != "default" or not hasattr(loader, "accounting"):
            return None
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        log = AuditLog(job_config.job.dump_folder, rank, loader.dp_rank, loader.dp_world_size)
        return cls(log, loader)

    def step_begins(self, step: int) -> None:
        """Before step ``step``; the first writes the launch's start record."""
        if not self.log.started:
            # One launch id for all ranks (rank 0's), written before the first step: a launch
            # killed during it still supersedes the steps it would re-train.
            launch = [f"{time.time_ns()}-{os.getpid()}"]
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                torch.distributed.broadcast_object_list(launch, src=0)
            launch_time = int(launch[0].split("-")[0]) / 1e9
            self.log.start(launch[0], launch_time, resumed_from=step - 1)
        self.log.begin_step()
        self.completed_step = step - 1

    def micro_batch(self, doc_ids: list[int]) -> None:
        self.log.add_micro_batch(doc_ids)

    def step_done(self, step: int) -> None:
        self.completed_step = step
        self.log.step_done(step)

    def checkpoint_saved(self, step: int) -> None:
        """The checkpoint of ``step`` is complete on disk (``WLBCheckpointManager.on_saved``)."""
        if self.log.started:
            self.log.checkpoint(step, pending=self.loader.accounting()[0])

    def training_ended(self, step: int) -> None:
        """The closing record, after TorchTitan's loop ends at ``step``: a step that found no data
        left was canceled, and the data has ended."""
        if not self.log.started:
            return
        done, (pending, documents) = self.completed_step, self.loader.accounting()
        ended = done < step
        reason = "end of data" if ended else "steps"
        self.log.end(done, reason, pending, documents=documents if ended else None)
