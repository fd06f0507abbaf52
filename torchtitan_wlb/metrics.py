"""TorchTitan's metrics processor plus the per-step figures WLB is judged by.

TorchTitan logs loss, throughput, MFU and memory. On top, every logged step carries (to stdout and
to TensorBoard / W&B under ``wlb/``):

  - the packer's statistics for the step: imbalance degree (max / mean predicted micro-batch
    workload in the global batch), tokens per micro-batch (min / max), token-weighted mean and max
    delay in steps, outlier queue depths, packing time;
  - the measured forward+backward time of each of this rank's micro-batches (max / mean), and the
    step time.

With ``[wlb] metrics_jsonl = true`` every rank also appends each logged step, at full precision,
to ``<dump_folder>/wlb_metrics/rank_<rank>.jsonl`` (loss, grad norm, step time, micro-batch times,
peak memory, packing statistics): the end-to-end benchmark and the resume tests read it. Under
pipeline parallelism ``micro_batch_times_s`` holds the whole pipeline step (the schedule interleaves
the micro-batches) and ``pp_actions`` the per-action times: one entry per pipeline step,
``{"stages": [stage index, ...], "fwd_s": [[s per micro-batch] per stage], "bwd_s": [[...]],
"doc_lens": [[document lengths] per micro-batch]}``.

The trainer records figures with :meth:`WLBMetricsProcessor.record`; they are flushed at the next
``log`` call, so steps that are not logged (``metrics.log_freq``) cost nothing beyond a dict update.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger


def steps_since_last_log(step: int, last_logged: int | None, log_freq: int) -> int:
    """How many steps the interval ending at ``step`` covers (the step time divides by it).

    ``last_logged``: the last step logged by this process, or the step it started after (a resumed
    run's checkpoint step); None falls back to TorchTitan's schedule (step 1, then every
    ``log_freq`` steps). After a resume from step 4 with ``log_freq = 5`` the first log, at step
    5, covers one step, not five.
    """
    if last_logged is None:
        last_logged = 0 if step == 1 else step - log_freq
    return max(1, step - last_logged)


class WLBMetricsProcessor(MetricsProcessor):
    """MetricsProcessor that also logs WLB packing and per-micro-batch timing figures."""

    def __init__(self, job_config: JobConfig, parallel_dims: Any, tag: str | None = None):
        super().__init__(job_config, parallel_dims, tag)
        self.wlb_metrics: dict[str, float] = {}
        self.micro_batch_times: list[float] = []
        self.doc_ids: list[int] = []
        self.micro_batch_doc_lens: list[list[int]] = []
        self.pp_actions: list[dict[str, Any]] = []
        self.last_logged_step: int | None = None
        self.jsonl_path: str | None = None
        wlb = getattr(job_config, "wlb", None)
        if wlb is not None and wlb.metrics_jsonl:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            folder = os.path.join(job_config.job.dump_folder, "wlb_metrics")
            os.makedirs(folder, exist_ok=True)
            self.jsonl_path = os.path.join(folder, f"rank_{rank}.jsonl")

    def start_at(self, step: int) -> None:
        """The first step this process trains (after a resume: the checkpoint's step + 1). The
        first logged interval starts here, not at start-up: it covers the steps since, and no
        model building or checkpoint loading."""
        self.last_logged_step = step - 1
        self.time_last_log = time.perf_counter()

    def record(self, metrics: dict[str, Any]) -> None:
        """Record scalar figures (non-numeric values and lists are summarised or skipped)."""
        for key, value in metrics.items():
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, (int, float)):
                self.wlb_metrics[f"wlb/{key}"] = float(value)
            elif (
                isinstance(value, (list, tuple))
                and value
                and all(isinstance(v, (int, float)) for v in value)
            ):
                # e.g. outlier queue depths: one scalar per queue
                for i, v in enumerate(value):
                    self.wlb_metrics[f"wlb/{key}_{i}"] = float(v)

    def record_doc_ids(self, doc_ids: torch.Tensor) -> None:
        """Documents this rank trained on (kept only when the JSONL log is on: an audit trail)."""
        if self.jsonl_path is not None:
            self.doc_ids.extend(doc_ids.tolist())

    def record_micro_batch_time(self, seconds: float, doc_lens: list[int] | None = None) -> None:
        """A micro-batch's measured forward+backward time and, for calibration, its documents."""
        self.micro_batch_times.append(seconds)
        if doc_lens is not None and self.jsonl_path is not None:
            self.micro_batch_doc_lens.append(doc_lens)

    def record_pipeline_actions(
        self, actions: dict[str, Any], doc_lens: list[list[int]] | None = None
    ) -> None:
        """One pipeline step's per-action forward / backward times on this rank (PP only)."""
        if self.jsonl_path is not None:
            self.pp_actions.append({**actions, "doc_lens": doc_lens})

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        now = time.perf_counter()
        interval = steps_since_last_log(
            step, self.last_logged_step, self.job_config.metrics.log_freq
        )
        step_time = (now - self.time_last_log) / interval
        self.last_logged_step = step
        extra = dict(extra_metrics or {})
        extra.update(self.wlb_metrics)
        extra["wlb/step_time_s"] = step_time
        if self.micro_batch_times:
            times = self.micro_batch_times
            extra["wlb/micro_batch_time_max_s"] = max(times)
            extra["wlb/micro_batch_time_mean_s"] = sum(times) / len(times)
        if self.jsonl_path is not None:
            mem = self.device_memory_monitor.get_peak_stats()
            record = {
                "step": step,
                "loss": float(global_avg_loss),
                "max_loss": float(global_max_loss),
                "grad_norm": float(grad_norm),
                "peak_mem_gib": mem.max_reserved_gib,
                "micro_batch_times_s": list(self.micro_batch_times),
                "doc_ids": sorted(self.doc_ids),
                "micro_batch_doc_lens": list(self.micro_batch_doc_lens),
                **({"pp_actions": list(self.pp_actions)} if self.pp_actions else {}),
                **{k: v for k, v in extra.items() if isinstance(v, (int, float))},
            }
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        parts = [f"step_time: {step_time:.3f}s"]
        if "wlb/imbalance" in extra:
            parts.append(f"imbalance: {extra['wlb/imbalance']:.3f}")
        if "wlb/max_tokens" in extra:
            parts.append(
                f"tokens/mb: {extra.get('wlb/min_tokens', 0):.0f}-{extra['wlb/max_tokens']:.0f}"
            )
        if "wlb/micro_batch_time_max_s" in extra:
            parts.append(
                f"mb fwd+bwd max/mean: {extra['wlb/micro_batch_time_max_s']:.3f}/"
                f"{extra['wlb/micro_batch_time_mean_s']:.3f}s"
            )
        if "wlb/pack_ms" in extra:
            parts.append(f"pack: {extra['wlb/pack_ms']:.2f}ms")
        logger.info("wlb  " + "  ".join(parts))
        self.wlb_metrics.clear()
        self.micro_batch_times.clear()
        self.doc_ids.clear()
        self.micro_batch_doc_lens.clear()
        self.pp_actions.clear()


def build_wlb_metrics_processor(
    job_config: JobConfig, parallel_dims: Any, model_args: Any = None, tag: str | None = None
) -> WLBMetricsProcessor:
    """TrainSpec.build_metrics_processor_fn of ``llama3_wlb``."""
    return WLBMetricsProcessor(job_config, parallel_dims, tag)
