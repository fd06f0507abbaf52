"""CPU as a supported TorchTitan device.

torchtitan 0.2.2 assumes an accelerator: ``torchtitan.tools.utils`` falls back to the device type
``"cuda"`` when none is present, the trainer calls ``device_module.set_device``, and the memory
monitor asks the device module for its name, capacity and peak memory. On a CPU-only machine every
one of those fails. This module is the single place that makes CPU work, so no other file of the
project needs a CPU special case.

:func:`activate` must run **before torchtitan is imported**, because torchtitan binds the device
type into module globals at import time. ``torchtitan_wlb.train`` (the entry point) and the test
suite call it first thing. On a machine with an accelerator it does nothing.

What it does, and why each piece is needed:

1. ``torch._utils._get_available_device_type`` reports ``"cpu"`` when no accelerator exists, so
   torchtitan picks ``torch.cpu`` as its device module and ``gloo`` as its process-group backend.
2. ``torch.cpu`` gains the few functions torchtitan's ``DeviceMemoryMonitor`` calls
   (``get_device_name``, ``get_device_properties``, ``memory_stats``, ``reset_peak_memory_stats``,
   ``empty_cache``). Memory figures are real: the process's peak resident set (``VmHWM``), which
   Linux lets us reset through ``/proc/self/clear_refs``.
3. ``torch.cpu.current_device()`` returns ``0`` instead of ``"cpu"``: torchtitan passes it as a
   device id to barriers.
4. gloo has no ``PREMUL_SUM`` reduction, which FSDP2 uses when torchtitan sets a gradient divide
   factor of 1.0. :func:`adapt_fsdp_for_cpu` switches FSDP to plain-sum collectives followed by a
   division (FSDP's public ``set_force_sum_reduction_for_comms``); the parallelize function calls
   it after ``fully_shard`` on CPU. The gradients are identical, only the collective op differs.
"""

from __future__ import annotations

import os
import platform
from collections import namedtuple
from typing import Any

import torch

_ACTIVE = False

_CpuProperties = namedtuple("_CpuProperties", ["name", "total_memory"])


def _read_status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (0 where procfs is unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_name(_device: Any = None) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_properties(_device: Any = None) -> _CpuProperties:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return _CpuProperties(name=_cpu_name(), total_memory=total)


def _cpu_memory_stats(_device: Any = None) -> dict[str, int]:
    peak = _read_status_kib("VmHWM") * 1024
    current = _read_status_kib("VmRSS") * 1024
    return {
        "active_bytes.all.peak": peak,
        "reserved_bytes.all.peak": peak,
        "active_bytes.all.current": current,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


def _cpu_reset_peak_memory_stats(_device: Any = None) -> None:
    # Writing 5 to clear_refs resets the peak resident set size (VmHWM) on Linux >= 4.0.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _cpu_empty_cache() -> None:
    return None


def _cpu_current_device() -> int:
    return 0


_ORIGINAL_GET_DEVICE_TYPE = None


def activate() -> bool:
    """Make CPU a TorchTitan device if no accelerator is present. Idempotent.

    Returns True when CPU mode is active. Raises RuntimeError if torchtitan was already imported
    in CPU mode-less form, since its device globals would then point at CUDA.
    """
    global _ACTIVE, _ORIGINAL_GET_DEVICE_TYPE
    if _ACTIVE:
        return True
    import sys

    import torch._utils as tu

    if tu._get_available_device_type() is not None:
        return False
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError(
            "torchtitan_wlb.cpu_support.activate() must run before torchtitan is imported "
            "(torchtitan binds its device type at import time); import torchtitan_wlb.train "
            "or call activate() first."
        )
    _ORIGINAL_GET_DEVICE_TYPE = tu._get_available_device_type
    tu._get_available_device_type = lambda: "cpu"
    torch.cpu.get_device_name = _cpu_name
    torch.cpu.get_device_properties = _cpu_properties
    torch.cpu.memory_stats = _cpu_memory_stats
    torch.cpu.reset_peak_memory_stats = _cpu_reset_peak_memory_stats
    torch.cpu.empty_cache = _cpu_empty_cache
    torch.cpu.current_device = _cpu_current_device
    _ACTIVE = True
    return True


def is_active() -> bool:
    """Whether :func:`activate` switched this process to CPU mode."""
    return _ACTIVE


def adapt_fsdp_for_cpu(model: torch.nn.Module) -> None:
    """Use sum-only collectives in every FSDP module (gloo has no PREMUL_SUM). No-op off CPU."""
    if not _ACTIVE:
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
