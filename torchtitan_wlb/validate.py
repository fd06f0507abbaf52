"""Start-up checks of a job config, as one line naming the fields and the accepted values;
``python -m torchtitan_wlb.validate ARGS`` is run_train.sh's pre-flight check (exit status 2)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import importlib.util
import io
import itertools
import os
import re
import sys
from typing import Any
from unittest import mock

import torch

from torchtitan_wlb.config import TABLES, ConfigError, settings
from torchtitan_wlb.data.sources import DataError, TextSource
from torchtitan_wlb.pipeline.schedule_check import (
    VARLEN_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    check_pp_microbatches,
)
from torchtitan_wlb.resume import FAKE_COMM_MODES, CheckpointError, check_resume

try:
    from tomllib import TOMLDecodeError
except ImportError:  # Python 3.10
    from tomli import TOMLDecodeError

DATA_CHECK_DOCS = 10_000
"""Documents :func:`check_data` reads before training starts (a prefix of big datasets)."""


def layout_world_size(parallelism: Any) -> int:
    """The ranks a TorchTitan ``[parallelism]`` layout needs: the product of its degrees, with
    ``data_parallel_shard_degree = -1`` (FSDP over whatever ranks are left) counted as 1."""
    p = parallelism
    return (
        p.data_parallel_replicate_degree
        * max(p.data_parallel_shard_degree, 1)
        * p.context_parallel_degree
        * p.tensor_parallel_degree
        * p.pipeline_parallel_degree
    )


def layout_degrees(job_config: Any, world_size: int) -> dict[str, int]:
    """The parallel degrees of ``job_config`` on ``world_size`` processes (``dp_shard = -1``
    resolved as TorchTitan does); ``ConfigError`` when they do not multiply to it."""
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
    """Check what TorchTitan checks late or not at all; return the resolved parallel degrees."""
    if world_size is None:  # a fake-backend dry run is one process simulating NGPU ranks
        fake = job_config.comm.mode in FAKE_COMM_MODES
        world_size = int(os.environ.get("NGPU", "1") if fake else os.environ.get("WORLD_SIZE", "1"))
    degrees = layout_degrees(job_config, world_size)
    if getattr(job_config, "wlb", None) is None:
        raise ConfigError(
            'the [wlb] section is missing: set [job] custom_config_module = "torchtitan_wlb.config"'
        )
    _check_training(job_config, degrees)
    _check_lengths(job_config)
    _check_cp_combinations(job_config, degrees)
    _check_zero_bubble_compile(job_config, degrees)
    _check_queue_thresholds(job_config)
    _check_profiles(job_config.wlb)
    _check_profiling(job_config.profiling)
    _check_converters(job_config)
    _check_options(job_config, degrees)
    _check_validation(job_config)
    if job_config.wlb.advanced.loader == "documents":
        _check_document_loader(job_config, degrees)
    else:
        _check_torchtitan_loader(job_config, degrees)
    return degrees


def _check_torchtitan_loader(job_config: Any, degrees: dict[str, int]) -> None:
    """TorchTitan's own loader: its own datasets, no document boundaries."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    dataset = job_config.training.dataset
    if dataset not in DATASETS:
        raise ConfigError(
            f'[wlb.advanced] loader = "torchtitan" reads TorchTitan\'s datasets '
            f"({', '.join(repr(name) for name in DATASETS)}), not [training] dataset = "
            f'{dataset!r}; use [wlb.advanced] loader = "documents" or one of those'
        )
    if degrees["cp"] > 1:
        raise ConfigError(
            f"[parallelism] context_parallel_degree = {degrees['cp']} needs document boundaries "
            f"(every [wlb] cp_sharding plan is built from them), but [wlb.advanced] loader = "
            '"torchtitan" provides none; use [wlb.advanced] loader = "documents"'
        )


def _check_lengths(job_config: Any) -> None:
    """S_max and the longest document piece against the context length."""
    wlb, seq_len = job_config.wlb, job_config.training.seq_len
    max_doc_len = wlb.advanced.max_doc_len
    if wlb.micro_batch_max_len and wlb.micro_batch_max_len < seq_len:
        raise ConfigError(
            f"[wlb] micro_batch_max_len = {wlb.micro_batch_max_len} is below [training] seq_len "
            f"= {seq_len}: S_max must be >= the context length (0 means seq_len)"
        )
    if max_doc_len and max_doc_len > max(seq_len, wlb.micro_batch_max_len):
        raise ConfigError(
            f"[wlb.advanced] max_doc_len = {max_doc_len} exceeds the longest micro-batch "
            f"(max(seq_len, micro_batch_max_len) = {max(seq_len, wlb.micro_batch_max_len)})"
        )


def _check_queue_thresholds(job_config: Any) -> None:
    """Outlier queues above the longest document would never hold one: a typo, not a choice."""
    wlb, seq_len = job_config.wlb, job_config.training.seq_len
    longest = wlb.advanced.max_doc_len or seq_len
    smax = wlb.micro_batch_max_len or int(1.25 * seq_len)
    if above := [t for t in wlb.queue_thresholds if t > longest]:
        raise ConfigError(
            f"[wlb] queue_thresholds = {list(wlb.queue_thresholds)} has {above[0]} above the "
            f"longest document piece, max_doc_len = {longest} (S_max = {smax}): a queue there "
            f"would never hold a document; use thresholds <= {longest}"
        )


def _check_cp_combinations(job_config: Any, degrees: dict[str, int]) -> None:
    """The settings context parallelism cannot run with: hybrid under TP."""
    if degrees["cp"] > 1 and degrees["tp"] > 1 and job_config.wlb.cp_sharding == "hybrid":
        raise ConfigError(
            f'[wlb] cp_sharding = "hybrid" with [parallelism] tensor_parallel_degree = '
            f"{degrees['tp']}: hybrid keeps whole documents on one CP rank, so CP ranks hold "
            "different token counts, which sequence-parallel TP cannot split evenly; use "
            '"per_document" (or "adaptive") with TP, or tensor_parallel_degree = 1'
        )


def _check_zero_bubble_compile(job_config: Any, degrees: dict[str, int]) -> None:
    """torch's zero-bubble schedules refuse compiled stage modules (their split backward cannot
    run through a compiled block), but only once the ranks build the schedule."""
    schedule = str(job_config.parallelism.pipeline_parallel_schedule)
    compiled = job_config.compile.enable and "model" in job_config.compile.components
    if (
        degrees["pp"] > 1
        and compiled
        and schedule.lower() in {n.lower() for n in ZERO_BUBBLE_SCHEDULES}
    ):
        raise ConfigError(
            f"[parallelism] pipeline_parallel_schedule = {schedule!r} with [compile] enable = "
            "true and components including 'model': torch's zero-bubble schedules do not run "
            "compiled stages; use Interleaved1F1B, or compile only 'loss'"
        )


def _check_profiles(wlb: Any) -> None:
    """The profile files the run will read exist."""
    for name in ("cost_profile", "cp_profile"):
        used = name == "cp_profile" or wlb.cost_model in ("profile", "online")
        path = getattr(wlb, name)
        if path and used and not os.path.isfile(path):
            raise ConfigError(f"[wlb] {name} = {path!r} does not exist (a JSON profile file)")


def _check_profiling(profiling: Any) -> None:
    """TorchTitan's profiler schedule, which it asserts inside every rank: each cycle of
    ``profile_freq`` steps waits, warms up for ``profiler_warmup`` and records
    ``profiler_active``; the memory snapshot is dumped every ``profile_freq`` steps."""
    if not (profiling.enable_profiling or profiling.enable_memory_snapshot):
        return
    freq = profiling.profile_freq
    if freq < 1:
        raise ConfigError(f"[profiling] profile_freq = {freq} is out of range; it must be >= 1")
    if not profiling.enable_profiling:
        return
    warmup, active = profiling.profiler_warmup, profiling.profiler_active
    if warmup < 0 or active < 1:
        raise ConfigError(
            f"[profiling] profiler_warmup = {warmup}, profiler_active = {active}: the warmup "
            "must be >= 0 steps and the active span >= 1"
        )
    if freq < warmup + active:
        raise ConfigError(
            f"[profiling] profile_freq = {freq} is below profiler_warmup + profiler_active = "
            f"{warmup} + {active}: TorchTitan needs profile_freq >= warmup + active (each cycle "
            f"of profile_freq steps warms up, then records); set --profiling.profile_freq "
            f"{warmup + active} or more, or lower the warmup or active steps"
        )


QUANTIZE_NEEDS = {
    "float8": ((8, 9), "an SM89 or later GPU"),
    "mx": ((10, 0), "an SM100 or later GPU"),
}
"""TorchTitan's quantized training converters (``quantize.<layers>.<kind>``) by kind: the CUDA
capability and the GPU they need."""


def _check_converters(job_config: Any) -> None:
    """``[model] converters``: names TorchTitan registers (it fails on others with a bare
    ``KeyError``), and the GPU and torchao that its quantized training needs."""
    names = list(job_config.model.converters)
    if not names:
        return
    import torchtitan.components.quantization  # noqa: F401 -- registers TorchTitan's converters
    from torchtitan.protocols.model_converter import _registry_model_converter_cls as known

    shown = f"[model] converters = {names}"
    for name in names:
        if name not in known:
            raise ConfigError(
                f"{shown}: {name!r} is not a TorchTitan model converter; use one of "
                f"{', '.join(sorted(known))} (float8 training: quantize.linear.float8)"
            )
        kind = name.rpartition(".")[2]
        if kind not in QUANTIZE_NEEDS:
            continue
        capability, gpu = QUANTIZE_NEEDS[kind]
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{shown}: {name} needs CUDA ({gpu} and torchao), and this run is on CPU; "
                "remove it from [model] converters"
            )
        emulated = name == "quantize.linear.float8" and job_config.quantize.linear.float8.emulate
        have = torch.cuda.get_device_capability()
        if torch.version.hip is None and not emulated and have < capability:
            raise ConfigError(
                f"{shown}: {name} needs {gpu}, and this one is SM{have[0]}{have[1]}; remove it "
                "from [model] converters"
            )
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError(f"{shown}: {name} needs torchao, which is not installed")


def _check_options(job_config: Any, degrees: dict[str, int]) -> None:
    """TorchTitan options that would fail inside the ranks, or be silently ignored, refused here
    in one line each: the option, why, and what to set (docs/getting_started.md lists them)."""
    for check in (
        _check_cpu_options,
        _check_torchtitan_constraints,
        _check_wlb_options,
        _check_not_installed,
        _check_not_yet_supported,
    ):
        check(job_config, degrees)


def _check_cpu_options(job_config: Any, degrees: dict[str, int]) -> None:
    """Options that act on a GPU: on CPU ranks they fail inside TorchTitan or torch."""
    if torch.cuda.is_available():
        return
    training, parallelism = job_config.training, job_config.parallelism
    if training.gc_debug:
        raise ConfigError(
            "[training] gc_debug = true needs CUDA: torch's reference-cycle finder it turns on "
            "records the CUDA allocator's history, and this run is on CPU; remove it"
        )
    if training.enable_cpu_offload:
        raise ConfigError(
            "[training] enable_cpu_offload = true needs CUDA: it moves FSDP's parameters and "
            "optimizer state from the GPU to the CPU, where this run's already are; remove it"
        )
    if parallelism.enable_async_tensor_parallel:
        raise ConfigError(
            "[parallelism] enable_async_tensor_parallel = true needs CUDA (GPU symmetric-memory "
            "collectives) and [compile] enable, and this run is on CPU; remove it"
        )


def _check_torchtitan_constraints(job_config: Any, degrees: dict[str, int]) -> None:
    """TorchTitan's and torch's own limits, which they raise inside every rank."""
    ckpt, ac, optimizer = (
        job_config.checkpoint,
        job_config.activation_checkpoint,
        job_config.optimizer,
    )
    if ckpt.enable and ckpt.keep_latest_k == 1:
        raise ConfigError(
            "[checkpoint] keep_latest_k = 1: TorchTitan keeps at least 2 checkpoints (the newest "
            "may still be being written when the older is purged); use 2 or more, or 0 for all"
        )
    option = ac.selective_ac_option
    if ac.mode == "selective" and option != "op" and not option.isdigit():
        raise ConfigError(
            f"[activation_checkpoint] selective_ac_option = {option!r} is not accepted: use "
            '"op" (per-operator) or a positive integer N (every N-th layer)'
        )
    if ac.debug and ac.mode == "selective" and option == "op":
        raise ConfigError(
            '[activation_checkpoint] debug = true with mode = "selective" and selective_ac_option '
            '= "op": torch\'s checkpoint debug mode cannot run with per-operator checkpointing; '
            'use mode = "full" or selective_ac_option = "1", or remove debug'
        )
    compiled = job_config.compile.enable and "model" in job_config.compile.components
    if ac.mode == "memory_budget" and not compiled:
        raise ConfigError(
            '[activation_checkpoint] mode = "memory_budget" needs the model compiled ([compile] '
            "enable = true with 'model' in components): torch.compile's partitioner applies the "
            'budget; use mode = "selective" or "full"'
        )
    if optimizer.early_step_in_backward:
        _check_early_step(job_config, degrees)


def _check_early_step(job_config: Any, degrees: dict[str, int]) -> None:
    """``[optimizer] early_step_in_backward`` steps in each backward pass: one per step only."""
    if degrees["pp"] > 1:
        raise ConfigError(
            f"[optimizer] early_step_in_backward = true with [parallelism] "
            f"pipeline_parallel_degree = {degrees['pp']}: TorchTitan does not step the optimizer "
            "in the backward under pipeline parallelism; remove it"
        )
    training = job_config.training
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    per_rank = max(1, training.global_batch_size // (dp * training.local_batch_size))
    if per_rank > 1:
        raise ConfigError(
            f"[optimizer] early_step_in_backward = true with {per_rank} micro-batches per step "
            f"per DP rank ([training] global_batch_size = {training.global_batch_size}): the "
            f"optimizer would step in every micro-batch's backward, {per_rank} unclipped steps "
            f"on one micro-batch each; set global_batch_size = {dp * training.local_batch_size} "
            "or remove it"
        )


def _check_wlb_options(job_config: Any, degrees: dict[str, int]) -> None:
    """TorchTitan options that the document packing and the per-document CP op replace."""
    p = job_config.parallelism
    if job_config.model.name in ("llama3_wlb", "llama3"):
        for name in ("expert_parallel_degree", "expert_tensor_parallel_degree"):
            if getattr(p, name) != 1:
                raise ConfigError(
                    f"[parallelism] {name} = {getattr(p, name)}: {job_config.model.name} is a "
                    "dense model, with no experts to shard; set it to 1"
                )
    if job_config.wlb.advanced.loader == "documents" and p.pipeline_parallel_microbatch_size != 1:
        raise ConfigError(
            f"[parallelism] pipeline_parallel_microbatch_size = "
            f"{p.pipeline_parallel_microbatch_size}: with document packing each pipeline "
            "micro-batch is one packed sequence; leave it at 1 and set the micro-batches per "
            "step with [training] global_batch_size"
        )
    if degrees["pp"] > 1 and p.pipeline_parallel_schedule_csv:
        raise ConfigError(
            f"[parallelism] pipeline_parallel_schedule_csv = {p.pipeline_parallel_schedule_csv!r}:"
            " a schedule read from CSV is not supported with variable-length micro-batches; "
            f"set pipeline_parallel_schedule to one of {', '.join(VARLEN_SCHEDULES)}"
        )
    if degrees["cp"] > 1:
        for name, default in (("load_balancer", "headtail"), ("rotate_method", "allgather")):
            value = getattr(p, f"context_parallel_{name}")
            if value != default:
                raise ConfigError(
                    f"[parallelism] context_parallel_{name} = {value!r} with "
                    f"context_parallel_degree = {degrees['cp']}: torchtitan-wlb's CP attention "
                    "all-gathers K and V and shards by [wlb] cp_sharding "
                    f"(docs/context_parallel.md); remove it (TorchTitan's {default!r} is unused)"
                )


def _check_not_installed(job_config: Any, degrees: dict[str, int]) -> None:
    """Options that need a package torchtitan-wlb does not install."""
    ckpt = job_config.checkpoint
    if ckpt.initial_load_in_hf_quantized:
        raise ConfigError(
            "[checkpoint] initial_load_in_hf_quantized = true: Llama 3's state-dict adapter "
            "cannot load quantized Hugging Face checkpoints; remove it"
        )
    needs = [
        ("[metrics] enable_wandb", job_config.metrics.enable_wandb, "wandb"),
        ("[checkpoint] initial_load_in_hf", ckpt.initial_load_in_hf, "safetensors"),
        ("[checkpoint] last_save_in_hf", ckpt.last_save_in_hf, "safetensors"),
    ]
    for name, enabled, package in needs:
        if enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{name} = true needs the {package} package, which is not installed: "
                f"pip install {package}, or remove it"
            )


def _check_not_yet_supported(job_config: Any, degrees: dict[str, int]) -> None:
    """Options torchtitan-wlb does not support (yet), refused before TorchTitan fails on them."""
    if job_config.fault_tolerance.enable:
        raise ConfigError(
            "[fault_tolerance] enable = true is not supported by torchtitan-wlb: TorchFT's "
            "replica groups join and leave during the run, while the packing plan is computed for "
            "a fixed data-parallel degree on every rank; remove it"
        )
    if job_config.validation.enable:
        from torchtitan.protocols.train_spec import get_train_spec

        import torchtitan_wlb.train_spec  # noqa: F401 -- registers llama3_wlb

        name = job_config.model.name
        if get_train_spec(name).build_validator_fn is None:
            raise ConfigError(
                f"[validation] enable = true: the {name} model has no validator yet (TorchTitan "
                "would fail on its missing build_validator_fn in every rank); remove it"
            )


def _check_document_loader(job_config: Any, degrees: dict[str, int]) -> None:
    """The document pipeline's needs: a readable dataset, the ``llama3_wlb`` model, one packed
    sequence per micro-batch, and micro-batches per step that the DP ranks and the pipeline
    schedule divide."""
    training = job_config.training
    if job_config.wlb.shuffle_seed >= 0 and training.dataset != "indexed":
        raise ConfigError(
            f"[wlb] shuffle_seed = {job_config.wlb.shuffle_seed} needs [training] dataset = "
            f"'indexed' (a text source is read in its order), not {training.dataset!r}; "
            "leave it unset (-1)"
        )
    # Checks the dataset kind and that its path exists (DataError names it).
    TextSource(training.dataset, training.dataset_path or "", job_config.wlb.advanced.text_field)
    if job_config.model.name != "llama3_wlb":
        raise ConfigError(
            f'[model] name = {job_config.model.name!r}: [wlb.advanced] loader = "documents" feeds '
            'document metadata only "llama3_wlb" understands (or set [wlb.advanced] loader = '
            '"torchtitan")'
        )
    if training.local_batch_size != 1:
        raise ConfigError(
            f"[training] local_batch_size = {training.local_batch_size}: with document packing "
            "each micro-batch is one packed sequence, so it must be 1; set the number of "
            "micro-batches per step with [training] global_batch_size"
        )
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
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


def _check_validation(job_config: Any) -> None:
    """``[validation]``: a held-out document source training does not read, and lengths the
    model's positions cover (docs/validation.md)."""
    from torchtitan_wlb.data.heldout import (
        TORCHTITAN_DEFAULT,
        training_reads_heldout,
        validation_source,
    )
    from torchtitan_wlb.data.sources import BUILTIN_HELDOUT_NAME

    training, v = job_config.training, job_config.validation
    if training.dataset == BUILTIN_HELDOUT_NAME:
        raise ConfigError(
            f"[training] dataset = {BUILTIN_HELDOUT_NAME!r} is the built-in corpus's held-out "
            "split, which only [validation] reads; train on 'wlb_builtin'"
        )
    if not v.enable:
        return
    if v.dataset == TORCHTITAN_DEFAULT:
        raise ConfigError(
            f"[validation] dataset = {v.dataset!r} (TorchTitan's C4 download) is not read by the "
            f"document loader; use {BUILTIN_HELDOUT_NAME!r} (the built-in corpus's held-out "
            "split) or 'jsonl', 'parquet', 'text', 'hf', 'indexed' with [validation] dataset_path"
        )
    for name, value, low in (("freq", v.freq, 1), ("seq_len", v.seq_len, 2)):
        if value < low:
            raise ConfigError(f"[validation] {name} = {value} is out of range; it must be >= {low}")
    if v.local_batch_size < 1:
        raise ConfigError(f"[validation] local_batch_size = {v.local_batch_size} must be >= 1")
    longest = max(training.seq_len, job_config.wlb.micro_batch_max_len)
    if v.seq_len > longest:
        raise ConfigError(
            f"[validation] seq_len = {v.seq_len} exceeds the model's positions, max([training] "
            f"seq_len, [wlb] micro_batch_max_len) = {longest}; use at most {longest}"
        )
    try:
        source = validation_source(v, job_config.wlb.advanced.text_field)
    except DataError as e:
        raise DataError(str(e).replace("[training]", "[validation]")) from None
    if source.kind == "indexed":  # the files, the tokenizer record and the ids, as for training
        held_out = copy.deepcopy(job_config)
        held_out.training.dataset, held_out.training.dataset_path = "indexed", source.path
        try:
            check_indexed_data(held_out)
        except DataError as e:
            raise DataError(str(e).replace("[training]", "[validation]")) from None
    if training_reads_heldout(training.dataset, training.dataset_path or "", source):
        raise ConfigError(
            f"[validation] dataset = {v.dataset!r} (dataset_path = {v.dataset_path or ''!r}) "
            "holds documents training reads too; validate on held-out documents ("
            f"{BUILTIN_HELDOUT_NAME!r} for the built-in corpus, other files for your own)"
        )


def _check_training(job_config: Any, degrees: dict[str, int]) -> None:
    """The TorchTitan fields whose bad values TorchTitan reports late or with a bare assert."""
    training, ckpt = job_config.training, job_config.checkpoint
    lowest = {  # field: (value, lowest accepted, what follows the bound)
        "[training] seq_len": (training.seq_len, 2, " tokens"),
        "[training] steps": (training.steps, 1, ""),
        "[training] local_batch_size": (training.local_batch_size, 1, ""),
        "[metrics] log_freq": (job_config.metrics.log_freq, 1, ""),
    }
    if ckpt.enable:
        off, keep_all = " step (or set [checkpoint] enable = false)", " (0 keeps every checkpoint)"
        lowest["[checkpoint] interval"] = (ckpt.interval, 1, off)
        lowest["[checkpoint] keep_latest_k"] = (ckpt.keep_latest_k, 0, keep_all)
    for name, (value, low, note) in lowest.items():
        if value < low:
            raise ConfigError(f"{name} = {value} is out of range; it must be >= {low}{note}")
    seq_len, divisor = training.seq_len, 2 * degrees["tp"] * degrees["cp"]
    if seq_len % divisor:
        raise ConfigError(
            f"[training] seq_len = {seq_len} must be divisible by 2 x tensor_parallel_degree x "
            f"context_parallel_degree = {divisor} (TorchTitan shards the sequence in 2 x CP "
            f"chunks per TP rank); e.g. {seq_len - seq_len % divisor or divisor}"
        )
    if training.global_batch_size == 0 or training.global_batch_size < -1:
        raise ConfigError(
            f"[training] global_batch_size = {training.global_batch_size} is out of range; it "
            "must be >= 1 (micro-batches per step, all DP ranks together) or -1 (one per DP rank)"
        )


def check_data(job_config: Any, max_docs: int = DATA_CHECK_DOCS) -> int:
    """Read the first ``max_docs`` documents as training will, so that a bad path, file, record or
    document fails now, not in the data thread mid-training; return how many were read (0: HF)."""
    from torchtitan_wlb.data.dataloader import build_document_node, text_source_from_config
    from torchtitan_wlb.data.tokenizer import build_wlb_tokenizer

    source = text_source_from_config(job_config)  # DataError: kind, path
    if source.kind == "hf":
        return 0
    if source.kind == "indexed":
        return check_indexed_data(job_config, max_docs)
    node = build_document_node(job_config, build_wlb_tokenizer(job_config))
    node.epochs = 1  # one pass is enough to see every document once
    node.reset()
    return sum(1 for _ in itertools.islice(node, max_docs))


def check_indexed_data(job_config: Any, max_docs: int = DATA_CHECK_DOCS) -> int:
    """An indexed corpus: the two files agree (opening it checks them), it was made with this
    run's tokenizer (when it says), and the ids of its first ``max_docs`` documents are below the
    model's and the tokenizer's vocabulary; return how many documents were checked."""
    from torchtitan_wlb.data.dataloader import build_document_node
    from torchtitan_wlb.data.tokenizer import build_wlb_tokenizer
    from torchtitan_wlb.models.llama3_wlb import llama3_wlb_args

    tokenizer = build_wlb_tokenizer(job_config)
    node = build_document_node(job_config, tokenizer)  # DataError: files, tokenizer record
    corpus = node.corpus
    flavor = job_config.model.flavor
    vocab = tokenizer.get_vocab_size()
    where = f"the tokenizer's vocabulary ({vocab})"
    if flavor in llama3_wlb_args and llama3_wlb_args[flavor].vocab_size < vocab:
        vocab = llama3_wlb_args[flavor].vocab_size
        where = f"[model] flavor = {flavor!r}'s vocabulary ({vocab})"
    docs = min(max_docs, corpus.num_docs)
    node.epochs = 1  # the long-document policy over the first documents, as training reads them
    node.reset()
    node.read_lengths(sys.maxsize, max_items=docs)
    top, low = corpus.max_token(docs), corpus.min_token(docs)
    if top >= vocab or low < 0:
        raise DataError(
            f"{corpus.bin_path}: token id {top if top >= vocab else low} in its first {docs} "
            f"documents is outside {where}: the corpus was made with another tokenizer"
        )
    return docs


def main(argv: list[str] | None = None) -> int:
    """Pre-flight check of a launch: ``python -m torchtitan_wlb.validate ARGS`` (see above)."""
    from torchtitan_wlb import cpu_support

    cpu_support.activate()  # before torchtitan is imported, as in the ranks
    from torchtitan_wlb.data.dataloader import data_fingerprint

    args = sys.argv[1:] if argv is None else argv
    try:
        job_config = parse_job_config(args)
        # The processes run_train.sh will launch (NGPU), else this process's WORLD_SIZE.
        ngpu = os.environ.get("NGPU") or os.environ.get("WORLD_SIZE") or "1"
        if not ngpu.isdigit() or int(ngpu) < 1:
            raise ConfigError(f"NGPU = {ngpu!r} must be a positive integer")
        degrees = check_job_config(job_config, world_size=int(ngpu))
        fingerprint = None
        if job_config.wlb.advanced.loader == "documents":
            check_data(job_config)
            from torchtitan_wlb.models.llama3_wlb import cost_model_for_job

            dp = degrees["dp_replicate"] * degrees["dp_shard"]
            fingerprint = data_fingerprint(job_config, dp, cost_model_for_job(job_config))
        check_resume(job_config, fingerprint)
    except (ConfigError, DataError, CheckpointError, ValueError, OSError, TOMLDecodeError) as e:
        print(f"error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2
    return 0


def parse_job_config(args: list[str]) -> Any:
    """TorchTitan's parser, its usage box and unknown-field errors as one ConfigError line."""
    from torchtitan.config import ConfigManager

    err = io.StringIO()
    # tyro wraps its box at the terminal width: a wide one puts every item on one line.
    wide = mock.patch.dict(os.environ, {"COLUMNS": "1000"})
    try:
        with wide, contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return ConfigManager().parse_args(args)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            raise
        raise ConfigError(_parser_message(err.getvalue())) from None
    except ValueError as e:
        raise ConfigError(_unknown_fields(str(e))) from None


def _parser_message(text: str) -> str:
    """The substance of tyro's error box: what failed, for which flag, and the type it takes."""
    lines = [raw.strip().strip("│╭╮╰╯┃").strip() for raw in text.splitlines()]
    lines = [line for line in lines if line and set(line) - set("-─━ ")]
    message, expects = "", ""
    for k, line in enumerate(lines):
        if line.startswith("Error parsing "):
            where, _, what = line[len("Error parsing ") :].partition(": ")
            # A [wlb] value rejected by the section's own checks is already a complete sentence.
            message = what if what.startswith("[") else f"{where}: {what}"
        elif line.startswith("Unrecognized options:"):
            options = line.partition(":")[2]
            message = (
                f"unrecognized options:{options}{_closest_wlb_flag(options)} (every field: "
                "python -m torchtitan_wlb.train --help; [wlb] fields: docs/configuration.md)"
            )
        elif line.startswith("Argument helptext:") and message and k + 1 < len(lines):
            parts = lines[k + 1].split()
            expects = f" (expects {parts[1]})" if len(parts) > 1 else ""
    if not message:
        message = " ".join(line for line in lines if not line.startswith("usage:"))[:300]
    return (message + expects) or "the command line or TOML could not be parsed"


def _closest_wlb_flag(options: str) -> str:
    """ "; did you mean --wlb.<table>.<field>?" for the first of tyro's unrecognized ``options``
    that starts with ``--wlb.``: the closest ``[wlb]`` setting by name, in whichever table."""
    flag = next((o for o in options.replace(",", " ").split() if o.startswith("--wlb.")), "")
    key = flag.partition("=")[0].rpartition(".")[2].replace("-", "_")
    paths = {f.name: f"--{t.TOML_TABLE}.{f.name}" for t in TABLES for f in settings(t)}
    close = difflib.get_close_matches(key, list(paths), n=1) if key else []
    return f"; did you mean {paths[close[0]]}?" if close else ""


def _unknown_fields(text: str) -> str:
    """TorchTitan's unknown-field error as one line naming the table and the closest field."""
    m = re.search(r"Invalid field names in <class '[\w.]*?(\w+)'> data: \{(.*?)\}", text)
    if not m:
        return text
    tables = {table.__name__: table for table in TABLES}
    table = tables.get(m.group(1))
    section = table.TOML_TABLE if table else m.group(1).lower()
    keys = [k.strip().strip("'\"") for k in m.group(2).split(",")]
    hint = _closest_wlb_field(keys[0], table) if table else ""
    return (
        f"[{section}] has no field {', '.join(repr(k) for k in keys)}{hint} (fields: "
        "docs/configuration.md for [wlb], python -m torchtitan_wlb.train --help for all)"
    )


def _closest_wlb_field(key: str, table: type) -> str:
    """ "; did you mean ..." naming the ``[wlb]`` field closest to ``key``: one of ``table``'s, or
    one of another ``[wlb]`` table's, named with its table (a field set in the wrong table)."""
    where = {f.name: t for t in TABLES for f in dataclasses.fields(t)}
    close = difflib.get_close_matches(key, list(where), n=1)
    if not close:
        return ""
    if where[close[0]] is table:
        return f"; did you mean {close[0]!r}?"
    return f"; did you mean {close[0]!r} in [{where[close[0]].TOML_TABLE}]?"


if __name__ == "__main__":
    raise SystemExit(main())
