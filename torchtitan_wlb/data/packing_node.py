"""Builds the packing node of the data pipeline from a job config.

Maps the ``[wlb]`` fields onto :class:`~torchtitan_wlb.packing.PackingConfig`, picks the packer and
wraps it in :class:`~torchtitan_wlb.data.wlb_node.WLBPackingNode`. The cost model comes from the
caller (the train spec derives it from the model flavor), because the data layer does not know the
model.
"""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.data.wlb_node import WLBPackingNode
from torchtitan_wlb.packing import PackingConfig, build_packer


def packing_config_from_job(job_config: Any, num_micro_batches: int) -> PackingConfig:
    """The packers' configuration for this job (N micro-batches per step across DP ranks)."""
    wlb = job_config.wlb
    variable = wlb.packing in ("wlb", "wlb_paper")
    return PackingConfig(
        micro_batches=num_micro_batches,
        context_len=job_config.training.seq_len,
        # Only the variable-length packers may exceed the context length.
        smax=(wlb.micro_batch_max_len or None) if variable else None,
        queue_thresholds=tuple(wlb.queue_thresholds) or None,
        max_wait=wlb.max_delay_steps,
        adaptive_max_wait=wlb.adaptive_max_delay_steps,
        delay_target=wlb.delay_target,
        balance_target=wlb.balance_target,
        release_slack=wlb.release_slack,
        window=wlb.packing_window,
        solver_time_limit=wlb.solver_time_limit_s,
    )


def build_packing_node(
    documents: BaseNode,
    job_config: Any,
    *,
    num_micro_batches: int,
    dp_rank: int,
    dp_world_size: int,
    cost_model: CostModel,
) -> WLBPackingNode:
    """The node yielding one item per optimizer step with this DP rank's micro-batches."""
    config = packing_config_from_job(job_config, num_micro_batches)
    packer = build_packer(job_config.wlb.packing, config, cost_model)
    return WLBPackingNode(documents, packer, dp_rank=dp_rank, dp_degree=dp_world_size)
