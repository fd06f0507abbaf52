"""A 4D step simulator for WLB-LLM: packed micro-batches -> CP shards -> per-layer times -> pipeline.

Entry points: ``python -m torchtitan_wlb.sim`` (``wlb-sim``), ``python -m torchtitan_wlb.sim.analyze``
(``wlb-analyze``), ``python -m torchtitan_wlb.sim.calibrate`` and ``python -m
torchtitan_wlb.sim.reproduce``. The simulator reuses the project's packers, CP planner and cost model;
see docs/simulator.md.
"""

from torchtitan_wlb.sim.engine import ModeResult, SimConfig, simulate_mode, speedup
from torchtitan_wlb.sim.hardware import HardwareProfile, get_hardware
from torchtitan_wlb.sim.modes import MODES, ModeSpec, get_mode
from torchtitan_wlb.sim.presets import PAPER_TABLE1, Layout

__all__ = [
    "MODES",
    "PAPER_TABLE1",
    "HardwareProfile",
    "Layout",
    "ModeResult",
    "ModeSpec",
    "SimConfig",
    "get_hardware",
    "get_mode",
    "simulate_mode",
    "speedup",
]
