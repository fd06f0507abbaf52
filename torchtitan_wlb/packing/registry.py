"""The one packer registry (its own module so that ``packing/`` can build packers by name without
importing its package); see docs/packing.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing.base import Packer, PackingConfig
from torchtitan_wlb.packing.fixed import FixedGreedyPacker, OriginalPacker, SolverPacker
from torchtitan_wlb.packing.wlb import WLBPacker, WLBPaperPacker

PACKERS: dict[str, type[Packer]] = {
    cls.name: cls
    for cls in (OriginalPacker, FixedGreedyPacker, SolverPacker, WLBPacker, WLBPaperPacker)
}
"""Packer name -> class, in the order the documentation lists them."""


def packer_class(name: str) -> type[Packer]:
    if name not in PACKERS:
        raise ValueError(f"unknown packer {name!r}; choose one of {', '.join(PACKERS)}")
    return PACKERS[name]


def build_packer(name: str, config: PackingConfig, cost_model: CostModel) -> Packer:
    return packer_class(name)(config, cost_model)


def packing_config(
    packer: str,
    micro_batches: int,
    context_len: int,
    *,
    smax: int | None = None,
    queue_thresholds: Sequence[int] | None = None,
    **knobs: Any,
) -> PackingConfig:
    """The :class:`PackingConfig` of packer ``packer``: ``smax`` is dropped for the fixed-length
    packers; ``knobs`` are other fields (unset ones keep their defaults, the ``[wlb]`` section's)."""
    return PackingConfig(
        micro_batches=micro_batches,
        context_len=context_len,
        smax=smax if packer_class(packer).variable_length else None,
        queue_thresholds=None if queue_thresholds is None else tuple(queue_thresholds),
        **knobs,
    )
