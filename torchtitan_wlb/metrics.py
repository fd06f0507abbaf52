"""TorchTitan's metrics processor with a ``step N/M ... eta`` line whose ``tflops`` and ``mfu`` count
the FLOPs the micro-batches' documents take (:mod:`torchtitan_wlb.mfu`; ``mfu: n/a`` where the
peak is unknown), and a ``wlb`` line of packing and timing figures (docs/getting_started.md)."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
from torchtitan.components.metrics import BaseLogger, MetricsProcessor
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

from torchtitan_wlb import cpu_support
from torchtitan_wlb.mfu import FlopsCounter, attention_flops_per_pair, resolve_peak_flops

MFU_KEY = "mfu(%)"
TFLOPS_KEY = "tflops"
_LISTS = (
    "micro_batch_times_s",
    "micro_batch_device_times_s",
    "doc_ids",
    "micro_batch_doc_lens",
    "pp_actions",  # written only under PP
    "micro_batch_fit_features",  # written only under CP with the online cost model
    "micro_batch_cp_strategy",  # written only under CP: the sharding each micro-batch ran
)
# Left out of a record when empty.
_OPTIONAL_LISTS = ("pp_actions", "micro_batch_fit_features", "micro_batch_cp_strategy")
# The parts of the wlb console line: (the figure that must be there, the part).
_WLB_LINE = (
    ("wlb/step_time_s", "step_time: {wlb/step_time_s:.3f}s"),
    ("wlb/imbalance", "imbalance: {wlb/imbalance:.3f}"),
    ("wlb/max_tokens", "tokens/mb: {wlb/min_tokens:.0f}-{wlb/max_tokens:.0f}"),
    ("wlb/micro_batch_time_max_s", "mb fwd+bwd max/mean: {wlb/micro_batch_time_max_s:.3f}/"
     "{wlb/micro_batch_time_mean_s:.3f}s"),
    ("wlb/pack_ms", "pack: {wlb/pack_ms:.2f}ms"),
)  # fmt: skip


class _MetricsTap(BaseLogger):
    """Passes TorchTitan's per-step metrics on to its loggers (TensorBoard, W&B) with ``figures``
    (this package's ``tflops`` and ``mfu(%)``, where known) in place of TorchTitan's, and keeps
    the last dict for the console line."""

    def __init__(self, inner: BaseLogger):
        self.inner = inner
        self.figures: dict[str, float] | None = None  # set during a training step's log call
        self.last: dict[str, Any] = {}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.figures is not None:
            dropped = (TFLOPS_KEY, MFU_KEY)
            metrics = {k: v for k, v in metrics.items() if k not in dropped} | self.figures
        self.last = metrics
        self.inner.log(metrics, step)

    def close(self) -> None:
        self.inner.close()


def format_duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h04m``, ``3d04h``: short enough for a step line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def eta_seconds(step: int, total: int, step_times: list[float]) -> float:
    """Time left after ``step`` of ``total``: the steps left times the mean of ``step_times``
    (this run's step times, the first left out when there are others: it includes warm-up)."""
    times = step_times[1:] if len(step_times) > 1 else step_times
    if not times or step >= total:
        return 0.0
    return (total - step) * sum(times) / len(times)


def steps_since_last_log(step: int, last_logged: int | None, log_freq: int) -> int:
    """How many steps the interval ending at ``step`` covers, since ``last_logged`` (or the step a
    resumed process started after); None: TorchTitan's schedule (step 1, then every log_freq)."""
    if last_logged is None:
        last_logged = 0 if step == 1 else step - log_freq
    return max(1, step - last_logged)


class WLBMetricsProcessor(MetricsProcessor):
    """MetricsProcessor that also logs WLB packing and per-micro-batch timing figures."""

    def __init__(self, job_config: JobConfig, parallel_dims: Any, model_args: Any = None):
        """Built as ``TrainSpec.build_metrics_processor_fn``; without ``model_args`` the step's
        FLOPs are unknown (``tflops: n/a``)."""
        super().__init__(job_config, parallel_dims)
        self.wlb_metrics: dict[str, float] = {}
        # The lists of the JSONL record, gathered over the steps since the last logged one.
        self.lists: dict[str, list[Any]] = {k: [] for k in _LISTS}
        self.device_clock = "wall"  # the trainer's DeviceClock kind (torchtitan_wlb.device_clock)
        self.last_logged_step: int | None = None
        self.jsonl_path: str | None = None
        self.logger = self._tap = _MetricsTap(self.logger)
        self.run_step_times: list[float] = []
        wlb = getattr(job_config, "wlb", None)
        # What the micro-batches computed; num_flops_per_token (TorchTitan sets it from the model
        # arguments) is the dense 6 N alone: llama3_wlb's arguments leave attention to this count.
        self.flops = FlopsCounter(shards=parallel_dims.tp * parallel_dims.pp)
        self.flops_per_pair = None if model_args is None else attention_flops_per_pair(model_args)
        cpu = cpu_support.is_active()
        override = wlb.advanced.peak_tflops if wlb is not None else 0.0
        device_name = self.device_memory_monitor.device_name
        self.peak_flops, line = resolve_peak_flops(override, device_name, cpu)
        logger.log(logging.WARNING if self.peak_flops is None and not cpu else logging.INFO, line)
        if wlb is not None and wlb.advanced.metrics_jsonl:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            folder = os.path.join(job_config.job.dump_folder, "wlb_metrics")
            os.makedirs(folder, exist_ok=True)
            self.jsonl_path = os.path.join(folder, f"rank_{rank}.jsonl")

    def start_at(self, step: int) -> None:
        """Start the first logged interval at ``step``: it covers no model building or loading."""
        self.last_logged_step = step - 1
        self.time_last_log = time.perf_counter()

    def record(self, metrics: dict[str, Any]) -> None:
        """Record scalar figures (non-numeric values and lists are summarised or skipped)."""
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.wlb_metrics[f"wlb/{key}"] = float(value)
            elif isinstance(value, (list, tuple)) and all(
                isinstance(v, (int, float)) for v in value
            ):
                for i, v in enumerate(value):  # e.g. outlier queue depths: one per queue
                    self.wlb_metrics[f"wlb/{key}_{i}"] = float(v)

    def keep(self, key: str, *values: Any) -> None:
        """Append ``values`` to the JSONL record's list ``key`` (trained document ids, CP fit
        features, pipeline action times); dropped when the JSONL log is off."""
        if self.jsonl_path is not None:
            self.lists[key].extend(values)

    def record_micro_batch_time(
        self, seconds: float, doc_lens: list[int] | None, device_seconds: float
    ) -> None:
        """A micro-batch's forward+backward wall and device seconds and, for calibration, its documents."""
        self.lists["micro_batch_times_s"].append(seconds)
        self.lists["micro_batch_device_times_s"].append(device_seconds)
        if doc_lens is not None and self.jsonl_path is not None:
            self.lists["micro_batch_doc_lens"].append(doc_lens)

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        log_freq = self.job_config.metrics.log_freq
        interval = steps_since_last_log(step, self.last_logged_step, log_freq)
        elapsed = time.perf_counter() - self.time_last_log
        step_time = elapsed / interval
        self.last_logged_step = step
        extra = {**(extra_metrics or {}), **self.wlb_metrics, "wlb/step_time_s": step_time}
        self._tap.figures = self._flops_figures(elapsed, extra)
        if "wlb/step" in extra:  # the packer's plan index counts from 0; the step from 1
            extra["wlb/step"] = step
        if times := self.lists["micro_batch_times_s"]:
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
                "peak_active_gib": mem.max_active_gib,
                "device_clock": self.device_clock,
                **{k: v for k, v in self.lists.items() if v or k not in _OPTIONAL_LISTS},
                "doc_ids": sorted(self.lists["doc_ids"]),
                **{k: v for k, v in extra.items() if isinstance(v, (int, float))},
            }
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")

        def warnings_only(record: logging.LogRecord) -> bool:
            return record.levelno > logging.INFO

        # TorchTitan's step line is muted; ours, with N/M and eta, follows.
        logger.addFilter(warnings_only)
        try:
            super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        finally:
            logger.removeFilter(warnings_only)
            self._tap.figures = None
            self.flops.reset()
        self.run_step_times.append(step_time)
        self._log_step_line(step, self._tap.last)
        figures = {"wlb/min_tokens": 0, **extra}
        parts = [part.format_map(figures) for key, part in _WLB_LINE if key in figures]
        logger.info("wlb  " + "  ".join(parts))
        self.wlb_metrics.clear()
        self.lists = {k: [] for k in _LISTS}

    def _flops_figures(self, seconds: float, extra: dict[str, Any]) -> dict[str, float]:
        """``tflops`` and, where the peak is known, ``mfu(%)`` of the FLOPs counted over the
        ``seconds`` since the last log; the FLOPs themselves go to ``extra`` as
        ``wlb/model_flops``. Empty without the model's arguments (nothing to count with)."""
        if self.flops_per_pair is None:
            return {}
        flops = self.flops.flops(self.num_flops_per_token, self.flops_per_pair)
        extra["wlb/model_flops"] = flops
        figures = {TFLOPS_KEY: flops / seconds / 1e12}
        if self.peak_flops is not None:
            figures[MFU_KEY] = 100 * flops / seconds / self.peak_flops
        return figures

    def _log_step_line(self, step: int, metrics: dict[str, Any]) -> None:
        """TorchTitan's step line with ``step N/M``, this package's ``tflops`` and ``mfu`` (``n/a``
        where unknown), and ``eta``."""
        c = self.color
        total = self.job_config.training.steps
        mfu = f"{metrics[MFU_KEY]:.2f}%" if MFU_KEY in metrics else "n/a"
        tflops = f"{metrics[TFLOPS_KEY]:,.2f}" if TFLOPS_KEY in metrics else "n/a"
        eta = format_duration(eta_seconds(step, total, self.run_step_times))
        logger.info(
            f"{c.red}step: {step:2}/{total}  "
            f"{c.green}loss: {metrics['loss_metrics/global_avg_loss']:8.5f}  "
            f"{c.orange}grad_norm: {metrics['grad_norm']:7.4f}  "
            f"{c.turquoise}memory: {metrics['memory/max_reserved(GiB)']:5.2f}GiB"
            f"({metrics['memory/max_reserved(%)']:.2f}%)  "
            f"{c.blue}tps: {round(metrics['throughput(tps)']):,}  "
            f"{c.cyan}tflops: {tflops}  "
            f"{c.magenta}mfu: {mfu}  "
            f"{c.yellow}eta: {eta}{c.reset}"
        )
