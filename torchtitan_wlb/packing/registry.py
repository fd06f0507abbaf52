"""The one packer registry: names, classes and the one way to build a packer's configuration
(its own module so that ``packing/`` can build packers by name without importing its package)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing.base import Packer, PackingConfig
from torchtitan_wlb.packing.fixed_greedy import FixedGreedyPacker
from torchtitan_wlb.packing.original import OriginalPacker
from torchtitan_wlb.packing.solver import SolverPacker
from torchtitan_wlb.packing.wlb import WLBPacker, WLBPaperPacker

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
    """The :class:`PackingConfig` of packer ``packer``, for the loader, the tools and the simulator.

    ``smax`` is left unset for the fixed-length packers (they cap at ``context_len``).
    ``queue_thresholds``: empty for no outlier queues, None to derive them from the cost model.
    ``knobs``: other fields; those not given keep the defaults, which are the ``[wlb]`` section's.
    """
    return PackingConfig(
        micro_batches=micro_batches,
        context_len=context_len,
        smax=smax if packer_class(packer).variable_length else None,
        queue_thresholds=None if queue_thresholds is None else tuple(queue_thresholds),
        **knobs,
    )
