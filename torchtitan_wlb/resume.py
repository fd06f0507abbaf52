"""Which checkpoint a run resumes from, checked before anything of it is loaded: a damaged file or
one written under other data settings is one line naming it (docs/architecture.md)."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from typing import Any

_STEP = re.compile(r"step-(\d+)")
_COMPLETE = (".metadata", "model.safetensors.index.json")  # a step folder TorchTitan loads
FAKE_COMM_MODES = ("fake_backend", "local_tensor")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file."""


def checkpoint_folder(job_config: Any) -> str:
    """Where TorchTitan loads and saves this job's checkpoints."""
    return os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder)


def _steps_holding(folder: str, probes: tuple[str, ...]) -> list[int]:
    """The ``N`` of every ``step-N`` folder in ``folder`` that holds one of ``probes``."""
    if not os.path.isdir(folder):
        return []
    return [
        int(m.group(1))
        for name in os.listdir(folder)
        if (m := _STEP.search(name))
        and any(os.path.isfile(os.path.join(folder, name, probe)) for probe in probes)
    ]


def latest_checkpoint_step(folder: str) -> int:
    """The largest complete ``step-N`` in ``folder``, which TorchTitan resumes from; -1: none."""
    return max(_steps_holding(folder, _COMPLETE), default=-1)


def resume_folder(job_config: Any) -> tuple[str, int] | None:
    """``(folder, step)`` of the checkpoint TorchTitan would load (``load_step``, else the latest)."""
    ckpt = job_config.checkpoint
    base = checkpoint_folder(job_config)
    if not ckpt.enable or not os.path.isdir(base):
        return None
    step = int(ckpt.load_step) if ckpt.load_step >= 0 else latest_checkpoint_step(base)
    return None if step < 0 else (os.path.join(base, f"step-{step}"), step)


def resume_step(job_config: Any) -> int:
    """The step this job will resume from (-1: it starts from scratch): none when it writes a
    seed checkpoint or runs on fake collectives (which cannot load one)."""
    found = resume_folder(job_config)
    seed_or_fake = (
        job_config.checkpoint.create_seed_checkpoint or job_config.comm.mode in FAKE_COMM_MODES
    )
    return found[1] if found and os.path.isdir(found[0]) and not seed_or_fake else -1


def verify(folder: str) -> Any:
    """The checkpoint's DCP metadata, after checking that every file it lists is whole."""
    from torch.distributed.checkpoint import FileSystemReader

    meta_path = os.path.join(folder, ".metadata")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{meta_path} does not exist: {folder} is not a complete checkpoint")
    try:
        metadata = FileSystemReader(folder).read_metadata()
    except Exception as e:  # noqa: BLE001 -- any unpickling failure means a damaged file
        raise CheckpointError(
            f"{meta_path} is truncated or corrupted ({type(e).__name__}: {e}); "
            f"{_fallback_hint(folder)}"
        ) from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{path} is missing: the checkpoint's metadata lists it; {_fallback_hint(folder)}"
            )
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(
                f"{path} is truncated: {size} bytes, the checkpoint's metadata needs {end}; "
                f"{_fallback_hint(folder)}"
            )
    return metadata


def _fallback_hint(folder: str) -> str:
    base, name = os.path.split(os.path.normpath(folder))
    here = _STEP.search(name)
    older = [s for s in _steps_holding(base, (".metadata",)) if not here or s < int(here.group(1))]
    if older:
        return f"move {folder} away to resume from {os.path.join(base, f'step-{max(older)}')}"
    return f"move {folder} away to start from scratch"


def saved_fingerprint(folder: str, metadata: Any) -> dict[str, Any] | None:
    """The data fingerprint the loader saved in the checkpoint (None: none saved)."""
    import torch

    for index, info in metadata.storage_data.items():
        if index.fqn != "dataloader.fingerprint":
            continue
        path = os.path.join(folder, info.relative_path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            return json.loads(torch.load(io.BytesIO(data), weights_only=False))
        except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError) as e:
            raise CheckpointError(
                f"{path} is corrupted: its data-loader record does not read back "
                f"({type(e).__name__}); {_fallback_hint(folder)}"
            ) from None
    return None


def check_resume(job_config: Any, fingerprint: dict[str, Any] | None) -> int | None:
    """Check the checkpoint this run would resume from, and against this run's data ``fingerprint``
    unless None or a seed checkpoint (step 0); return its step (None: no resume)."""
    found = resume_folder(job_config)
    if found is None:
        return None
    folder, step = found
    if not os.path.isdir(folder):
        raise CheckpointError(f"[checkpoint] load_step = {step}, but {folder} does not exist")
    metadata = verify(folder)
    if fingerprint is not None and step > 0:
        saved = saved_fingerprint(folder, metadata)
        if saved is not None:
            from torchtitan_wlb.data.dataloader import check_fingerprint

            check_fingerprint(saved, fingerprint, f"checkpoint {folder}")
    return step
