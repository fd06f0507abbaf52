"""CPU as a supported TorchTitan device (what it patches and why: docs/cpu.md). :func:`activate`
must run before torchtitan is imported, which binds the device type at import time."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections import namedtuple
from typing import Any

import torch

_ACTIVE = False

_CpuProperties = namedtuple("_CpuProperties", ["name", "total_memory"])


def _proc_line(path: str, prefix: str) -> str | None:
    """The first line of ``path`` starting with ``prefix`` (None: none, or no procfs)."""
    try:
        with open(path) as f:
            return next((line for line in f if line.startswith(prefix)), None)
    except OSError:
        return None


def _read_status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (0 where procfs is unavailable)."""
    line = _proc_line("/proc/self/status", field + ":")
    return int(line.split()[1]) if line else 0


def _cpu_name(_device: Any = None) -> str:
    if line := _proc_line("/proc/cpuinfo", "model name"):
        return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return platform.processor() or platform.machine()


def _cpu_properties(_device: Any = None) -> _CpuProperties:
    return _CpuProperties(_cpu_name(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


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
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _CpuProfile(torch.profiler.profile):
    """``torch.profiler.profile`` for TorchTitan's profiling hook on CPU: the hook lists CPU and
    the accelerator's activity, which is None without an accelerator; the CPU one is kept."""

    def __init__(self, *args: Any, activities: Any = None, **kwargs: Any):
        if activities is not None:
            activities = [a for a in activities if a is not None]
        super().__init__(*args, activities=activities, **kwargs)


_STATUS_FIELDS = ("VmPeak", "VmSize", "VmHWM", "VmRSS", "RssAnon", "RssFile", "VmSwap")


class _CpuMemory:
    """``torch.cpu.memory`` for TorchTitan's memory snapshot (``[profiling]
    enable_memory_snapshot``) on CPU. CPU tensors have no caching allocator recording a history,
    so each "snapshot" is the process's memory summary from ``/proc/self/status``: ``{"device":
    "cpu", "bytes": {field: bytes}}`` for the fields below, peak (``VmHWM``) since the last reset."""

    @staticmethod
    def _record_memory_history(*_args: Any, **_kwargs: Any) -> None:
        _cpu_reset_peak_memory_stats()  # the peak of the recorded span, as CUDA's history starts

    @staticmethod
    def _snapshot() -> dict[str, Any]:
        sizes = {field: _read_status_kib(field) * 1024 for field in _STATUS_FIELDS}
        return {"device": "cpu", "bytes": sizes}


def activate() -> bool:
    """Make CPU a TorchTitan device if no accelerator is present (idempotent); True when CPU mode
    is active. Refuses if torchtitan is already imported: its device globals point at CUDA."""
    global _ACTIVE
    if _ACTIVE:
        return True
    import torch._utils as tu

    if tu._get_available_device_type() is not None:
        return False
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError(
            "torchtitan_wlb.cpu_support.activate() must run before torchtitan is imported "
            "(torchtitan binds its device type at import time); import torchtitan_wlb.train "
            "or call activate() first."
        )
    tu._get_available_device_type = lambda: "cpu"
    torch.cpu.get_device_name = _cpu_name
    torch.cpu.get_device_properties = _cpu_properties
    torch.cpu.memory_stats = _cpu_memory_stats
    torch.cpu.reset_peak_memory_stats = _cpu_reset_peak_memory_stats
    torch.cpu.empty_cache = lambda: None
    torch.cpu.current_device = lambda: 0  # torchtitan passes it to barriers as a device id
    torch.cpu.memory = _CpuMemory  # TorchTitan's memory snapshot
    torch.profiler.profile = _CpuProfile  # TorchTitan's profiling hook
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
