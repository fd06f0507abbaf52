"""Loss normalisation for variable-length micro-batches: the mean over all tokens of the batch.

A per-micro-batch mean would weight a short micro-batch's tokens more than a long one's, so each
summed loss is divided by the global batch's valid-token count (docs/pipeline.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# torch's and torchtitan's ignored label, written here rather than imported: importing torchtitan
# before cpu_support.activate() binds its device type (validate imports this module first).
IGNORE_INDEX = -100


def count_valid_tokens(
    labels: torch.Tensor | Sequence[torch.Tensor], ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Number of labels != ``ignore_index`` over one tensor or all micro-batches (int64 scalar)."""
    if isinstance(labels, torch.Tensor):
        return (labels != ignore_index).sum(dtype=torch.int64)
    if len(labels) == 0:
        raise ValueError("labels is an empty sequence; pass at least one label tensor")
    return torch.stack([(t != ignore_index).sum(dtype=torch.int64) for t in labels]).sum()


def global_valid_tokens(
    local_count: torch.Tensor | int,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A rank's valid-token count summed over ``group`` (a process group or 1-D device mesh;
    None: the default group, or the local count when no process group exists), on ``device``.

    Count before CP sharding and reduce over the DP ranks, or after it and reduce over DP x CP;
    never include PP ranks (they hold the same micro-batches).
    """
    count = torch.as_tensor(local_count, dtype=torch.int64, device=device).clone()
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group must be a 1-D DeviceMesh (flatten it first), got one with "
                f"{group.ndim} dims {group.mesh_dim_names}"
            )
        group = group.get_group()
    if group is None and not dist.is_initialized():
        return count
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count


def token_mean_loss(
    loss_sum_fn: Callable[..., torch.Tensor], global_count: torch.Tensor | int
) -> Callable[..., torch.Tensor]:
    """``loss_sum_fn(pred, target) / global_count`` for a sum-reduced loss; the count is clamped
    to 1, so a global batch with no valid token gives loss 0 instead of NaN."""
    denominator = torch.as_tensor(global_count).clamp(min=1)

    def loss_fn(pred: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        return loss_sum_fn(pred, target, **kwargs) / denominator

    return loss_fn
