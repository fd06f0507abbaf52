"""A 4D step simulator for WLB-LLM: packed micro-batches -> CP shards -> per-layer times -> pipeline.

Entry points: ``python -m torchtitan_wlb.sim`` (``wlb-sim``), ``python -m torchtitan_wlb.sim.analyze``
(``wlb-analyze``), ``python -m torchtitan_wlb.sim.calibrate`` and ``python -m
torchtitan_wlb.sim.reproduce``. The simulator reuses the project's packers, CP planner and cost model;
see docs/simulator.md.
"""

from torchtitan_wlb.sim.config import SimConfig
from torchtitan_wlb.sim.engine import ModeResult, simulate_mode, speedup
from torchtitan_wlb.sim.hardware import HardwareProfile, get_hardware
from torchtitan_wlb.sim.modes import MODES, ModeSpec, get_mode
from torchtitan_wlb.sim.presets import MODEL_PRESETS, PAPER_TABLE1, Layout, ModelSpec, get_model

__all__ = [
    "MODEL_PRESETS",
    "MODES",
    "PAPER_TABLE1",
    "HardwareProfile",
    "Layout",
    "ModeResult",
    "ModeSpec",
    "ModelSpec",
    "SimConfig",
    "get_hardware",
    "get_mode",
    "get_model",
    "simulate_mode",
    "speedup",
]
