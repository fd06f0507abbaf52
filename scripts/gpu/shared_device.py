"""Rank entry for several ranks on one CUDA device over gloo, for tests and checks only.

    torchrun --nproc_per_node=2 --rdzv_backend c10d --rdzv_endpoint localhost:0 --role rank \
        scripts/gpu/shared_device.py --job.config_file FILE ARGS...

Each rank runs ``torchtitan_wlb.train`` exactly as ``python -m torchtitan_wlb.train ARGS`` does,
after three changes that let N ranks share CUDA device 0 (NCCL refuses two ranks on one device;
gloo takes CUDA tensors for most collectives):

- ``LOCAL_RANK`` becomes 0 (its launcher value is kept in ``WLB_SHARED_DEVICE_LOCAL_RANK``).
  Every reader of ``LOCAL_RANK`` in TorchTitan 0.2.2 and torch 2.13 takes it as this process's
  device index: TorchTitan's ``Trainer`` (``cuda:LOCAL_RANK`` and ``set_device``), ``DeviceMesh``
  choosing a device for a process that has none, ``get_node_local_rank``. Nothing reads it as a
  rank: the data loader, the checkpoint and the metrics use the global rank (``RANK``) and the
  mesh ranks, which are unchanged, and torchrun filters its output by rank outside this process.
- ``torch.distributed.Backend.default_device_backend_map["cuda"]`` becomes ``"gloo"``: TorchTitan's
  ``init_distributed`` takes the device's backend from that map (NCCL for CUDA otherwise), and a
  ``"gloo"`` default group carries both CPU and CUDA tensors.
- FSDP reduces gradients with sum-only collectives, as on CPU (``cpu_support.adapt_fsdp_for_cpu``,
  a no-op off CPU): gloo refuses ``PREMUL_SUM`` ("Cannot use ReduceOp.PREMUL_SUM with Gloo"),
  which FSDP uses when its gradient divide factor is not the group size.

Without CUDA the entry changes nothing: CPU ranks already use gloo and one process each, so a CPU
run of the same command exercises the same entry and flags (``scripts/gpu/two_ranks.py``).
``WLB_SHARED_DEVICE=1`` applies the changes there too: every CPU rank then takes ``cpu:0`` and
sum-only FSDP reductions, as CPU ranks do anyway, so a CPU run checks that nothing else reads
``LOCAL_RANK``. Each rank that applied them prints one ``[shared_device]`` line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script, the checkout's package first
    sys.path.insert(0, ROOT)

LAUNCHER_LOCAL_RANK = "WLB_SHARED_DEVICE_LOCAL_RANK"
FORCE = "WLB_SHARED_DEVICE"


def share_device(environ: MutableMapping[str, str], backend_map: dict[str, str]) -> None:
    """Device 0 for this rank and gloo for CUDA tensors, in ``environ`` and ``backend_map``
    (``os.environ`` and torch's ``Backend.default_device_backend_map`` in a rank)."""
    environ[LAUNCHER_LOCAL_RANK] = environ.get("LOCAL_RANK", "0")
    environ["LOCAL_RANK"] = "0"
    backend_map["cuda"] = "gloo"


def force_sum_reductions(model: Any) -> None:
    """Sum-only reduce-scatters and all-reduces in every FSDP module of ``model`` (gloo has no
    ``PREMUL_SUM``); FSDP divides the gradients itself before and after instead."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def install(cuda: bool) -> bool:
    """Share CUDA device 0 over gloo in this process when ``cuda`` (a CUDA device is present);
    True when it did. Must run before the trainer starts: TorchTitan reads ``LOCAL_RANK`` and the
    backend map in ``Trainer.__init__``, and the model calls ``adapt_fsdp_for_cpu`` once sharded."""
    if not cuda:
        return False
    import torch.distributed

    from torchtitan_wlb import cpu_support

    share_device(os.environ, torch.distributed.Backend.default_device_backend_map)
    cpu_support.adapt_fsdp_for_cpu = force_sum_reductions
    return True


def main() -> None:
    """One rank: the changes where CUDA is present (or asked for), then the trainer's own entry
    point, as ``python -m torchtitan_wlb.train`` runs it."""
    import torch

    from torchtitan_wlb import train  # activates CPU support before TorchTitan is imported

    cuda = torch.cuda.is_available()
    if install(cuda or os.environ.get(FORCE) == "1"):
        rank, launcher = os.environ.get("RANK", "?"), os.environ[LAUNCHER_LOCAL_RANK]
        where = "cuda:0" if cuda else "cpu:0"
        print(
            f"[shared_device] rank {rank} (local rank {launcher}) on {where} over gloo", flush=True
        )
    train.exit_now(train.main())


if __name__ == "__main__":
    main()
