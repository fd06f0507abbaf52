"""Builds the packing node of the data pipeline from a job config.

Maps the ``[wlb]`` fields onto :class:`~torchtitan_wlb.packing.PackingConfig`, picks the packer and
wraps it in :class:`~torchtitan_wlb.data.wlb_node.WLBPackingNode`. The cost model comes from the
caller (the train spec derives it from the model flavor), because the data layer does not know the
model.
"""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

from torchtitan_wlb.cost_fit import CostModelSchedule
from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.data.wlb_node import WLBPackingNode
from torchtitan_wlb.packing import PackingConfig, build_packer, packing_config

# [wlb] field -> PackingConfig field, for the knobs passed through unchanged.
WLB_KNOBS = {
    "max_delay_steps": "max_wait",
    "adaptive_max_delay_steps": "adaptive_max_wait",
    "delay_target": "delay_target",
    "balance_target": "balance_target",
    "release_slack": "release_slack",
    "packing_window": "window",
}


def packing_config_from_job(job_config: Any, num_micro_batches: int) -> PackingConfig:
    """The packers' configuration for this job (N micro-batches per step across DP ranks)."""
    wlb = job_config.wlb
    return packing_config(
        wlb.packing,
        num_micro_batches,
        job_config.training.seq_len,
        smax=wlb.micro_batch_max_len or None,
        queue_thresholds=wlb.queue_thresholds or None,
        # Training bounds the solver by work (every rank must compute the same plan) with a
        # generous time limit as a safety net; PackingConfig's defaults (time only) are the
        # one-process benchmarks'.
        solver_node_limit=wlb.solver_node_limit,
        solver_time_limit=wlb.solver_time_limit_s,
        **{dst: getattr(wlb, src) for src, dst in WLB_KNOBS.items()},
    )


def build_packing_node(
    documents: BaseNode,
    job_config: Any,
    *,
    num_micro_batches: int,
    dp_rank: int,
    dp_world_size: int,
    cost_model: CostModel,
    schedule: CostModelSchedule | None = None,
) -> WLBPackingNode:
    """The node yielding one item per optimizer step with this DP rank's micro-batches.

    ``schedule``: the online cost model's (``[wlb] cost_model = "online"``), else None."""
    config = packing_config_from_job(job_config, num_micro_batches)
    packer = build_packer(job_config.wlb.packing, config, cost_model)
    return WLBPackingNode(
        documents, packer, dp_rank=dp_rank, dp_degree=dp_world_size, schedule=schedule
    )
