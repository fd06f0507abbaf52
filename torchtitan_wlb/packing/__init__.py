"""Packers: a document stream into N micro-batches per optimizer step, pure NumPy and
deterministic (every data-parallel rank computes the same plan). See docs/packing.md."""

from __future__ import annotations

from torchtitan_wlb.packing.base import Packer, PackingConfig
from torchtitan_wlb.packing.driver import LengthStream, drain, drive, next_plan
from torchtitan_wlb.packing.fixed import OriginalPacker
from torchtitan_wlb.packing.registry import PACKERS, build_packer, packing_config
from torchtitan_wlb.packing.tuning import tune_queues

__all__ = [
    "PACKERS",
    "LengthStream",
    "OriginalPacker",
    "Packer",
    "PackingConfig",
    "build_packer",
    "drain",
    "drive",
    "next_plan",
    "packing_config",
    "tune_queues",
]
