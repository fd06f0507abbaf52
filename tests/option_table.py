"""Every field of TorchTitan's JobConfig, as it behaves in a torchtitan-wlb job on CPU.

``TABLE`` maps each field (``section.name``, nested tables dotted) to a :class:`Row`: it works, it
works differently, it is refused before any rank starts, or it has no effect here; with what
checks it. ``tests/test_option_sweep.py`` checks the table against TorchTitan's JobConfig (a field
missing from it fails the test by name), runs every check, and keeps the options table of
docs/getting_started.md equal to :func:`render_markdown`; ``python tests/option_table.py --write``
rewrites that table from this one.

Checks:

- ``run:<name>``: the slow sweep run ``RUNS[name]`` sets the option and trains;
- ``test:<path>::<function>``: that test exercises the option (its file names the option, or
  the word after a space);
- ``toml``: ``train_configs/debug_cpu.toml``, which every run reads, sets it;
- ``refuse``: ``{field: value}`` overrides that ``torchtitan_wlb.validate`` refuses in one line
  containing the expected strings (the option named as ``[section] field`` among them);
- ``accept``: ``{field: value}`` overrides that ``validate`` accepts (a field with no effect here
  is not refused).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Any

STATUS_LABELS = {
    "works": "works",
    "differs": "works differently",
    "refused": "refused",
    "inert": "no effect",
}


@dataclass(frozen=True)
class Row:
    """One option: its status, a user-facing note (how it works, or why not), its checks."""

    status: str
    note: str
    checks: tuple[str, ...] = ()
    refuse: dict[str, Any] | None = None
    expect: tuple[str, ...] = ()
    accept: dict[str, Any] | None = None
    needs_missing: str = ""
    """A package whose absence the refusal is about: the refusal is checked only without it."""
    cpu_only: bool = False
    """The refusal is about CPU ranks: checked only where CUDA is unavailable."""


def works(note: str, *checks: str, **kw: Any) -> Row:
    return Row("works", note, checks, **kw)


def differs(note: str, *checks: str, **kw: Any) -> Row:
    return Row("differs", note, checks, **kw)


def refused(note: str, refuse: dict[str, Any], *expect: str, **kw: Any) -> Row:
    return Row("refused", note, refuse=refuse, expect=expect, **kw)


def inert(note: str, accept: dict[str, Any]) -> Row:
    return Row("inert", note, accept=accept)


A, B = "run:fsdp_tp", "run:pp"
SMOKE = "test:tests/test_train_smoke.py::"
E2E = "test:tests/test_e2e_4d.py::test_4d_matches_single_process"
DP_GRADS = "test:tests/test_data_parallel_grads.py::test_step_one_gradients_match_one_process"
DRY_RUN = "test:tests/test_configs_dry_run.py::"
CP2 = {"parallelism.context_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}
PP2 = {"parallelism.pipeline_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = [
    "--job.config_file", os.path.join(ROOT, "train_configs", "debug_cpu.toml"),
    "--model.flavor", "tiny",
    "--training.seq_len", "128", "--wlb.micro_batch_max_len", "160",
    "--training.global_batch_size", "4", "--metrics.disable_color_printing",
    "--training.steps", "3",
]  # fmt: skip
"""Every sweep run's arguments (with ``--job.dump_folder``): the tiny model, 3 steps."""

RUNS: dict[str, tuple[int, list[str]]] = {
    # FSDP 2 x TP 2 with most of TorchTitan's training options at non-default values.
    "fsdp_tp": (4, [
        "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree",
        "2", "--parallelism.disable_loss_parallel", "--parallelism.fsdp_reshard_after_forward",
        "always", "--training.global_batch_size", "2", "--job.description", "option sweep",
        "--job.print_config", "--job.save_config_file", "config.json", "--metrics.log_freq", "2",
        "--metrics.enable_tensorboard", "--metrics.save_tb_folder", "tb_sweep",
        "--metrics.save_for_all_ranks", "--optimizer.name", "Adam", "--optimizer.lr", "1e-3",
        "--optimizer.beta1", "0.8", "--optimizer.beta2", "0.9", "--optimizer.eps", "1e-7",
        "--optimizer.weight_decay", "0.01", "--optimizer.implementation", "foreach",
        "--optimizer.early_step_in_backward", "--lr_scheduler.warmup_steps", "1",
        "--lr_scheduler.total_steps", "3", "--lr_scheduler.decay_ratio", "0.5",
        "--lr_scheduler.decay_type", "cosine", "--lr_scheduler.min_lr_factor", "0.1",
        "--training.gc_freq", "1", "--training.mixed_precision_param", "bfloat16",
        "--training.mixed_precision_reduce", "float32", "--checkpoint.enable",
        "--checkpoint.folder", "ckpt", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k",
        "2", "--checkpoint.export_dtype", "bfloat16", "--checkpoint.last_save_model_only",
        "--checkpoint.async_mode", "async", "--checkpoint.enable_first_step_checkpoint",
        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
        "op", "--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", "output",
        "--activation_checkpoint.no-preserve-rng-state", "--activation_checkpoint.determinism_check",
        "none", "--activation_checkpoint.early_stop", "--comm.init_timeout_seconds", "120",
        "--comm.train_timeout_seconds", "60", "--debug.seed", "3", "--debug.deterministic",
        "--debug.deterministic_warn_only", "--profiling.enable_profiling",
        "--profiling.save_traces_folder", "traces", "--profiling.enable_memory_snapshot",
        "--profiling.save_memory_snapshot_folder", "memory", "--profiling.profile_freq", "3",
        "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1",
    ]),
    # PP 2 from the first run's step-2 checkpoint (its model, schedule and step: its optimizer
    # stepped in the backward, a different state layout), bf16, full activation checkpointing.
    "pp": (2, [
        "--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree",
        "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--parallelism.pipeline_parallel_layers_per_stage", "2",
        "--parallelism.pipeline_parallel_first_stage_less_layers", "0",
        "--parallelism.pipeline_parallel_last_stage_less_layers", "2", "--training.dtype",
        "bfloat16", "--training.max_norm", "0.5", "--optimizer.implementation", "fused",
        "--activation_checkpoint.mode", "full", "--activation_checkpoint.debug",
        "--checkpoint.enable", "--checkpoint.initial_load_path", "{fsdp_tp}/ckpt/step-2",
        "--checkpoint.no-initial-load-model-only", "--checkpoint.exclude_from_loading",
        "dataloader,optimizer", "--checkpoint.load_only",
    ]),
}  # fmt: skip

NO_VALIDATOR = "needs a validator for llama3_wlb"
QUANTIZE = "read by the quantized-training converters of [model] converters, which need CUDA"
FT_ONLY = "read only with [fault_tolerance] enable, which is refused"
HELDOUT_IN_PROCESS = "the held-out set is read and packed once, in the rank, before training"
VAL_E2E = "test:tests/test_e2e_4d.py::test_validation_loss_is_the_same_in_every_layout"
COMPILE = "test:tests/test_compile.py::test_compiled_matches_eager"
NO_EXPERTS = "for MoE experts; llama3_wlb is dense"
NCCL = "NCCL's flight recorder; CPU ranks talk over gloo, which has none"
UNREAD = "TorchTitan 0.2.2's trainer does not read it"
OWN_LOADER = (
    'read only with [wlb.advanced] loader = "torchtitan": the document pipeline prefetches '
    "packed steps in its own thread"
)

TABLE: dict[str, Row] = {
    # [job]
    "job.config_file": works("the TOML config", A),
    "job.dump_folder": works("run output folder", A),
    "job.description": works("shown at start", A),
    "job.print_config": works("logs the whole config", A),
    "job.save_config_file": works("writes the config as JSON into the dump folder", A),
    "job.custom_config_module": works(
        "every config in train_configs/ sets torchtitan_wlb.config: it adds [wlb]", "toml"
    ),
    # [profiling]
    "profiling.enable_profiling": works(
        "CPU activity only (no device activity)",
        A,
    ),
    "profiling.save_traces_folder": works("", A),
    "profiling.profile_freq": works(
        "must be >= profiler_warmup + profiler_active (TorchTitan's schedule), checked at start",
        A,
        refuse={"profiling.enable_profiling": True, "profiling.profile_freq": 2},
        expect=("[profiling] profile_freq = 2", "profile_freq >= warmup + active"),
    ),
    "profiling.profiler_active": works("", A),
    "profiling.profiler_warmup": works("", A),
    "profiling.enable_memory_snapshot": differs(
        "on CPU: the process's memory summary in place of CUDA's allocator history",
        A,
    ),
    "profiling.save_memory_snapshot_folder": works("", A),
    # [metrics]
    "metrics.log_freq": works("", A),
    "metrics.enable_tensorboard": works("TensorBoard; the WLB figures under wlb/", A),
    "metrics.disable_color_printing": works("", A),
    "metrics.save_tb_folder": works("", A),
    "metrics.save_for_all_ranks": works("", A),
    "metrics.enable_wandb": refused(
        "needs the wandb package, which torchtitan-wlb does not install: refused without it",
        {"metrics.enable_wandb": True},
        "[metrics] enable_wandb",
        "pip install wandb",
        needs_missing="wandb",
    ),
    # [model]
    "model.name": differs(
        '"llama3_wlb" with the document loader; other TorchTitan models only with '
        '[wlb.advanced] loader = "torchtitan"',
        "toml",
        refuse={"model.name": "llama3"},
        expect=("[model] name = 'llama3'", '"llama3_wlb"'),
    ),
    "model.flavor": works("llama3_wlb's flavors: docs/models.md", A),
    "model.hf_assets_path": differs(
        'a Hugging Face tokenizer folder; "" (the configs\' default) is the built-in byte '
        "tokenizer",
        "toml",
    ),
    "model.tokenizer_path": differs(
        "TorchTitan's deprecated alias of hf_assets_path", accept={"model.tokenizer_path": ""}
    ),
    "model.converters": refused(
        "TorchTitan's float8 and MX converters need CUDA (and torchao)",
        {"model.converters": ["quantize.linear.float8"]},
        "[model] converters",
        "needs CUDA",
        cpu_only=True,
    ),
    "model.print_after_conversion": inert(
        "prints the model after [model] converters, which need CUDA",
        {"model.print_after_conversion": True},
    ),
    # [optimizer]
    "optimizer.name": works("", A),
    "optimizer.lr": works("", A),
    "optimizer.beta1": works("", A),
    "optimizer.beta2": works("", A),
    "optimizer.eps": works("", A),
    "optimizer.weight_decay": works("", A),
    "optimizer.implementation": works("for-loop, foreach and fused", A, B),
    "optimizer.early_step_in_backward": differs(
        "only with one micro-batch per DP rank and step (global_batch_size = DP degree) and no "
        "PP: it steps in each micro-batch's backward, unclipped (grad_norm logs 0)",
        A,
        refuse={"optimizer.early_step_in_backward": True},
        expect=("[optimizer] early_step_in_backward", "micro-batches per step per DP rank"),
    ),
    # [lr_scheduler]
    "lr_scheduler.warmup_steps": works("", A),
    "lr_scheduler.total_steps": works("", A),
    "lr_scheduler.decay_ratio": works("", A),
    "lr_scheduler.decay_type": works("", A),
    "lr_scheduler.min_lr_factor": works("", A),
    # [training]
    "training.dataset": differs(
        "documents from jsonl, text, parquet or a Hugging Face dataset, or the built-in corpus "
        "(docs/data.md)",
        "toml",
        "test:tests/test_kill_resume.py::"
        "test_killed_at_the_worst_moments_trains_each_document_once",
    ),
    "training.dataset_path": works(
        "",
        "test:tests/test_kill_resume.py::"
        "test_killed_at_the_worst_moments_trains_each_document_once",
    ),
    "training.local_batch_size": differs(
        "must be 1: each micro-batch is one packed sequence",
        "toml",
        refuse={"training.local_batch_size": 2},
        expect=("[training] local_batch_size = 2", "must be 1"),
    ),
    "training.global_batch_size": differs(
        "packed micro-batches per step, all DP ranks together, each up to [wlb] "
        "micro_batch_max_len tokens",
        A,
    ),
    "training.seq_len": differs(
        "the context length: the longest document piece; a packed micro-batch holds up to [wlb] "
        "micro_batch_max_len tokens",
        A,
    ),
    "training.max_norm": works("", B),
    "training.steps": works("", A),
    "training.enable_cpu_offload": refused(
        "needs CUDA: it offloads from the GPU to the CPU, where CPU ranks' tensors already are",
        {"training.enable_cpu_offload": True},
        "[training] enable_cpu_offload",
        "needs CUDA",
        cpu_only=True,
    ),
    "training.dtype": works("float32 or bfloat16", B),
    "training.mixed_precision_param": works("FSDP's parameter dtype", A),
    "training.mixed_precision_reduce": works("float32 (the only value TorchTitan takes)", A),
    "training.gc_freq": works("", A),
    "training.gc_debug": refused(
        "needs CUDA: torch's reference-cycle finder records the CUDA allocator's history",
        {"training.gc_debug": True},
        "[training] gc_debug",
        "needs CUDA",
        cpu_only=True,
    ),
    "training.dataloader.num_workers": differs(
        OWN_LOADER, accept={"training.dataloader.num_workers": 2}
    ),
    "training.dataloader.persistent_workers": differs(
        OWN_LOADER, accept={"training.dataloader.persistent_workers": True}
    ),
    "training.dataloader.pin_memory": differs(
        OWN_LOADER, accept={"training.dataloader.pin_memory": True}
    ),
    "training.dataloader.prefetch_factor": differs(
        OWN_LOADER, accept={"training.dataloader.prefetch_factor": 4}
    ),
    # [parallelism]
    "parallelism.data_parallel_replicate_degree": works("DDP and HSDP", DP_GRADS),
    "parallelism.data_parallel_shard_degree": works("FSDP and HSDP", A, DP_GRADS),
    "parallelism.fsdp_reshard_after_forward": works("", A),
    "parallelism.tensor_parallel_degree": works("", A, E2E),
    "parallelism.disable_loss_parallel": works("", A),
    "parallelism.enable_async_tensor_parallel": refused(
        "needs CUDA (GPU symmetric-memory collectives) and [compile]",
        {"parallelism.enable_async_tensor_parallel": True},
        "[parallelism] enable_async_tensor_parallel",
        "needs CUDA",
        cpu_only=True,
    ),
    "parallelism.pipeline_parallel_degree": works(
        "variable-length micro-batches (docs/pipeline.md)", B, E2E
    ),
    "parallelism.module_fqns_per_model_part": works(
        "set it in the TOML (on the command line each value becomes a part of one module); "
        "the split is TorchTitan's pipeline_module_split, as in the pipeline tests",
        "test:tests/test_pipeline_varlen.py::test_pp2_schedules_varlen_match_single_process "
        "pipeline_module_split",
    ),
    "parallelism.pipeline_parallel_first_stage_less_layers": works("", B),
    "parallelism.pipeline_parallel_last_stage_less_layers": works("", B),
    "parallelism.pipeline_parallel_layers_per_stage": works("", B),
    "parallelism.pipeline_parallel_schedule": differs(
        "the schedules that take variable-length micro-batches (docs/pipeline.md); others are "
        "refused at start",
        B,
        E2E,
    ),
    "parallelism.pipeline_parallel_schedule_csv": refused(
        "a schedule read from CSV does not take variable-length micro-batches",
        {**PP2, "parallelism.pipeline_parallel_schedule_csv": "schedule.csv"},
        "[parallelism] pipeline_parallel_schedule_csv",
        "variable-length",
    ),
    "parallelism.pipeline_parallel_microbatch_size": refused(
        "only 1: each pipeline micro-batch is one packed sequence",
        {"parallelism.pipeline_parallel_microbatch_size": 2},
        "[parallelism] pipeline_parallel_microbatch_size = 2",
        "global_batch_size",
    ),
    "parallelism.pipeline_parallel_expert_parallel_overlap": inert(
        NO_EXPERTS, {"parallelism.pipeline_parallel_expert_parallel_overlap": False}
    ),
    "parallelism.context_parallel_degree": differs(
        "per-document CP: [wlb] cp_sharding chooses each micro-batch's sharding "
        "(docs/context_parallel.md)",
        E2E,
    ),
    "parallelism.context_parallel_load_balancer": refused(
        "[wlb] cp_sharding chooses the sharding; only TorchTitan's default is accepted",
        {**CP2, "parallelism.context_parallel_load_balancer": "ptrr"},
        "[parallelism] context_parallel_load_balancer = 'ptrr'",
        "[wlb] cp_sharding",
    ),
    "parallelism.context_parallel_rotate_method": refused(
        "the CP attention all-gathers K and V; only TorchTitan's default is accepted",
        {**CP2, "parallelism.context_parallel_rotate_method": "alltoall"},
        "[parallelism] context_parallel_rotate_method = 'alltoall'",
        "all-gathers",
    ),
    "parallelism.expert_parallel_degree": refused(
        NO_EXPERTS,
        {"parallelism.expert_parallel_degree": 2},
        "[parallelism] expert_parallel_degree = 2",
        "dense model",
    ),
    "parallelism.expert_tensor_parallel_degree": refused(
        NO_EXPERTS,
        {"parallelism.expert_tensor_parallel_degree": 2},
        "[parallelism] expert_tensor_parallel_degree = 2",
        "dense model",
    ),
    "parallelism.expert_parallel_comm_backend": inert(
        NO_EXPERTS, {"parallelism.expert_parallel_comm_backend": "deepep"}
    ),
    # [checkpoint]
    "checkpoint.enable": works("model, optimizer and data position", A),
    "checkpoint.enable_ft_dataloader_checkpoints": inert(
        FT_ONLY, {"checkpoint.enable_ft_dataloader_checkpoints": False}
    ),
    "checkpoint.folder": works("", A),
    "checkpoint.interval": works("", A),
    "checkpoint.initial_load_path": works("", B),
    "checkpoint.initial_load_model_only": works("", B),
    "checkpoint.initial_load_in_hf": refused(
        "needs the safetensors package, which torchtitan-wlb does not install: refused without it",
        {"checkpoint.initial_load_in_hf": True},
        "[checkpoint] initial_load_in_hf",
        "pip install safetensors",
        needs_missing="safetensors",
    ),
    "checkpoint.initial_load_in_hf_quantized": refused(
        "Llama 3's state-dict adapter cannot read quantized Hugging Face checkpoints",
        {"checkpoint.initial_load_in_hf_quantized": True},
        "[checkpoint] initial_load_in_hf_quantized",
        "cannot load quantized",
    ),
    "checkpoint.last_save_model_only": differs(
        "TorchTitan's default: a rerun with more steps resumes from the full checkpoint before "
        "the model-only last one",
        A,
        SMOKE + "test_resume_after_a_model_only_last_checkpoint",
    ),
    "checkpoint.last_save_in_hf": refused(
        "needs the safetensors package, which torchtitan-wlb does not install: refused without it",
        {"checkpoint.last_save_in_hf": True},
        "[checkpoint] last_save_in_hf",
        "pip install safetensors",
        needs_missing="safetensors",
    ),
    "checkpoint.export_dtype": works("applies to a model-only last checkpoint", A),
    "checkpoint.async_mode": works("", A),
    "checkpoint.keep_latest_k": works(
        "0 (all) or >= 2 (TorchTitan's minimum)",
        A,
        refuse={"checkpoint.keep_latest_k": 1},
        expect=("[checkpoint] keep_latest_k = 1",),
    ),
    "checkpoint.load_step": differs(
        "a model-only step is refused at start, naming the full one to load",
        "test:tests/test_bad_input.py::test_resume_from_a_model_only_checkpoint_is_refused",
    ),
    "checkpoint.exclude_from_loading": works("", B),
    "checkpoint.enable_first_step_checkpoint": works("", A),
    "checkpoint.create_seed_checkpoint": works("", E2E + " --checkpoint.create_seed_checkpoint"),
    "checkpoint.load_only": works("", B),
    # [activation_checkpoint]
    "activation_checkpoint.mode": works(
        "full and selective; memory_budget needs [compile]",
        A,
        B,
        refuse={"activation_checkpoint.mode": "memory_budget"},
        expect=('[activation_checkpoint] mode = "memory_budget"', "compiled"),
    ),
    "activation_checkpoint.selective_ac_option": works(
        '"op" or a layer interval',
        A,
        refuse={
            "activation_checkpoint.mode": "selective",
            "activation_checkpoint.selective_ac_option": "x",
        },
        expect=("[activation_checkpoint] selective_ac_option = 'x'",),
    ),  # fmt: skip
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": works("", A),
    "activation_checkpoint.early_stop": works("", A),
    "activation_checkpoint.memory_budget": inert(
        'read only with mode = "memory_budget", which needs [compile]',
        {"activation_checkpoint.memory_budget": 0.3},
    ),
    "activation_checkpoint.visualize_memory_budget_pareto": inert(
        'read only with mode = "memory_budget", which needs [compile]',
        {"activation_checkpoint.visualize_memory_budget_pareto": True},
    ),
    "activation_checkpoint.preserve_rng_state": works("", A),
    "activation_checkpoint.determinism_check": works("", A),
    "activation_checkpoint.debug": works(
        "not with per-operator selective checkpointing (torch's limit)",
        B,
        refuse={
            "activation_checkpoint.mode": "selective",
            "activation_checkpoint.selective_ac_option": "op",
            "activation_checkpoint.debug": True,
        },
        expect=("[activation_checkpoint] debug = true", "per-operator"),
    ),  # fmt: skip
    # [compile]
    "compile.enable": differs(
        "the blocks and the loss compile, the attention running as custom ops with the packed "
        "length dynamic (docs/compile.md); under TP's loss parallelism the loss runs eagerly; "
        "refused in one line with the zero-bubble schedules",
        COMPILE,
        E2E,
        refuse={
            "compile.enable": True,
            "parallelism.pipeline_parallel_degree": 2,
            "parallelism.pipeline_parallel_schedule": "ZBVZeroBubble",
        },
        expect=("[compile] enable = true", "zero-bubble"),
    ),
    "compile.components": works("", "test:tests/test_config.py::test_layout_checks components"),
    "compile.backend": works("", COMPILE),
    # [quantize]
    "quantize.linear.float8.enable_fsdp_float8_all_gather": inert(
        QUANTIZE, {"quantize.linear.float8.enable_fsdp_float8_all_gather": True}
    ),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": inert(
        QUANTIZE, {"quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": True}
    ),
    "quantize.linear.float8.recipe_name": inert(
        QUANTIZE, {"quantize.linear.float8.recipe_name": "rowwise"}
    ),
    "quantize.linear.float8.filter_fqns": inert(
        QUANTIZE, {"quantize.linear.float8.filter_fqns": ["output"]}
    ),
    "quantize.linear.float8.emulate": inert(QUANTIZE, {"quantize.linear.float8.emulate": True}),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": inert(
        QUANTIZE, {"quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": "torch"}
    ),
    "quantize.linear.mx.recipe_name": inert(
        QUANTIZE, {"quantize.linear.mx.recipe_name": "mxfp8_cublas_rceil"}
    ),
    "quantize.linear.mx.filter_fqns": inert(QUANTIZE, {"quantize.linear.mx.filter_fqns": []}),
    "quantize.grouped_mm.float8.fqns": inert(
        QUANTIZE, {"quantize.grouped_mm.float8.fqns": ["experts"]}
    ),
    "quantize.grouped_mm.mx.recipe_name": inert(
        QUANTIZE, {"quantize.grouped_mm.mx.recipe_name": "mxfp8"}
    ),
    "quantize.grouped_mm.mx.fqns": inert(QUANTIZE, {"quantize.grouped_mm.mx.fqns": ["experts"]}),
    # [comm]
    "comm.init_timeout_seconds": works("", A),
    "comm.train_timeout_seconds": works("", A),
    "comm.trace_buf_size": inert(NCCL, {"comm.trace_buf_size": 0}),
    "comm.save_traces_folder": inert(NCCL, {"comm.save_traces_folder": "traces"}),
    "comm.save_traces_file_prefix": inert(NCCL, {"comm.save_traces_file_prefix": "r"}),
    "comm.mode": differs(
        "fake_backend: rank 0 of NGPU ranks in one process (one step unless `--training.steps` "
        "is given); local_tensor: builds the trainer "
        "and stops, as TorchTitan trains no step in that mode",
        DRY_RUN + "test_fake_backend_step_of_debug_config COMM_MODE",
        DRY_RUN + "test_local_tensor_build_of_debug_config COMM_MODE",
    ),
    # [memory_estimation]
    "memory_estimation.enable": inert(UNREAD, {"memory_estimation.enable": True}),
    "memory_estimation.disable_fake_mode": inert(
        UNREAD, {"memory_estimation.disable_fake_mode": True}
    ),
    # [fault_tolerance]
    "fault_tolerance.enable": refused(
        "TorchFT's replica groups change the DP degree the packing plan is computed for",
        {"fault_tolerance.enable": True},
        "[fault_tolerance] enable = true",
        "not supported",
    ),
    "fault_tolerance.process_group": inert(FT_ONLY, {"fault_tolerance.process_group": "nccl"}),
    "fault_tolerance.process_group_timeout_ms": inert(
        FT_ONLY, {"fault_tolerance.process_group_timeout_ms": 1000}
    ),
    "fault_tolerance.replica_id": inert(FT_ONLY, {"fault_tolerance.replica_id": 1}),
    "fault_tolerance.group_size": inert(FT_ONLY, {"fault_tolerance.group_size": 2}),
    "fault_tolerance.min_replica_size": inert(FT_ONLY, {"fault_tolerance.min_replica_size": 2}),
    "fault_tolerance.semi_sync_method": inert(
        FT_ONLY, {"fault_tolerance.semi_sync_method": "diloco"}
    ),
    # [experimental]
    "experimental.custom_import": works(
        "every config in train_configs/ sets torchtitan_wlb.train_spec: it registers llama3_wlb",
        "toml",
    ),
    "experimental.custom_args_module": differs(
        "TorchTitan's deprecated alias of [job] custom_config_module",
        accept={"experimental.custom_args_module": "torchtitan_wlb.config"},
    ),
    # [validation]
    "validation.enable": works(
        "held-out documents packed as training packs them, under every layout (docs/validation.md)",
        VAL_E2E,
        "test:tests/test_train_smoke.py::test_fsdp_trains_checkpoints_and_resumes_exactly",
    ),
    "validation.dataset": differs(
        "any source [training] dataset takes; 'wlb_builtin_validation' is the built-in corpus's "
        "held-out split; TorchTitan's c4_validation is refused",
        "test:tests/test_validation.py::test_validation_refusals_are_one_line",
    ),
    "validation.dataset_path": works(
        "", "test:tests/test_validation.py::test_validation_refusals_are_one_line"
    ),
    "validation.local_batch_size": differs(
        "with steps and seq_len it sizes the held-out set: steps x local_batch_size x seq_len "
        "tokens, packed whole documents, dealt over the data-parallel ranks",
        "toml",
    ),
    "validation.seq_len": differs(
        "the longest packed held-out sequence (documents masked apart)", VAL_E2E
    ),
    "validation.freq": works("", VAL_E2E),
    "validation.steps": differs(
        "sizes the held-out set (see local_batch_size); -1 reads the whole source", VAL_E2E
    ),
    "validation.dataloader.num_workers": inert(
        HELDOUT_IN_PROCESS, {"validation.dataloader.num_workers": 2}
    ),
    "validation.dataloader.persistent_workers": inert(
        HELDOUT_IN_PROCESS, {"validation.dataloader.persistent_workers": True}
    ),
    "validation.dataloader.pin_memory": inert(
        HELDOUT_IN_PROCESS, {"validation.dataloader.pin_memory": True}
    ),
    "validation.dataloader.prefetch_factor": inert(
        HELDOUT_IN_PROCESS, {"validation.dataloader.prefetch_factor": 4}
    ),
    # [debug]
    "debug.seed": works("", A),
    "debug.deterministic": works("", A),
    "debug.deterministic_warn_only": works("", A),
    "debug.moe_force_load_balance": inert(NO_EXPERTS, {"debug.moe_force_load_balance": True}),
}

DOC = os.path.join(ROOT, "docs", "getting_started.md")
BEGIN = "<!-- options table: python tests/option_table.py --write -->"
END = "<!-- end of the options table -->"


def render_markdown() -> str:
    """The options table of docs/getting_started.md: one row per option, in TorchTitan's order
    (options of one table with the same status and note share a row)."""
    lines = ["| option | under torchtitan-wlb | notes |", "|---|---|---|"]
    groups: list[tuple[list[str], Row]] = []
    for name, row in TABLE.items():
        section = name.rpartition(".")[0]
        last = groups[-1] if groups else None
        same = last and last[0][0].rpartition(".")[0] == section
        if same and (last[1].status, last[1].note) == (row.status, row.note):
            last[0].append(name)
        else:
            groups.append(([name], row))
    for names, row in groups:
        shown = ", ".join(f"`{n}`" for n in names)
        lines.append(f"| {shown} | {STATUS_LABELS[row.status]} | {row.note} |")
    return "\n".join(lines) + "\n"


def doc_table(text: str) -> str:
    """The part of ``text`` between the table's markers."""
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    return match.group(1) if match else ""


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        with open(DOC) as f:
            text = f.read()
        start, end = text.index(BEGIN) + len(BEGIN) + 1, text.index(END)
        with open(DOC, "w") as f:
            f.write(text[:start] + render_markdown() + text[end:])
    else:
        print(render_markdown(), end="")
