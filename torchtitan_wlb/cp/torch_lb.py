"""This project's CP plans as a torch ``_LoadBalancer``, for CP code written against torch's API
(torch's own balancers, measured against the plans, are cp_bench's: tools/torch_balancers.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

try:  # a private torch interface: importing this module must not depend on it
    from torch.distributed.tensor.experimental._context_parallel import _LoadBalancer
except ImportError:  # pragma: no cover - torch releases without it (checked on the GPU's 2.11)
    _LoadBalancer = object  # type: ignore[assignment,misc]

from torchtitan_wlb.cp.plan import CPPlan, draft_sharding, validate_doc_lens


class PlanLoadBalancer(_LoadBalancer):
    """This project's CP plans (a fixed ``strategy``, one :class:`CPPlan` per batch row in
    ``plans``) behind torch's ``_LoadBalancer`` interface; usage: docs/context_parallel.md."""

    def __init__(
        self,
        seq_length_per_doc: Sequence[Sequence[int]] | np.ndarray,
        world_size: int,
        device: str | torch.device = "cpu",
        strategy: str = "per_document",
        **plan_kwargs: Any,
    ) -> None:
        rows = [validate_doc_lens(np.asarray(r), world_size) for r in seq_length_per_doc]
        if not rows:
            raise ValueError("seq_length_per_doc is empty; give one list of lengths per batch row")
        totals = sorted({int(r.sum()) for r in rows})
        if len(totals) != 1:
            raise ValueError(f"every batch row must hold the same tokens; rows sum to {totals}")
        self.world_size = world_size
        self.device = device
        self.plans: list[CPPlan] = [
            draft_sharding(r, world_size, strategy, **plan_kwargs).plan() for r in rows
        ]
        self.seq_length = world_size * max(p.max_local_len for p in self.plans)

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        """``(B, seq_length)`` int64: the plans' padded rank-major order, or (``restore``) its
        inverse."""
        c, padded = self.world_size, self.seq_length
        out = np.empty((len(self.plans), padded), dtype=np.int64)
        for b, plan in enumerate(self.plans):  # batch rows
            order = out[b]
            filled = (np.arange(padded // c) < plan.local_lens[:, None]).ravel()
            order[filled] = np.concatenate([plan.token_indices(r) for r in range(c)])
            order[~filled] = np.arange(plan.seq_len, padded)
            if restore:
                order[order.copy()] = np.arange(padded)
        return torch.from_numpy(out).to(self.device)
