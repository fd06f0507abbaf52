"""One call for the trainer: plan a packed micro-batch and cut out this CP rank's share.

TorchTitan's ``post_dataloading_process`` shards inputs/labels/positions with its own head-tail
balancer and cannot see document boundaries; a trainer running per-document CP replaces that step
with :func:`shard_micro_batch`, which returns the local inputs, labels, RoPE positions and the
attention metadata the model's attention layers pass to ``attention_from_metadata``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchtitan_wlb.attention.metadata import DocumentAttentionMetadata
from torchtitan_wlb.cp.op import resolve_cp_group
from torchtitan_wlb.cp.plan import CPPlan, build_cp_plan

__all__ = ["CPShard", "shard_micro_batch"]


@dataclass
class CPShard:
    """This rank's share of one packed micro-batch.

    Attributes:
        inputs: ``[1, local_len]`` token ids, in the plan's local layout.
        labels: ``[1, local_len]`` targets of those tokens (sharded with the same indices).
        positions: ``[1, local_len]`` RoPE positions (per document, or global when
            ``reset_positions=False``).
        attention_masks: metadata for the model's ``attention_masks`` kwarg (``cp`` set).
        plan: the micro-batch's plan (``plan.strategy`` says what adaptive chose).
        num_tokens: tokens of the whole micro-batch (normalise a summed loss by the global count:
            local lengths differ by up to two tokens across CP ranks).
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    attention_masks: DocumentAttentionMetadata
    plan: CPPlan
    num_tokens: int


def shard_micro_batch(
    doc_lens: np.ndarray | torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    cp_mesh_or_group: Any,
    *,
    strategy: str = "adaptive",
    profile: Any = None,
    backend: str = "auto",
    reset_positions: bool = True,
    device: torch.device | str | None = None,
) -> CPShard:
    """Plan ``doc_lens`` over the CP group and return this rank's inputs, labels, positions, metadata.

    Args:
        doc_lens: document lengths of the micro-batch (sum = ``inputs.shape[-1]``).
        inputs, labels: ``[1, T]`` (or ``[T]``) tensors of the packed micro-batch.
        cp_mesh_or_group: TorchTitan's CP mesh (``world_mesh["cp"]``), a mesh with a ``"cp"``
            dimension, or the CP ProcessGroup.
        strategy: ``"per_sequence" | "per_document" | "adaptive"`` (``[wlb] cp_sharding``).
        profile: throughput table for adaptive (path or ``CPProfile``; ``None``: packaged default).
        backend: attention backend (``[wlb] attention_backend``).
        reset_positions: per-document RoPE positions (``[wlb] reset_positions``).
        device: where the metadata index tensors go (default: the device of ``inputs``).
    """
    if isinstance(doc_lens, torch.Tensor):
        doc_lens = doc_lens.detach().cpu().numpy()
    if inputs.shape != labels.shape:
        raise ValueError(
            f"inputs and labels must have the same shape; got {tuple(inputs.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if strategy == "adaptive" and profile in (None, "") and inputs.device.type == "cuda":
        warnings.warn(
            "adaptive CP sharding is using the packaged CPU throughput profile on CUDA; measure one "
            "for your GPU (python -m torchtitan_wlb.tools.cp_profile --device cuda --out FILE) and "
            "set [wlb] cp_profile = FILE",
            stacklevel=2,
        )
    group = resolve_cp_group(cp_mesh_or_group)
    rank = torch.distributed.get_rank(group)
    plan = build_cp_plan(
        doc_lens,
        torch.distributed.get_world_size(group),
        strategy,
        profile,
        seq_len=int(inputs.shape[-1]),
    )
    device = inputs.device if device is None else torch.device(device)
    tokens, positions = plan.rank_indices(rank)
    index = torch.from_numpy(tokens).to(inputs.device)
    pos = torch.from_numpy(positions if reset_positions else tokens).to(inputs.device)
    cp_meta = plan.attention_metadata(rank, group, device=device)
    meta = DocumentAttentionMetadata(
        cu_seqlens=torch.zeros(1, dtype=torch.int32, device=device),  # unused under CP
        max_seqlen=int(plan.doc_lens.max()),
        backend=backend,
        cp=cp_meta,
    )
    lead = (1,) * (inputs.dim() - 1)
    return CPShard(
        inputs=inputs.index_select(-1, index),
        labels=labels.index_select(-1, index),
        positions=pos.view(*lead, -1) if lead else pos,
        attention_masks=meta,
        plan=plan,
        num_tokens=plan.seq_len,
    )
