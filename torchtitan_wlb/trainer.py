"""``WLBTrainer``: TorchTitan's Trainer with document metadata, per-micro-batch CP plans and
variable-length PP (docs/architecture.md). The online cost model's plumbing (``online_fit``), the
audit log's hooks (``audit_hooks``), the checkpointer (``checkpoint``) and what a run says
(``run_messages``) live beside it."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from torchtitan_wlb import resume
from torchtitan_wlb.attention.metadata import DocumentAttentionMetadata, metadata_from_doc_lens
from torchtitan_wlb.audit_hooks import AuditHooks
from torchtitan_wlb.checkpoint import WLBCheckpointManager
from torchtitan_wlb.device_clock import DeviceClock
from torchtitan_wlb.models.llama3_wlb import cost_model_for_job
from torchtitan_wlb.online_fit import OnlineFit, cp_fit_features
from torchtitan_wlb.run_messages import CompileCounter, done_line, run_summary
from torchtitan_wlb.validate import check_job_config


def ddp_ranks(parallel_dims: Any) -> int:
    """The ranks over which pure DDP averages gradients (1: none). TorchTitan divides each rank's
    loss by the valid tokens of all data-parallel ranks together, so the ranks' gradients must be
    summed: FSDP and HSDP do (TorchTitan turns their division off), DDP divides the sum by its
    ranks, which would halve the gradient on 2 ranks and clip it at twice ``max_norm``."""
    if parallel_dims.fsdp_enabled or not parallel_dims.dp_replicate_enabled:
        return 1
    return parallel_dims.dp_replicate


class WLBTrainer(Trainer):
    """TorchTitan Trainer for the ``llama3_wlb`` train spec."""

    def __init__(self, job_config: Any):
        check_job_config(job_config)
        if job_config.comm.mode in resume.FAKE_COMM_MODES and job_config.checkpoint.enable:
            job_config.checkpoint.enable = False
            logger.info(
                f"comm.mode = {job_config.comm.mode}: checkpoints are neither loaded nor saved "
                "(fake collectives cannot write one)"
            )
        super().__init__(job_config)
        if job_config.comm.mode in resume.FAKE_COMM_MODES and self.device.type == "cpu":
            # What fake collectives "receive" is uninitialised memory; its denormal numbers would
            # make the CPU's arithmetic, and so the step's time, many times slower.
            torch.set_flush_denormal(True)
        wlb = job_config.wlb
        self._pp_pending: list[tuple[Tensor, Tensor, dict[str, Any]]] = []
        self._pp_doc_lens: list[list[int]] = []
        self._pp_runner = None
        if self.parallel_dims.pp_enabled:
            from torchtitan_wlb.pipeline.varlen import VarlenPipelineRunner

            timed = wlb.advanced.metrics_jsonl or wlb.cost_model == "online"
            self._pp_runner = VarlenPipelineRunner(self.pp_schedule, time_actions=timed)
        self._cp_profile = self._adaptive_cp_profile()
        self._cp_stats: list[tuple[str, float]] = []
        self._last_doc_lens: list[int] | None = None
        self._cost_model = (
            cost_model_for_job(job_config) if wlb.advanced.loader == "documents" else None
        )
        self._fit = OnlineFit.build(job_config, self.parallel_dims, self.dataloader, self.device)
        self._clock = DeviceClock(self.device)
        self.metrics_processor.device_clock = self._clock.kind
        self._micro_batches_done = 0
        self._steps_done: int | None = None  # the last step trained by this launch
        compiled = job_config.compile.enable and "model" in job_config.compile.components
        self._compiles = CompileCounter() if compiled else None
        self._ddp_ranks = ddp_ranks(self.parallel_dims)
        self._audit = AuditHooks.build(job_config, self.dataloader)
        on_saved = self._audit.checkpoint_saved if self._audit is not None else None
        self.checkpointer = WLBCheckpointManager.adopt(self.checkpointer, on_saved=on_saved)
        if job_config.validation.enable:
            self.validator.attach(self)  # its sharding and pipeline runner are this trainer's

    def _adaptive_cp_profile(self) -> Any:
        """Under adaptive CP sharding, the throughput profile it chooses by: ``[wlb] cp_profile``,
        else the one shipped for this GPU, else the packaged CPU one (with a warning)."""
        wlb = self.job_config.wlb
        if not self.parallel_dims.cp_enabled or wlb.cp_sharding != "adaptive":
            return None
        from torchtitan_wlb.cp.profile import packaged_profile_for, resolve_profile

        profile = resolve_profile(wlb.cp_profile or None)
        if self.device.type == "cuda" and not wlb.cp_profile:
            name = torch.cuda.get_device_name(self.device)
            if (shipped := packaged_profile_for(name)) is not None:
                logger.info(f"adaptive CP sharding: the shipped profile of {shipped.device}")
                return shipped
            logger.warning(
                f"adaptive CP sharding is choosing with the packaged CPU throughput "
                f"profile: none is shipped for {name}; measure one (python -m "
                "torchtitan_wlb.tools.cp_profile --device cuda --out FILE) and set "
                "[wlb] cp_profile = FILE"
            )
        return profile

    def train(self) -> None:
        """TorchTitan's training loop, opened and closed by what the run does and did."""
        jc = self.job_config
        # Before TorchTitan loads anything: a damaged or mismatched checkpoint is one line.
        resume.check_resume(jc, getattr(self.dataloader, "fingerprint", None))
        start_step = resume.resume_step(jc)
        for line in run_summary(jc, self.parallel_dims, self.device.type, start_step):
            logger.info(line)
        begin = time.perf_counter()
        super().train()
        if jc.validation.enable and self._steps_done is not None:
            # The trained model's held-out loss, when the last step was not a multiple of freq
            # (the data ended, or steps is not one).
            self.validator.validate_final(self.model_parts, self._steps_done)
        if self._audit is not None:
            self._audit.training_ended(self.step)
        seconds = time.perf_counter() - begin
        logger.info(done_line(jc, start_step, self.step, seconds, self.checkpointer.enable))

    def train_step(self, data_iterator: Any) -> None:
        if self.metrics_processor.last_logged_step is None:
            self.metrics_processor.start_at(self.step)  # after a resume: the checkpoint's step + 1
        if self._audit is not None:
            self._audit.step_begins(self.step)
        if self._fit is not None:
            # Steps before this launch are decided (released with this step's forward, as every
            # decision is): the packing node must not wait for them beyond that.
            self._fit.skip_to(self.step)
        super().train_step(data_iterator)
        self._steps_done = self.step
        if self._audit is not None:
            self._audit.step_done(self.step)

    def post_dataloading_process(
        self, input_dict: dict[str, Any], labels: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Any]]:
        self.metrics_processor.record(input_dict.pop("wlb_stats", None) or {})
        doc_ids = input_dict.pop("doc_ids", None)
        if doc_ids is not None:
            self.metrics_processor.keep("doc_ids", *doc_ids.tolist())
            if self._audit is not None:
                self._audit.micro_batch(doc_ids.tolist())
        if "doc_lens" not in input_dict:
            # [wlb.advanced] loader = "torchtitan": no boundaries, plain causal attention per row.
            rows, length = input_dict["input"].shape
            self.metrics_processor.flops.documents([length] * rows)
            return super().post_dataloading_process(input_dict, labels)
        inputs, positions = input_dict.pop("input"), input_dict.pop("positions")
        doc_lens = input_dict.pop("doc_lens").cpu()
        self._last_doc_lens = doc_lens.tolist()
        if not self.parallel_dims.cp_enabled:  # under CP: the rank's share, by the plan
            self.metrics_processor.flops.documents(self._last_doc_lens)
        backend = self.job_config.wlb.advanced.attention_backend
        if self.parallel_dims.tp_enabled or self.parallel_dims.cp_enabled:
            inputs, labels, positions, doc_lens = self._pad_for_sharding(
                inputs, labels, positions, doc_lens
            )
        if self.parallel_dims.cp_enabled:
            inputs, labels, positions, meta = self._shard_for_cp(
                inputs, labels, positions, doc_lens.numpy(), backend
            )
        else:
            meta = metadata_from_doc_lens(doc_lens, device=inputs.device, backend=backend)
            if self._fit is not None:
                self._fit.whole_documents(doc_lens)
        extra_kwargs: dict[str, Any] = {"attention_masks": meta, "positions": positions}
        return inputs, labels, dict(input_dict), extra_kwargs

    def _pad_for_sharding(
        self, inputs: Tensor, labels: Tensor, positions: Tensor, doc_lens: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Pad to equal TP sequence shards (``tp * 2 * cp`` tokens) or, under CP alone, to tokens
        in each of the ``2 * cp`` chunks: one more document with ignored labels."""
        pd = self.parallel_dims
        multiple = pd.tp * (2 * pd.cp if pd.cp_enabled else 1)
        pad = -inputs.shape[1] % multiple if pd.tp_enabled else max(0, multiple - inputs.shape[1])
        if pad == 0:
            return inputs, labels, positions, doc_lens
        fill = torch.zeros((1, pad), dtype=inputs.dtype, device=inputs.device)
        inputs = torch.cat([inputs, fill], dim=1)
        labels = torch.cat([labels, torch.full_like(fill, IGNORE_INDEX)], dim=1)
        positions = torch.cat([positions, torch.arange(pad, device=positions.device)[None]], dim=1)
        doc_lens = torch.cat([doc_lens, torch.tensor([pad], dtype=doc_lens.dtype)])
        return inputs, labels, positions, doc_lens

    def _shard_for_cp(
        self,
        inputs: Tensor,
        labels: Tensor,
        positions: Tensor,
        doc_lens: np.ndarray,
        backend: str,
        record: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor, DocumentAttentionMetadata]:
        """Shard one micro-batch over the CP group with its own plan (vectorised, ~1 ms);
        ``record``: into the step's metrics and the online fit (validation does not)."""
        from torchtitan_wlb.cp.adaptive import adaptive_candidates, build_cp_plan
        from torchtitan_wlb.cp.local import build_cp_attention_metadata, shard_tensor

        cp_mesh = self.parallel_dims.get_mesh("cp")
        rank = cp_mesh.get_local_rank()
        wlb = self.job_config.wlb
        coefficients = None  # the online model's, once fitted: adaptive chooses, hybrid balances
        if record and self._fit is not None and wlb.cp_sharding in ("adaptive", "hybrid"):
            coefficients = self._fit.cp_coefficients(self.step)
        plan = build_cp_plan(
            doc_lens,
            cp_mesh.size(),
            wlb.cp_sharding,
            profile=self._cp_profile,
            hybrid_max_len=wlb.advanced.cp_hybrid_max_len,
            bandwidth_gbps=wlb.advanced.cp_bandwidth_gbps,
            candidates=adaptive_candidates(self.parallel_dims.tp_enabled),
            coefficients=coefficients,
        )
        if record:
            self._cp_stats.append((plan.strategy, plan.flops_imbalance()))
            # Padding the sharding added (documents past the micro-batch's own) is not model work.
            self.metrics_processor.flops.cp_share(plan, rank, n_docs=len(self._last_doc_lens))
            self.metrics_processor.keep("micro_batch_cp_strategy", plan.strategy)
        if record and self._fit is not None:
            self._fit.features = cp_fit_features(plan, rank)
            self.metrics_processor.keep("micro_batch_fit_features", list(self._fit.features))
        meta = DocumentAttentionMetadata(
            cu_seqlens=torch.zeros(0, dtype=torch.int32),  # unused: the CP metadata rules
            max_seqlen=0,
            backend=backend,
            cp=build_cp_attention_metadata(plan, rank, cp_mesh, device=inputs.device),
        )
        inputs, labels, positions = (
            shard_tensor(plan, rank, t, dim=1) for t in (inputs, labels, positions)
        )
        return inputs, labels, positions, meta

    def _release_decisions(self) -> None:
        """The online model's decisions so far, to the packing node, as the step's model compute
        starts. Decided at the end of the step before, they would wake the node beside the
        optimizer step and the logging, CPU work on every rank's critical path; during the
        compute the node's CPU time overlaps the model (on a GPU) or the ranks' waits for each
        other (on the CPU runs; docs/cost_model.md, "When the node packs")."""
        if self._fit is not None:
            self._fit.release()

    def forward_backward_step(
        self, *, input_dict: dict[str, Any], labels: Tensor, global_valid_tokens: Tensor
    ) -> Tensor:
        self._micro_batches_done += 1
        if self._pp_runner is None and self._micro_batches_done == 1:
            self._release_decisions()
        start = self._clock.read()
        if self._pp_runner is None:
            # Pure DDP averages the ranks' gradients where FSDP sums them: scaled up here, each
            # rank's gradient is its share of the global token mean again after the average.
            n = self._ddp_ranks
            tokens = global_valid_tokens / n if n > 1 else global_valid_tokens
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=tokens
            )
            loss = loss / n if n > 1 else loss
        else:
            loss = self._pipeline_step(input_dict, labels, global_valid_tokens)
            if loss is None:  # micro-batch collected; the pipeline runs at the step's last one
                self._end_of_micro_batch()
                return torch.zeros((), device=self.device)
        wall, device = self._clock.since(start)
        # Under PP the time covers the whole step's micro-batches (the schedule interleaves them).
        doc_lens = None if self._pp_runner is not None else self._last_doc_lens
        self.metrics_processor.record_micro_batch_time(wall, doc_lens, device_seconds=device)
        if self._pp_runner is None and self._fit is not None:
            self._fit.timed(device)
        if self._micro_batches_done >= self.gradient_accumulation_steps:
            self._flush_cp_stats()  # the step's every micro-batch, not its last alone
        self._end_of_micro_batch()
        return loss

    def _end_of_micro_batch(self) -> None:
        """After the step's last micro-batch (before TorchTitan logs it): the step's fit statistics
        to the online fit, and a refit's outcome to this step's metrics."""
        if self._micro_batches_done < self.gradient_accumulation_steps:
            return
        self._micro_batches_done = 0
        if self._fit is not None and (metrics := self._fit.end_step(self.step)):
            self.metrics_processor.record(metrics)
        if self._compiles is not None:
            figures, line = self._compiles.step_done()
            self.metrics_processor.record(figures)
            if line:
                logger.info(line)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._fit is not None:
            state["wlb_online_cost_model"] = self._fit.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        saved = state_dict.get("wlb_online_cost_model")
        if self._fit is not None and saved:
            self._fit.load_state_dict(saved)

    def close(self) -> None:
        if getattr(self, "_fit", None) is not None:
            self._fit.close()
        super().close()

    def stage_seq_lens(self, inputs: list[Tensor]) -> list[int]:
        """The tokens each micro-batch sends between pipeline stages: this rank's share of its
        ``inputs`` (after CP), split by TP's sequence parallelism, whose blocks hand on outputs
        sharded along the sequence."""
        return [int(x.shape[1]) // self.parallel_dims.tp for x in inputs]

    def _pipeline_step(
        self, input_dict: dict[str, Any], labels: Tensor, global_valid_tokens: Tensor
    ) -> Tensor | None:
        """Collect the step's micro-batches (TorchTitan hands them over one by one), then run them
        through the schedule together; every stage knows their lengths from the same plan."""
        runner = self._pp_runner
        inputs, labels, _, extra_kwargs = self.post_dataloading_process(input_dict, labels)
        self._pp_pending.append((inputs, labels, extra_kwargs))
        if self._last_doc_lens is not None:
            self._pp_doc_lens.append(self._last_doc_lens)
        if len(self._pp_pending) < runner.n_microbatches:
            return None
        pending, self._pp_pending = self._pp_pending, []
        step_doc_lens, self._pp_doc_lens = self._pp_doc_lens, []
        if self._cost_model is not None and step_doc_lens:
            # The predicted bubble, (p - 1) max(c) / (sum(c) + (p - 1) max(c)): docs/tuning.md.
            costs = np.array([self._cost_model.microbatch_cost(d) for d in step_doc_lens])
            stalls = (self.parallel_dims.pp - 1) * costs.max()
            bubble = float(stalls / (costs.sum() + stalls))
            self.metrics_processor.record({"pp_bubble_estimate": bubble})
        losses: list[Tensor] | None = [] if self.pp_has_last_stage else None
        self._release_decisions()
        with self.train_context():
            runner.step(
                [p[0] for p in pending] if self.pp_has_first_stage else None,
                [p[2] for p in pending],
                [p[1] for p in pending] if self.pp_has_last_stage else None,
                seq_lens=self.stage_seq_lens([p[0] for p in pending]),
                global_valid_tokens=global_valid_tokens,
                losses=losses,
            )
        times, whole = runner.last_action_times, len(step_doc_lens) == len(pending)
        if times is not None and self._fit is not None and whole:
            # One row per micro-batch through every stage: what the packer balances.
            self._fit.pipeline_timed(step_doc_lens, times, self.parallel_dims.get_mesh("pp"))
        if times is not None and self.metrics_processor.jsonl_path:
            lens = step_doc_lens if whole else None
            self.metrics_processor.keep("pp_actions", {**times.to_dict(), "doc_lens": lens})
        if losses is not None:
            return torch.sum(torch.stack([loss.detach() for loss in losses])).to(self.device)
        return torch.tensor(-1.0, device=self.device)  # TorchTitan: no loss off the last stage

    def _flush_cp_stats(self) -> None:
        if self._cp_stats:
            chosen, imbalance = (np.asarray(v) for v in zip(*self._cp_stats, strict=True))
            share = {
                f"cp_{s}_share": float(np.mean(chosen == s)) for s in ("per_document", "hybrid")
            }
            self.metrics_processor.record({**share, "cp_flops_imbalance": float(imbalance.mean())})
            self._cp_stats.clear()
