"""Start-up checks of a job config, run before any process group or model is created.

TorchTitan's own checks are assertions deep inside the trainer. A user who asks for a layout that
cannot work should instead get one line naming the fields and the accepted values, and a non-zero
exit, before a single collective is issued. :func:`check_job_config` is that line.
"""

from __future__ import annotations

import os
from typing import Any

from torchtitan_wlb.config import ConfigError
from torchtitan_wlb.data.sources import TextSource
from torchtitan_wlb.pipeline.schedule_check import check_pp_microbatches

__all__ = ["ConfigError", "check_job_config"]


def _degrees(job_config: Any, world_size: int) -> dict[str, int]:
    p = job_config.parallelism
    fixed = {
        "dp_replicate": p.data_parallel_replicate_degree,
        "cp": p.context_parallel_degree,
        "tp": p.tensor_parallel_degree,
        "pp": p.pipeline_parallel_degree,
    }
    for name, value in fixed.items():
        if value < 1:
            raise ConfigError(f"[parallelism] {name} degree = {value} must be >= 1")
    others = fixed["dp_replicate"] * fixed["cp"] * fixed["tp"] * fixed["pp"]
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world_size % others:
            raise ConfigError(
                f"[parallelism] dp_replicate x cp x tp x pp = {others} does not divide the "
                f"{world_size} processes launched (NGPU / WORLD_SIZE)"
            )
        shard = world_size // others
    if shard < 1 or others * shard != world_size:
        raise ConfigError(
            f"[parallelism] dp_replicate {fixed['dp_replicate']} x dp_shard {shard} x cp "
            f"{fixed['cp']} x tp {fixed['tp']} x pp {fixed['pp']} = {others * shard} processes, "
            f"but {world_size} were launched (NGPU / WORLD_SIZE); launch that many or change the "
            "degrees"
        )
    return {**fixed, "dp_shard": shard}


def check_job_config(job_config: Any, world_size: int | None = None) -> dict[str, int]:
    """Validate the parts of a config that TorchTitan checks late or not at all.

    Returns the resolved parallel degrees. Raises :class:`ConfigError` naming the fields.
    """
    if world_size is None:
        fake = job_config.comm.mode in ("fake_backend", "local_tensor")
        # Fake-backend dry runs are one process that simulates NGPU ranks.
        world_size = int(os.environ.get("NGPU", "1") if fake else os.environ.get("WORLD_SIZE", "1"))
    degrees = _degrees(job_config, world_size)
    wlb = getattr(job_config, "wlb", None)
    if wlb is None:
        raise ConfigError(
            'the [wlb] section is missing: set [job] custom_config_module = "torchtitan_wlb.config"'
        )
    training = job_config.training
    seq_len = training.seq_len
    if wlb.micro_batch_max_len and wlb.micro_batch_max_len < seq_len:
        raise ConfigError(
            f"[wlb] micro_batch_max_len = {wlb.micro_batch_max_len} is below [training] seq_len "
            f"= {seq_len}: S_max must be >= the context length (0 means seq_len)"
        )
    if wlb.max_doc_len and wlb.max_doc_len > max(seq_len, wlb.micro_batch_max_len):
        raise ConfigError(
            f"[wlb] max_doc_len = {wlb.max_doc_len} exceeds the longest micro-batch "
            f"(max(seq_len, micro_batch_max_len) = {max(seq_len, wlb.micro_batch_max_len)})"
        )
    if degrees["cp"] > 1 and job_config.compile.enable and "model" in job_config.compile.components:
        raise ConfigError(
            f"[compile] enable = true with components including 'model' and [parallelism] "
            f"context_parallel_degree = {degrees['cp']}: the per-document CP attention op's "
            "backward cannot be traced by torch.compile; disable [compile] or compile only 'loss'"
        )
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    if wlb.loader == "documents":
        # Checks the dataset kind and that its path exists (DataError names it).
        TextSource(
            kind=training.dataset, path=training.dataset_path or "", text_field=wlb.text_field
        )
        if job_config.model.name != "llama3_wlb":
            raise ConfigError(
                f'[model] name = {job_config.model.name!r}: [wlb] loader = "documents" feeds '
                'document metadata only "llama3_wlb" understands (or set [wlb] loader = "torchtitan")'
            )
        if training.local_batch_size != 1:
            raise ConfigError(
                f"[training] local_batch_size = {training.local_batch_size}: with document packing "
                "each micro-batch is one packed sequence, so it must be 1; set the number of "
                "micro-batches per step with [training] global_batch_size"
            )
        n = training.global_batch_size if training.global_batch_size > 0 else dp
        if n % dp:
            raise ConfigError(
                f"[training] global_batch_size = {n} micro-batches per step is not divisible by "
                f"the data-parallel degree {dp}"
            )
        if degrees["pp"] > 1:
            try:
                check_pp_microbatches(
                    job_config.parallelism.pipeline_parallel_schedule, n // dp, degrees["pp"]
                )
            except ValueError as e:
                raise ConfigError(
                    f"[parallelism] pipeline_parallel_degree = {degrees['pp']} with [training] "
                    f"global_batch_size = {n} ({n // dp} micro-batches per DP rank): {e}"
                ) from None
    elif degrees["cp"] > 1:
        raise ConfigError(
            f"[parallelism] context_parallel_degree = {degrees['cp']} needs document boundaries "
            f'(every [wlb] cp_sharding plan is built from them), but [wlb] loader = "torchtitan" '
            'provides none; use [wlb] loader = "documents"'
        )
    return degrees
