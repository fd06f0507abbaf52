"""This rank's share of a CP plan as tensors: its tokens of any tensor, and the CP op's metadata,
checked against the process group (the plan itself is NumPy, and knows no torch).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_wlb.cp.op import CPAttentionMetadata
from torchtitan_wlb.cp.plan import CPPlan


def shard_tensor(plan: CPPlan, rank: int, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Keep ``rank``'s tokens of ``tensor`` along ``dim`` (default: last dim, e.g. ``[1, T]``), in
    the plan's local layout."""
    if tensor.shape[dim] != plan.seq_len:
        raise ValueError(
            f"tensor has {tensor.shape[dim]} tokens along dim {dim}, the plan covers "
            f"{plan.seq_len}; shape {tuple(tensor.shape)}"
        )
    index = torch.from_numpy(plan.token_indices(rank)).to(tensor.device)
    return tensor.index_select(dim, index)


def resolve_cp_group(mesh_or_group: Any) -> dist.ProcessGroup:
    """The CP process group from a ProcessGroup, a 1-D DeviceMesh, or a DeviceMesh with a ``"cp"``
    dimension (TorchTitan names its context-parallel mesh dimension ``"cp"``)."""
    if isinstance(mesh_or_group, dist.ProcessGroup):
        return mesh_or_group
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim == 1:
            return mesh_or_group.get_group()
        names = mesh_or_group.mesh_dim_names or ()
        if "cp" in names:
            return mesh_or_group.get_group("cp")
        raise ValueError(
            f"a {mesh_or_group.ndim}-D DeviceMesh needs a 'cp' dimension; got names {names}"
        )
    raise ValueError(
        f"expected a ProcessGroup or DeviceMesh for the CP group; got {type(mesh_or_group)}"
    )


def build_cp_attention_metadata(
    plan: CPPlan, rank: int, mesh_or_group: Any, device: torch.device | str | None = None
) -> CPAttentionMetadata:
    """The CP op's metadata for ``rank`` (its index in the CP group of ``mesh_or_group``, see
    :func:`resolve_cp_group`) under ``plan``, index tensors on ``device`` (default: CPU)."""
    group = resolve_cp_group(mesh_or_group)
    size = dist.get_world_size(group)
    if size != plan.cp_degree:
        raise ValueError(f"CP group has {size} ranks, the plan was built for {plan.cp_degree}")
    own = dist.get_rank(group)
    if own != rank:
        raise ValueError(f"rank {rank} was asked for, but this process is rank {own} of the group")
    device = torch.device("cpu") if device is None else torch.device(device)

    def to_dev(value: Any) -> Any:
        """The spec's arrays (alone or in ``(head, tail)`` pairs) as tensors; sizes unchanged."""
        if isinstance(value, tuple):
            return tuple(to_dev(x) for x in value)
        if isinstance(value, np.ndarray):
            return torch.from_numpy(value).to(device, non_blocking=True)
        return value

    spec = vars(plan.local_attention_spec(rank))
    return CPAttentionMetadata(
        group.group_name,
        rank,
        plan.cp_degree,
        int(plan.local_lens[rank]),
        plan.max_gather_len,
        to_dev(plan.kv_order()),
        **{name: to_dev(value) for name, value in spec.items()},
    )
