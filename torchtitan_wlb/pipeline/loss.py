"""Loss normalisation for variable-length micro-batches: the mean over all tokens of the batch.

WLB-LLM's micro-batches have different token counts. Averaging per micro-batch (or scaling by
the number of micro-batches) would give a token of a short micro-batch more weight than one of a
long micro-batch. Instead every micro-batch's loss is its *sum* over tokens divided by the valid
token count of the whole global batch (all micro-batches of the step on all DP ranks), so the
summed loss -- and its gradient -- equal single-device training on the same documents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "IGNORE_INDEX",
    "count_valid_tokens",
    "global_valid_tokens",
    "token_mean_loss",
]

# Label value excluded from the loss and from the token count: torch's and torchtitan's default,
# written here rather than imported, because importing torchtitan before
# cpu_support.activate() binds its device type (validate imports this module first).
IGNORE_INDEX = -100


def count_valid_tokens(
    labels: torch.Tensor | Sequence[torch.Tensor], ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Number of labels != ``ignore_index`` over one tensor or all micro-batches (int64 scalar)."""
    if isinstance(labels, torch.Tensor):
        return (labels != ignore_index).sum(dtype=torch.int64)
    if len(labels) == 0:
        raise ValueError("labels is an empty sequence; pass at least one label tensor")
    counts = [(t != ignore_index).sum(dtype=torch.int64) for t in labels]
    return torch.stack(counts).sum()


def global_valid_tokens(
    local_count: torch.Tensor | int,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """All-reduce (sum) a rank's valid-token count over the data-parallel ranks.

    Count the labels of all this DP rank's micro-batches of the step *before* CP sharding and
    reduce over the DP ranks only (torchtitan's ``"batch"`` mesh); or count after CP sharding
    and reduce over DP x CP (the ``"loss"`` mesh). PP ranks of one pipeline hold the same
    micro-batches, so they must not be in the group. ``group=None`` with no process group
    initialised (single process) returns the local count.

    Args:
        local_count: this rank's count (see :func:`count_valid_tokens`).
        group: the process group or 1-D device mesh to reduce over; ``None`` = default group.
        device: where the reduction happens (the communication backend's device); defaults to
            ``local_count``'s device.

    Returns:
        The global count as an int64 scalar tensor on ``device``.
    """
    count = torch.as_tensor(local_count, dtype=torch.int64)
    if device is not None:
        count = count.to(device)
    count = count.clone()
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
    """``loss_sum_fn(pred, target) / global_count``: a sum-reduced loss made a global token mean.

    ``loss_sum_fn`` must reduce with ``sum`` (torchtitan's ``cross_entropy_loss`` does). A
    global batch with no valid token gives loss 0 (the count is clamped to 1) instead of NaN.
    ``VarlenPipelineRunner.step(..., global_valid_tokens=...)`` wraps the schedule's loss with it.
    """
    denominator = torch.as_tensor(global_count).clamp(min=1)

    def loss_fn(pred: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        return loss_sum_fn(pred, target, **kwargs) / denominator

    return loss_fn
