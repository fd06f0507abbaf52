"""Packers: turn a document stream into N micro-batches per optimizer step.

Pure Python/NumPy (no torch.distributed). Every packer is deterministic, so every data-parallel
rank computes the same global plan from the same stream. See docs/packing.md.

:data:`~torchtitan_wlb.packing.registry.PACKERS` is the one registry of packer names: the ``[wlb] packing`` choices, the tools'
``--packer`` choices and the simulator's modes all come from it.
"""

from __future__ import annotations

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing.base import DocPool, PackedStep, Packer, PackingConfig
from torchtitan_wlb.packing.driver import LengthStream, drain, drive, next_plan
from torchtitan_wlb.packing.fixed_greedy import FixedGreedyPacker
from torchtitan_wlb.packing.original import OriginalPacker
from torchtitan_wlb.packing.registry import PACKERS, build_packer, packer_class, packing_config
from torchtitan_wlb.packing.solver import SolverPacker
from torchtitan_wlb.packing.tuning import TuneResult, tune_queues
from torchtitan_wlb.packing.wlb import WLBPacker, WLBPaperPacker, default_smax, default_thresholds

__all__ = [
    "PACKERS",
    "CostModel",
    "DocPool",
    "FixedGreedyPacker",
    "LengthStream",
    "OriginalPacker",
    "PackedStep",
    "Packer",
    "PackingConfig",
    "SolverPacker",
    "TuneResult",
    "WLBPacker",
    "WLBPaperPacker",
    "build_packer",
    "default_smax",
    "default_thresholds",
    "drain",
    "drive",
    "next_plan",
    "packer_class",
    "packing_config",
    "tune_queues",
]
