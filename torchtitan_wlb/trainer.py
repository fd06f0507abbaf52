"""``WLBTrainer``: TorchTitan's Trainer with document metadata, per-micro-batch CP plans, varlen
PP, timing for the online cost model, the audit log and start/end lines (docs/architecture.md)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from torchtitan_wlb import resume
from torchtitan_wlb.attention.metadata import DocumentAttentionMetadata, metadata_from_doc_lens
from torchtitan_wlb.audit_log import AuditLog
from torchtitan_wlb.cost_fit import FitStats, OnlineFitter
from torchtitan_wlb.data.dataloader import micro_batches_per_step
from torchtitan_wlb.data.sources import BUILTIN_NAME
from torchtitan_wlb.device_clock import DeviceClock
from torchtitan_wlb.models.llama3_wlb import cost_model_for_job
from torchtitan_wlb.validate import check_job_config

if TYPE_CHECKING:
    from torchtitan_wlb.cp.plan import CPPlan


def nothing_to_do(job_config: Any) -> str | None:
    """One line when the job's checkpoint already reached ``training.steps``, else None
    (TorchTitan would build the model, load the checkpoint, train zero steps and exit silently)."""
    step, total = resume.resume_step(job_config), job_config.training.steps
    if step < 0 or step < total:
        return None
    return (
        f"nothing to do: the checkpoint in {resume.checkpoint_folder(job_config)} is at step "
        f"{step} >= training.steps = {total}; train further with --training.steps "
        f"{step + total}, or start afresh in another --job.dump_folder"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _multi_process() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


@dataclass(frozen=True)
class FitReduction:
    """How a rank's online-fit statistics become the sum every rank holds (chosen once, at init)."""

    rows_here: bool
    """Whether this rank adds fit rows (under PP with TP: the first stage's ranks alone)."""
    exchange: bool
    """Whether the step's statistics are summed over ``group``: False where this rank already
    holds every row (one pipeline, after the stages exchanged their action times)."""
    group: Any = None
    """The process group of the sum; None: the world."""


def sum_over_group(values: np.ndarray, group: Any, device: torch.device) -> np.ndarray:
    """``values`` summed over ``group`` in rank order: bitwise the same on every rank (an
    all-reduce need not be)."""
    mine = torch.from_numpy(np.ascontiguousarray(values, np.float64)).to(device)
    gathered = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).cpu().numpy().sum(axis=0)


def cp_fit_features(plan: CPPlan, rank: int) -> tuple[float, float, float]:
    """The online fit's terms for ``rank`` under ``plan``: ``Σd²`` times its share of the causal
    attention pairs, its local and its all-gathered tokens (docs/cost_model.md)."""
    pairs = plan.rank_attention_pairs()
    d = plan.doc_lens.astype(np.float64)
    share = float(pairs[rank] / pairs.sum()) if pairs.sum() > 0 else 1.0 / pairs.size
    gathered = int(plan.gather_lens[rank])
    return float(d @ d) * share, float(int(plan.local_lens[rank]) - gathered), float(gathered)


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
        wlb = job_config.wlb
        self._pp_pending: list[tuple[Tensor, Tensor, dict[str, Any]]] = []
        self._pp_runner = None
        if self.parallel_dims.pp_enabled:
            from torchtitan_wlb.pipeline.varlen import VarlenPipelineRunner

            timed = wlb.metrics_jsonl or wlb.cost_model == "online"
            self._pp_runner = VarlenPipelineRunner(self.pp_schedule, time_actions=timed)
        self._cp_profile = None
        if self.parallel_dims.cp_enabled and wlb.cp_sharding == "adaptive":
            from torchtitan_wlb.cp.profile import packaged_profile_for, resolve_profile

            self._cp_profile = resolve_profile(wlb.cp_profile or None)
            if self.device.type == "cuda" and not wlb.cp_profile:
                name = torch.cuda.get_device_name(self.device)
                if (shipped := packaged_profile_for(name)) is not None:
                    self._cp_profile = shipped
                    logger.info(f"adaptive CP sharding: the shipped profile of {shipped.device}")
                else:
                    logger.warning(
                        f"adaptive CP sharding is choosing with the packaged CPU throughput "
                        f"profile: none is shipped for {name}; measure one (python -m "
                        "torchtitan_wlb.tools.cp_profile --device cuda --out FILE) and set "
                        "[wlb] cp_profile = FILE"
                    )
        self._cp_stats: list[tuple[str, float]] = []
        self._last_doc_lens: list[int] | None = None
        self._pp_doc_lens: list[list[int]] = []
        self._cost_model = cost_model_for_job(job_config) if wlb.loader == "documents" else None
        schedule = getattr(self.dataloader, "cost_schedule", None)
        self._fitter = None
        if schedule is not None:
            self._fitter = OnlineFitter(schedule, whole_max_len=self._whole_max_len())
        self._fit_reduction = self._plan_fit_reduction()
        self._clock = DeviceClock(self.device)
        self.metrics_processor.device_clock = self._clock.kind
        # The online fit's rows: (Σd², local tokens, gathered tokens, seconds) per micro-batch.
        self._fit_rows: list[tuple[float, float, float, float]] = []
        self._fit_features: tuple[float, float, float] | None = None
        self._micro_batches_done = 0
        self._audit = self._build_audit_log()
        self._last_completed_step = 0
        self._guard_checkpoint_load()

    def train(self) -> None:
        """TorchTitan's training loop, opened and closed by what the run does and did."""
        jc = self.job_config
        # Before TorchTitan loads anything: a damaged or mismatched checkpoint is one line.
        resume.check_resume(jc, getattr(self.dataloader, "fingerprint", None))
        start_step = resume.resume_step(jc)
        for line in self._run_summary(start_step):
            logger.info(line)
        begin = time.perf_counter()
        super().train()
        if self._audit is not None and self._audit.started:
            # The closing record. TorchTitan advances the step before running it: a step that
            # found no data left was canceled, and the data has ended.
            done, (pending, documents) = self._last_completed_step, self.dataloader.accounting()
            ended = done < self.step
            reason = "end of data" if ended else "steps"
            self._audit.end(done, reason, pending, documents=documents if ended else None)
        ck = self.checkpointer
        if ck.enable and not ck.load_only and self.step == jc.training.steps:
            # TorchTitan purges after interval saves only; the last step's save is one more.
            ck._purge_stale_checkpoints()
        trained = self.step - max(start_step, 0)
        latest = resume.latest_checkpoint_step(resume.checkpoint_folder(jc)) if ck.enable else -1
        where = f"latest checkpoint {resume.checkpoint_folder(jc)}/step-{latest}"
        where = where if latest >= 0 else "no checkpoint written"
        logger.info(
            f"done: trained {_count(trained, 'step')} in {time.perf_counter() - begin:.0f}s, now at "
            f"step {self.step}/{jc.training.steps}; {where}"
        )

    def _run_summary(self, start_step: int) -> list[str]:
        """The start-up lines: layout, model, data, checkpoints, where training starts."""
        jc, wlb, pd = self.job_config, self.job_config.wlb, self.parallel_dims
        n = micro_batches_per_step(jc, pd.dp_replicate * pd.dp_shard)
        degrees = {k: getattr(pd, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}
        shown = " x ".join(f"{k} {v}" for k, v in degrees.items() if v > 1) or "no parallelism"
        backend = "gloo" if self.device.type == "cpu" else "nccl"
        backend = jc.comm.mode if jc.comm.mode in resume.FAKE_COMM_MODES else backend
        lines = [
            f"run: {_count(pd.world_size, self.device.type + ' rank')} over {backend}: {shown}; "
            f"{jc.model.name} {jc.model.flavor}; {_count(jc.training.steps, 'step')}",
        ]
        data, seq_len = f"data: dataset {jc.training.dataset!r}", jc.training.seq_len
        if wlb.loader != "documents":
            data += " through TorchTitan's loader (no packing)"
        else:
            data += " (built-in corpus)" if jc.training.dataset == BUILTIN_NAME else ""
            data += f" at {jc.training.dataset_path}" if jc.training.dataset_path else ""
            data += f"; packing {wlb.packing!r}, {n} micro-batches per step of up to "
            data += f"{wlb.micro_batch_max_len or seq_len:,} tokens (context {seq_len:,})"
            data += f"; CP sharding {wlb.cp_sharding!r}" if pd.cp_enabled else ""
        lines.append(data)
        ck, folder = jc.checkpoint, resume.checkpoint_folder(jc)
        every = "every step" if ck.interval == 1 else f"every {ck.interval} steps"
        keep = f", keeping the latest {ck.keep_latest_k}" if ck.keep_latest_k > 0 else ""
        status = f"{folder}, {every} and at the last{keep}" if ck.enable else "off"
        lines.append(f"checkpoints: {status}")
        if start_step == 0:  # a seed checkpoint: weights only, training starts at step 1
            lines.append(f"starting at step 1 from the model-only checkpoint {folder}/step-0")
        elif start_step > 0:
            lines.append(f"resuming from step {start_step} ({folder}/step-{start_step})")
        else:
            where = f" (no checkpoint in {folder})" if ck.enable else ""
            lines.append(f"starting at step 1{where}")
        return lines

    def post_dataloading_process(
        self, input_dict: dict[str, Any], labels: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Any]]:
        self.metrics_processor.record(input_dict.pop("wlb_stats", None) or {})
        doc_ids = input_dict.pop("doc_ids", None)
        if doc_ids is not None:
            self.metrics_processor.keep("doc_ids", *doc_ids.tolist())
            if self._audit is not None:
                self._audit.add_micro_batch(doc_ids.tolist())
        if "doc_lens" not in input_dict:
            # [wlb] loader = "torchtitan": no boundaries, plain causal attention per row.
            return super().post_dataloading_process(input_dict, labels)
        inputs, positions = input_dict.pop("input"), input_dict.pop("positions")
        doc_lens = input_dict.pop("doc_lens").cpu()
        self._last_doc_lens = doc_lens.tolist()
        backend = self.job_config.wlb.attention_backend
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
            if self._fitter is not None:
                d = doc_lens.to(torch.float64)
                self._fit_features = (float((d * d).sum()), float(d.sum()), 0.0)
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

    def _plan_fit_reduction(self) -> FitReduction:
        """Whether this rank adds fit rows, and the group the step's statistics are summed over,
        so that every rank holds the same sum.

        Without PP every rank timed its own micro-batches (or CP shards): the world. Under PP the
        stages exchange their action times first, after which every stage holds its pipeline's
        rows, bit for bit; the sum then runs over one stage's ranks, the pipelines (``loss``:
        batch x cp), and not at all with one pipeline: one collective a step, not two (each is
        a synchronisation of every rank; about 1.5 ms a step on the CPU runs). With TP the ranks
        of a stage time its micro-batches apart, so the world sums the first stage's rows."""
        pd = self.parallel_dims
        if not pd.pp_enabled:
            return FitReduction(rows_here=True, exchange=True)
        if pd.tp_enabled:
            return FitReduction(rows_here=pd.get_mesh("pp").get_local_rank() == 0, exchange=True)
        pipelines = pd.get_optional_mesh("loss")
        if pipelines is None:
            return FitReduction(rows_here=True, exchange=False)
        return FitReduction(rows_here=True, exchange=True, group=pipelines.get_group())

    def _whole_max_len(self) -> int:
        """Under hybrid or adaptive CP, the length up to which the plan keeps a document whole
        (hybrid's threshold or its floor): the online model prices longer ones as gathered."""
        wlb, pd = self.job_config.wlb, self.parallel_dims
        if not pd.cp_enabled or wlb.cp_sharding not in ("hybrid", "adaptive"):
            return 0
        from torchtitan_wlb.cp.plan import default_hybrid_max_len

        return wlb.cp_hybrid_max_len or default_hybrid_max_len(pd.cp)

    def _fitted_cp_coefficients(self) -> tuple[float, float, float] | None:
        """The online model packing this step, as CP's per-rank ``(a, b, g)`` once a fit has
        priced local and gathered tokens apart (adaptive sharding chooses by it, hybrid balances
        its ranks by it): the same on every rank (all-reduced fit, adopted at a step fixed in
        advance), so every CP rank builds the same plan."""
        if self._fitter is None or self.job_config.wlb.cp_sharding not in ("adaptive", "hybrid"):
            return None
        model = self._fitter.schedule.model_for_step(self.step)
        if model.gathered_coef is None:
            return None
        return model.attn_coef, model.linear_coef, model.gathered_coef

    def _shard_for_cp(
        self, inputs: Tensor, labels: Tensor, positions: Tensor, doc_lens: np.ndarray, backend: str
    ) -> tuple[Tensor, Tensor, Tensor, DocumentAttentionMetadata]:
        """Shard one micro-batch over the CP group with its own plan (vectorised, ~1 ms)."""
        from torchtitan_wlb.cp.adaptive import adaptive_candidates, build_cp_plan
        from torchtitan_wlb.cp.local import build_cp_attention_metadata, shard_tensor

        cp_mesh = self.parallel_dims.get_mesh("cp")
        rank = cp_mesh.get_local_rank()
        wlb = self.job_config.wlb
        plan = build_cp_plan(
            doc_lens,
            cp_mesh.size(),
            wlb.cp_sharding,
            profile=self._cp_profile,
            hybrid_max_len=wlb.cp_hybrid_max_len,
            bandwidth_gbps=wlb.cp_bandwidth_gbps,
            candidates=adaptive_candidates(self.parallel_dims.tp_enabled),
            coefficients=self._fitted_cp_coefficients(),
        )
        self._cp_stats.append((plan.strategy, plan.flops_imbalance()))
        self.metrics_processor.keep("micro_batch_cp_strategy", plan.strategy)
        if self._fitter is not None:
            self._fit_features = cp_fit_features(plan, rank)
            self.metrics_processor.keep("micro_batch_fit_features", list(self._fit_features))
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
        if self._fitter is not None:
            self._fitter.schedule.release()

    def forward_backward_step(
        self, *, input_dict: dict[str, Any], labels: Tensor, global_valid_tokens: Tensor
    ) -> Tensor:
        self._micro_batches_done += 1
        if self._pp_runner is None and self._micro_batches_done == 1:
            self._release_decisions()
        start = self._clock.read()
        if self._pp_runner is None:
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        else:
            loss = self._pipeline_step(input_dict, labels, global_valid_tokens)
            if loss is None:  # micro-batch collected; the pipeline runs at the step's last one
                self._maybe_refit()
                return torch.zeros((), device=self.device)
        wall, device = self._clock.since(start)
        # Under PP the time covers the whole step's micro-batches (the schedule interleaves them).
        doc_lens = None if self._pp_runner is not None else self._last_doc_lens
        self.metrics_processor.record_micro_batch_time(wall, doc_lens, device_seconds=device)
        if self._pp_runner is None and self._fit_features is not None:
            self._fit_rows.append((*self._fit_features, device))
        self._fit_features = None
        if self._micro_batches_done >= self.gradient_accumulation_steps:
            self._flush_cp_stats()  # the step's every micro-batch, not its last alone
        self._maybe_refit()
        return loss

    def _maybe_refit(self) -> None:
        """After the step's last micro-batch (before TorchTitan logs it): the step's fit statistics
        from every rank to the fitter, and a refit's outcome to this step's metrics."""
        if self._micro_batches_done < self.gradient_accumulation_steps:
            return
        self._micro_batches_done = 0
        if self._fitter is None:
            return
        rows, self._fit_rows = self._fit_rows, []
        rows = [r for r in rows if r[3] > 0]  # a measured time (the device clock may read 0)
        sq, lin, gathered, seconds = np.asarray(rows, np.float64).reshape(-1, 4).T
        local = FitStats.from_samples(sq, lin, seconds, sum_gathered=gathered)
        vector = local.to_vector()
        real = self.job_config.comm.mode not in resume.FAKE_COMM_MODES and _multi_process()
        if real and self._fit_reduction.exchange:  # alike on every rank
            vector = sum_over_group(vector, self._fit_reduction.group, self.device)
        # Released when the next step's forward starts (_release_decisions), not now.
        record = self._fitter.observe(self.step, vector, release=False)
        if record is None:
            return
        c = record["candidate"]
        coef = "none"
        if c:
            g, share = c["g"], c["gathered_share"]
            g = "" if g is None else f" g={g:.4g} (gathered share {share:.2f})"
            coef = f"a={c['a']:.4g} b={c['b']:.4g}{g} c={c['c']:.4g}"
        verdict = f"adopted for step {record['effective_step']} on" if record["adopted"] else "kept"
        logger.info(
            f"online cost model refit after step {self.step}: {coef} (held-out RMS relative error "
            f"{record['candidate_error']:.4f} vs {record['incumbent_error']:.4f} for the model in "
            f"use); {verdict}" + ("" if record["adopted"] else f": {record['reason']}")
        )
        # effective_step is None, and so not recorded, unless the refit is adopted.
        keys = ("adopted", "incumbent_error", "effective_step")
        metrics = {f"cost_refit_{k}": record[k] for k in keys}
        metrics["cost_refit_error"] = record["candidate_error"]
        metrics.update({f"cost_refit_{k}": c[k] for k in "abc" if c})
        if c and c["g"] is not None:
            metrics.update(cost_refit_g=c["g"], cost_refit_gathered_share=c["gathered_share"])
        self.metrics_processor.record(metrics)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._fitter is not None:
            state["wlb_online_cost_model"] = json.dumps(self._fitter.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        saved = state_dict.get("wlb_online_cost_model")
        if self._fitter is not None and saved:
            self._fitter.load_state_dict(json.loads(saved))

    def close(self) -> None:
        if getattr(self, "_fitter", None) is not None:
            self._fitter.schedule.close()  # a packing thread waiting for a decision: let it go
        super().close()

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
                seq_lens=[int(p[0].shape[1]) for p in pending],
                global_valid_tokens=global_valid_tokens,
                losses=losses,
            )
        times, whole = runner.last_action_times, len(step_doc_lens) == len(pending)
        if times is not None and self._fitter is not None and whole:
            per_mb = np.sum(times.fwd_device_s, axis=0) + np.sum(times.bwd_device_s, axis=0)
            # One row per micro-batch through every stage: what the packer balances.
            pp_mesh = self.parallel_dims.get_mesh("pp")
            if self.job_config.comm.mode not in resume.FAKE_COMM_MODES and _multi_process():
                per_mb = sum_over_group(per_mb, pp_mesh.get_group(), self.device)
            if self._fit_reduction.rows_here:  # each micro-batch once a pipeline in the sum
                for lens, seconds in zip(step_doc_lens, per_mb.tolist(), strict=True):
                    d = np.asarray(lens, np.float64)
                    self._fit_rows.append((float(d @ d), float(d.sum()), 0.0, seconds))
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

    def _build_audit_log(self) -> AuditLog | None:
        """Every rank's audit log, for the document loader on real process groups; and a hook
        on the checkpointer that records each checkpoint once it is complete on disk."""
        loader = self.dataloader
        if self.job_config.comm.mode != "default" or not hasattr(loader, "accounting"):
            return None
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        audit = AuditLog(
            self.job_config.job.dump_folder, rank, loader.dp_rank, loader.dp_world_size
        )
        save, ck = self.checkpointer.save, self.checkpointer

        def save_and_record(curr_step: int, last_step: bool = False) -> None:
            save(curr_step, last_step=last_step)
            # TorchTitan sets up no folder when checkpoints are off.
            written = ck.enable and os.path.isfile(f"{ck.folder}/step-{curr_step}/.metadata")
            if audit.started and written:
                audit.checkpoint(curr_step, pending=loader.accounting()[0])

        ck.save = save_and_record
        return audit

    def train_step(self, data_iterator: Any) -> None:
        if self.metrics_processor.last_logged_step is None:
            self.metrics_processor.start_at(self.step)  # after a resume: the checkpoint's step + 1
        if self._audit is not None:
            if not self._audit.started:
                # One launch id for all ranks (rank 0's), written before the first step: a launch
                # killed during it still supersedes the steps it would re-train.
                launch = [f"{time.time_ns()}-{os.getpid()}"]
                if _multi_process():
                    torch.distributed.broadcast_object_list(launch, src=0)
                launch_time = int(launch[0].split("-")[0]) / 1e9
                self._audit.start(launch[0], launch_time, resumed_from=self.step - 1)
            self._audit.begin_step()
        self._last_completed_step = self.step - 1
        if self._fitter is not None:
            # Steps before this launch are decided (released with this step's forward, as every
            # decision is): the packing node must not wait for them beyond that.
            self._fitter.schedule.decide(self.step - 1, None, release=False)
        super().train_step(data_iterator)
        self._last_completed_step = self.step
        if self._audit is not None:
            self._audit.step_done(self.step)

    def _guard_checkpoint_load(self) -> None:
        """Whatever still goes wrong inside TorchTitan's load (a damaged tensor shard, a model
        of another shape) ends as one line naming the checkpoint, not a traceback per rank."""
        load = self.checkpointer.dcp_load

        def checked_load(state_dict: Any, checkpoint_id: str, *args: Any, **kwargs: Any) -> None:
            try:
                load(state_dict, checkpoint_id, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 -- reported with the checkpoint's name
                first = (str(e).strip().splitlines() or [""])[0][:300]
                raise resume.CheckpointError(
                    f"loading checkpoint {checkpoint_id} failed ({type(e).__name__}: {first}); "
                    "the process stops before training on a partly loaded state"
                ) from e

        self.checkpointer.dcp_load = checked_load
