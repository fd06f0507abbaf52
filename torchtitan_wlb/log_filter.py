"""Silences TorchTitan log lines that do not apply to this project's runs.

TorchTitan warns about things that are true but irrelevant here, and a newcomer cannot tell them
from real problems:

- ``HF assets path  does not exist!`` when ``[model] hf_assets_path = ""``, which is how a config
  asks for the built-in byte tokenizer (no Hugging Face assets in use);
- on a CPU-only machine (:mod:`torchtitan_wlb.cpu_support` active): ``ENV[TORCH_NCCL_...] will be
  overridden`` (torchrun sets NCCL variables that gloo never reads), ``Error running lspci`` and
  ``Peak flops undefined ..., fallback to A100`` (TorchTitan looks up a GPU's peak to compute MFU).
  A CPU has no known peak, so the trainer's line ``Peak FLOPS used for computing MFU: 3.120e+14``
  becomes ``Peak FLOPS: unknown for CPU, MFU not reported`` and the step line shows ``mfu: n/a``
  (:mod:`torchtitan_wlb.metrics`).

torch's UserWarnings about DTensor's RNG on a CPU mesh and about process-group timeouts are
ignored on CPU too. Every other warning passes. :func:`install` adds the filter to TorchTitan's logger (the root
logger); ``init_logger`` replaces handlers, not filters, so installing once per process suffices.
"""

from __future__ import annotations

import logging
import warnings

from torchtitan_wlb import cpu_support

_ALWAYS = ("HF assets path  does not exist!",)  # two spaces: the empty path
_CPU_ONLY = ("ENV[TORCH_NCCL_", "Error running lspci", "Peak flops undefined for")
_CPU_PEAK = "Peak FLOPS used for computing MFU"
# torch's own UserWarnings on a CPU mesh, raised through TorchTitan's calls: DTensor's RNG works on
# CPU for what TorchTitan uses, and gloo does take the timeout TorchTitan sets.
_CPU_PY_WARNINGS = (
    r"DTensor random operators may not have complete support on cpu",
    r"DTensor manual_seed\(\) may not have complete support on cpu",
    r"Set timeout is now only supported for either nccl or gloo",
)


class InapplicableWarnings(logging.Filter):
    """Drops the lines listed in the module docstring and rewrites the CPU peak-FLOPS line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(_ALWAYS):
            return False
        if not cpu_support.is_active():
            return True
        if message.startswith(_CPU_ONLY):
            return False
        if message.startswith(_CPU_PEAK):
            record.msg, record.args = "Peak FLOPS: unknown for CPU, MFU not reported", None
        return True


def install() -> None:
    """Add the filter to TorchTitan's logger once (idempotent); on CPU also ignore torch's CPU-mesh
    UserWarnings listed above."""
    root = logging.getLogger()
    if not any(isinstance(f, InapplicableWarnings) for f in root.filters):
        root.addFilter(InapplicableWarnings())
    if cpu_support.is_active():
        for message in _CPU_PY_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
