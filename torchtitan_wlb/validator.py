"""``[validation]`` under WLB: the mean loss over every token of a fixed held-out set of documents,
the same number on one rank or any layout (docs/validation.md).

TorchTitan's ``Validator`` reads fixed-length rows of a C4 download and averages the per-batch
means; this one subclasses its ``BaseValidator`` (the ``freq`` schedule), reuses its metrics
processor's ``log_validation`` (console line, TensorBoard) and the trainer's own context, AMP and
sharding, and evaluates packed documents (:mod:`torchtitan_wlb.data.heldout`). It holds no state a
checkpoint needs: the set is rebuilt from the config, so a resumed run validates exactly as an
uninterrupted one, and training's data loader is never touched.
"""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import BaseValidator
from torchtitan.tools.logging import logger

from torchtitan_wlb.attention.metadata import metadata_from_doc_lens
from torchtitan_wlb.data.collate import collate_micro_batch
from torchtitan_wlb.data.heldout import (
    deal,
    pack_sequences,
    read_heldout_documents,
    token_budget,
    validation_source,
)

VALIDATION_JSONL = "wlb_validation.jsonl"
"""Per validation, ``{"step", "loss", "tokens"}`` at full precision, in ``[job] dump_folder`` (rank
0, with ``[wlb.advanced] metrics_jsonl``)."""


class WLBValidator(BaseValidator):
    """TrainSpec.build_validator_fn of ``llama3_wlb`` (TorchTitan's keyword arguments); the
    trainer calls :meth:`attach` once built, which lends its sharding and pipeline runner."""

    def __init__(
        self,
        job_config: Any,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        parallel_dims: Any,
        loss_fn: Any,
        validation_context: Any,
        maybe_enable_amp: AbstractContextManager[None],
        metrics_processor: Any,
        pp_schedule: Any = None,
        pp_has_first_stage: bool | None = None,
        pp_has_last_stage: bool | None = None,
    ):
        super().__init__(job_config)
        v = job_config.validation
        source = validation_source(v, job_config.wlb.advanced.text_field)
        docs = read_heldout_documents(source, tokenizer, v.seq_len, token_budget(v))
        sequences = pack_sequences(docs, v.seq_len)
        self.documents, self.tokens = len(docs), int(sum(d.size for d in docs))
        self.sequences = deal(sequences, int(dp_rank), dp_world_size)
        # Forward passes per rank: the same on every rank (FSDP and CP collectives run in each).
        self.rounds = -(-len(sequences) // dp_world_size)
        self.parallel_dims = parallel_dims
        self.loss_fn = loss_fn
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pp_has_last_stage = pp_has_last_stage
        self.trainer: Any = None
        self.last_step: int | None = None  # the step of the last validation
        logger.info(
            f"validation: {self.documents:,} held-out documents of {v.dataset!r}, "
            f"{self.tokens:,} tokens in {len(sequences)} sequences of <= {v.seq_len}, "
            f"every {v.freq} steps"
        )

    def attach(self, trainer: Any) -> None:
        """The trainer whose padding, CP sharding and pipeline runner the evaluation uses."""
        self.trainer = trainer
        runner = trainer._pp_runner
        if runner is not None:  # whole pipeline steps, fillers after the last sequence
            n = runner.n_microbatches
            self.rounds = -(-self.rounds // n) * n

    @torch.no_grad()
    def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        for model in model_parts:
            model.eval()
        try:
            if self.trainer._pp_runner is None:
                loss_sum, tokens = self._evaluate(model_parts[0])
            else:
                loss_sum, tokens = self._evaluate_pipeline()
        finally:
            for model in model_parts:
                model.train()
        loss, tokens = self._reduce(loss_sum, tokens)
        self.metrics_processor.log_validation(
            loss=loss, step=step, extra_metrics={"validation_metrics/tokens": tokens}
        )
        self._write_jsonl(step, loss, tokens)
        self.last_step = step

    def validate_final(self, model_parts: list[torch.nn.Module], step: int) -> None:
        """After the last step ``step`` of the run: validate, unless that step just was."""
        if step != self.last_step:
            self.validate(model_parts, step)

    def _batches(self) -> list[tuple[Tensor, Tensor, dict[str, Any]]]:
        """This rank's sequences, then one-token fillers (labels ignored) up to ``rounds``, each
        as ``(inputs, labels, model kwargs)`` after the trainer's padding and CP sharding."""
        empty = collate_micro_batch(np.zeros(0, np.int64), np.zeros(0, np.int64))
        batches = [s.batch() for s in self.sequences]
        batches += [empty] * (self.rounds - len(batches))
        return [self._prepare(input_dict, labels) for input_dict, labels in batches]

    def _prepare(
        self, input_dict: dict[str, Tensor], labels: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        trainer, pd = self.trainer, self.parallel_dims
        device = trainer.device
        inputs = input_dict["input"].to(device)
        positions = input_dict["positions"].to(device)
        labels = labels.to(device)
        doc_lens = input_dict["doc_lens"]
        backend = trainer.job_config.wlb.advanced.attention_backend
        if pd.tp_enabled or pd.cp_enabled:
            inputs, labels, positions, doc_lens = trainer._pad_for_sharding(
                inputs, labels, positions, doc_lens
            )
        if pd.cp_enabled:
            inputs, labels, positions, meta = trainer._shard_for_cp(
                inputs, labels, positions, doc_lens.numpy(), backend, record=False
            )
        else:
            meta = metadata_from_doc_lens(doc_lens, device=device, backend=backend)
        self.metrics_processor.ntokens_since_last_log += int(labels.numel())
        return inputs, labels, {"attention_masks": meta, "positions": positions}

    def _evaluate(self, model: torch.nn.Module) -> tuple[float, int]:
        """``(loss summed over this rank's tokens, their number)`` without a pipeline."""
        loss_sum, tokens = 0.0, 0
        for inputs, labels, kwargs in self._batches():
            with self.validation_context(), self.maybe_enable_amp:
                loss = self.loss_fn(model(inputs, **kwargs), labels)
            loss_sum += _scalar(loss)
            tokens += int((labels != IGNORE_INDEX).sum())
        return loss_sum, tokens

    def _evaluate_pipeline(self) -> tuple[float, int]:
        """The same through the pipeline's variable-length runner, forward only; the sums are the
        last stage's (zero elsewhere)."""
        runner = self.trainer._pp_runner
        n = runner.n_microbatches
        batches = self._batches()
        loss_sum, tokens = 0.0, 0
        with runner.forward_only():
            for i in range(0, len(batches), n):
                chunk = batches[i : i + n]
                losses: list[Tensor] | None = [] if self.pp_has_last_stage else None
                with self.validation_context():
                    runner.step(
                        [b[0] for b in chunk] if runner.has_first_stage else None,
                        [b[2] for b in chunk],
                        [b[1] for b in chunk] if runner.has_last_stage else None,
                        seq_lens=self.trainer.stage_seq_lens([b[0] for b in chunk]),
                        losses=losses,
                    )
                if losses is not None:
                    loss_sum += sum(_scalar(x) for x in losses)
                    tokens += sum(int((b[1] != IGNORE_INDEX).sum()) for b in chunk)
        return loss_sum, tokens

    def _reduce(self, loss_sum: float, tokens: int) -> tuple[float, int]:
        """Sums over the data-parallel and CP ranks and the pipeline's stages (TP ranks hold the
        same sums), then the mean: every token weighs the same, whatever the layout."""
        pd = self.parallel_dims
        totals = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64)
        totals = totals.to(self.trainer.device)
        groups = [pd.get_optional_mesh("loss") if pd.dp_cp_enabled else None]
        groups.append(pd.get_mesh("pp") if pd.pp_enabled else None)
        for mesh in groups:
            if mesh is not None:
                dist.all_reduce(totals, group=mesh.get_group())
        loss_total, count = totals.tolist()
        return loss_total / max(count, 1.0), int(count)

    def _write_jsonl(self, step: int, loss: float, tokens: int) -> None:
        jc = self.job_config
        if not jc.wlb.advanced.metrics_jsonl or (dist.is_initialized() and dist.get_rank()):
            return
        os.makedirs(jc.job.dump_folder, exist_ok=True)
        with open(os.path.join(jc.job.dump_folder, VALIDATION_JSONL), "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "tokens": tokens}) + "\n")


def _scalar(loss: Tensor) -> float:
    """A loss as a float (a loss-parallel DTensor is replicated: its local value)."""
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return float(loss.detach().double())


def build_wlb_validator(**kwargs: Any) -> WLBValidator:
    """TrainSpec.build_validator_fn: TorchTitan passes the arguments by name."""
    return WLBValidator(**kwargs)
