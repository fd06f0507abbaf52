"""Registers the ``llama3_wlb`` train spec (``[experimental] custom_import``): TorchTitan's Llama 3
machinery with WLB's model, data and metrics."""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.components.loss import build_cross_entropy_loss, cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec
from torchtitan.tools.logging import logger

from torchtitan_wlb.data.dataloader import build_wlb_dataloader
from torchtitan_wlb.data.tokenizer import build_wlb_tokenizer
from torchtitan_wlb.metrics import WLBMetricsProcessor
from torchtitan_wlb.models.llama3_wlb import (
    WLBTransformer,
    cost_model_for_job,
    llama3_wlb_args,
    parallelize_llama_wlb,
    pipeline_llama_wlb,
)
from torchtitan_wlb.validator import build_wlb_validator

TRAIN_SPEC_NAME = "llama3_wlb"


def _build_dataloader(dp_world_size: int, dp_rank: Any, tokenizer: Any, job_config: Any):
    """The document dataloader, balancing with the cost model of the job's model flavor."""
    dp_rank = _concrete_rank(dp_rank)
    cost_model = (
        cost_model_for_job(job_config) if job_config.wlb.advanced.loader == "documents" else None
    )
    return build_wlb_dataloader(dp_world_size, dp_rank, tokenizer, job_config, cost_model)


def _build_validator(**kwargs: Any) -> Any:
    """``[validation]``'s held-out loss (torchtitan_wlb.validator), on a concrete DP rank."""
    return build_wlb_validator(**{**kwargs, "dp_rank": _concrete_rank(kwargs["dp_rank"])})


def _build_loss(job_config: Any, **kwargs: Any) -> Any:
    """TorchTitan's cross-entropy, compiled as TorchTitan compiles it, with the token dimension
    of its inputs marked dynamic: the first compile serves every packed length (as the blocks'
    does, ``mark_lengths_dynamic``), where torch.compile would specialise on the first
    micro-batch's length and recompile for the next. Under TP's loss parallelism the loss runs
    eagerly: torch 2.13 cannot trace its DTensor cross-entropy with a dynamic length (the trace
    recurses without end), and a static one would recompile for every length."""
    compile_cfg, parallelism = job_config.compile, job_config.parallelism
    if not (compile_cfg.enable and "loss" in compile_cfg.components):
        return build_cross_entropy_loss(job_config, **kwargs)
    if parallelism.tensor_parallel_degree > 1 and not parallelism.disable_loss_parallel:
        logger.info(
            "compile: the loss runs eagerly under TP's loss parallelism (torch cannot compile "
            "it for variable lengths); [parallelism] disable_loss_parallel = true compiles it"
        )
        return cross_entropy_loss
    loss_fn = build_cross_entropy_loss(job_config, **kwargs)

    def loss_with_dynamic_lengths(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(pred, 1)
        torch._dynamo.maybe_mark_dynamic(labels, 1)
        return loss_fn(pred, labels)

    return loss_with_dynamic_lengths


def _concrete_rank(dp_rank: Any) -> int:
    """``dp_rank`` as an int. Under ``[comm] mode = "local_tensor"`` one process simulates every
    rank and TorchTitan passes a symbolic rank (a SymInt holding each simulated rank's value);
    TorchTitan only builds the trainer in that mode, without training a step, so the loader is
    built as the first simulated rank's."""
    if isinstance(dp_rank, torch.SymInt):
        from torch.distributed._local_tensor import _map_to_rank_local_val

        return int(_map_to_rank_local_val(dp_rank, 0))
    return dp_rank


try:  # importing this module twice must not register twice
    get_train_spec(TRAIN_SPEC_NAME)
except ValueError:
    register_train_spec(
        TRAIN_SPEC_NAME,
        TrainSpec(
            model_cls=WLBTransformer,
            model_args=llama3_wlb_args,
            parallelize_fn=parallelize_llama_wlb,
            pipelining_fn=pipeline_llama_wlb,
            build_optimizers_fn=build_optimizers,
            build_lr_schedulers_fn=build_lr_schedulers,
            build_dataloader_fn=_build_dataloader,
            build_tokenizer_fn=build_wlb_tokenizer,
            build_loss_fn=_build_loss,
            build_metrics_processor_fn=WLBMetricsProcessor,
            build_validator_fn=_build_validator,
            state_dict_adapter=Llama3StateDictAdapter,
        ),
    )
