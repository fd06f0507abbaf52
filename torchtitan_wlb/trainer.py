"""``WLBTrainer``: TorchTitan's Trainer with document metadata, WLB metrics and start-up checks.

TorchTitan's training loop, checkpointing, optimizers and parallelisms are used unchanged. What
this subclass adds:

  - ``__init__`` validates the config (:mod:`torchtitan_wlb.validate`) before TorchTitan creates any
    process group, so an impossible layout fails with one clear line;
  - ``post_dataloading_process`` turns each micro-batch's ``doc_lens`` and ``positions`` into the
    model's ``attention_masks`` metadata and RoPE positions (TorchTitan would derive masks from EOS
    tokens and never reset positions), and hands the packer's step statistics to the metrics;
  - ``forward_backward_step`` times every micro-batch (the measured side of the imbalance figure).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torchtitan.train import Trainer

from torchtitan_wlb.attention.metadata import metadata_from_doc_lens
from torchtitan_wlb.validate import check_job_config


class WLBTrainer(Trainer):
    """TorchTitan Trainer for the ``llama3_wlb`` train spec."""

    def __init__(self, job_config: Any):
        check_job_config(job_config)
        super().__init__(job_config)

    def post_dataloading_process(
        self, input_dict: dict[str, Any], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        stats = input_dict.pop("wlb_stats", None)
        if stats:
            self.metrics_processor.record(stats)
        if "doc_lens" not in input_dict:
            # [wlb] loader = "torchtitan": no boundaries, plain causal attention per row.
            return super().post_dataloading_process(input_dict, labels)
        inputs = input_dict.pop("input")
        positions = input_dict.pop("positions")
        doc_lens = input_dict.pop("doc_lens")
        wlb = self.job_config.wlb
        extra_kwargs: dict[str, Any] = {
            "attention_masks": metadata_from_doc_lens(
                doc_lens.cpu(), device=inputs.device, backend=wlb.attention_backend
            ),
            "positions": positions,
        }
        return inputs, labels, dict(input_dict), extra_kwargs

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        loss = super().forward_backward_step(**kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.metrics_processor.record_micro_batch_time(time.perf_counter() - start)
        return loss
