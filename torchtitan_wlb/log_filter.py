"""Silences TorchTitan log lines that are true but do not apply here (the byte tokenizer's missing
HF assets; its peak FLOPS, which its MFU no longer divides by: the metrics say their own; on CPU,
NCCL variables and ``lspci``: docs/cpu.md)."""

from __future__ import annotations

import logging
import warnings

from torchtitan_wlb import cpu_support

_ALWAYS = (
    "HF assets path  does not exist!",  # two spaces: the empty path
    "Peak FLOPS used for computing MFU",  # torchtitan_wlb.mfu's peak is logged instead
    "Peak flops undefined for",
)
_CPU_ONLY = ("ENV[TORCH_NCCL_", "Error running lspci")
# torch's own UserWarnings on a CPU mesh, raised through TorchTitan's calls: DTensor's RNG works on
# CPU for what TorchTitan uses, and gloo does take the timeout TorchTitan sets.
_CPU_PY_WARNINGS = (
    r"DTensor random operators may not have complete support on cpu",
    r"DTensor manual_seed\(\) may not have complete support on cpu",
    r"Set timeout is now only supported for either nccl or gloo",
)


class InapplicableWarnings(logging.Filter):
    """Drops the lines above."""

    def filter(self, record: logging.LogRecord) -> bool:
        message, cpu = record.getMessage(), cpu_support.is_active()
        return not (message.startswith(_ALWAYS) or (cpu and message.startswith(_CPU_ONLY)))


def install() -> None:
    """Add the filter to TorchTitan's logger (the root logger; ``init_logger`` replaces handlers,
    not filters) once; on CPU also ignore torch's CPU-mesh UserWarnings above."""
    root = logging.getLogger()
    if not any(isinstance(f, InapplicableWarnings) for f in root.filters):
        root.addFilter(InapplicableWarnings())
    if cpu_support.is_active():
        for message in _CPU_PY_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
