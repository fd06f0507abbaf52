"""Packers: turn a document stream into N micro-batches per optimizer step.

Pure Python/NumPy (no torch.distributed). Every packer is deterministic, so every data-parallel
rank computes the same global plan from the same stream. See docs/packing.md.
"""

from __future__ import annotations

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing.base import DocPool, PackedStep, Packer, PackingConfig
from torchtitan_wlb.packing.fixed_greedy import FixedGreedyPacker
from torchtitan_wlb.packing.original import OriginalPacker
from torchtitan_wlb.packing.tuning import TuneResult, tune_queues
from torchtitan_wlb.packing.wlb import WLBPacker, WLBPaperPacker, default_smax, default_thresholds

__all__ = [
    "PACKERS",
    "CostModel",
    "DocPool",
    "FixedGreedyPacker",
    "OriginalPacker",
    "PackedStep",
    "Packer",
    "PackingConfig",
    "TuneResult",
    "WLBPacker",
    "WLBPaperPacker",
    "build_packer",
    "default_smax",
    "default_thresholds",
    "tune_queues",
]

PACKERS = ("original", "fixed_greedy", "solver", "wlb", "wlb_paper")


def build_packer(name: str, config: PackingConfig, cost_model: CostModel) -> Packer:
    """The packer called ``name`` (one of :data:`PACKERS`)."""
    if name == "original":
        return OriginalPacker(config, cost_model)
    if name == "fixed_greedy":
        return FixedGreedyPacker(config, cost_model)
    if name == "solver":
        from torchtitan_wlb.packing.solver import SolverPacker  # imports highspy

        return SolverPacker(config, cost_model)
    if name == "wlb":
        return WLBPacker(config, cost_model)
    if name == "wlb_paper":
        return WLBPaperPacker(config, cost_model)
    raise ValueError(f"unknown packer {name!r}; choose one of {', '.join(PACKERS)}")
