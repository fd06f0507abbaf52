"""The packer registry: names, classes and the one way to build a packer's configuration.

Its own module, below :mod:`~torchtitan_wlb.packing.tuning` and the package ``__init__``, so that
everything in ``packing/`` can build packers by name without importing the package it is part of.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing.base import Packer, PackingConfig
from torchtitan_wlb.packing.fixed_greedy import FixedGreedyPacker
from torchtitan_wlb.packing.original import OriginalPacker
from torchtitan_wlb.packing.solver import SolverPacker
from torchtitan_wlb.packing.wlb import WLBPacker, WLBPaperPacker

__all__ = ["PACKERS", "build_packer", "packer_class", "packing_config"]

PACKERS: dict[str, type[Packer]] = {
    cls.name: cls
    for cls in (OriginalPacker, FixedGreedyPacker, SolverPacker, WLBPacker, WLBPaperPacker)
}
"""Packer name -> class, in the order the documentation lists them."""


def packer_class(name: str) -> type[Packer]:
    """The class of the packer called ``name`` (one of :data:`PACKERS`)."""
    if name not in PACKERS:
        raise ValueError(f"unknown packer {name!r}; choose one of {', '.join(PACKERS)}")
    return PACKERS[name]


def build_packer(name: str, config: PackingConfig, cost_model: CostModel) -> Packer:
    """The packer called ``name`` (one of :data:`PACKERS`)."""
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
    """The configuration of packer ``packer``: the one place the loader, the tools and the
    simulator build a :class:`PackingConfig`.

    ``smax`` applies to the variable-length packers only; the fixed-length ones cap micro-batches
    at ``context_len`` whatever is given, so theirs is left unset. ``queue_thresholds``: any
    sequence (empty: no outlier queues) or None (derived from the cost model). ``knobs``: the
    other :class:`PackingConfig` fields; those not given keep the dataclass defaults, which are
    the ``[wlb]`` section's defaults.
    """
    return PackingConfig(
        micro_batches=micro_batches,
        context_len=context_len,
        smax=smax if packer_class(packer).variable_length else None,
        queue_thresholds=None if queue_thresholds is None else tuple(queue_thresholds),
        **knobs,
    )
