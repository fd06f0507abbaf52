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
_TRAIN_STATE = "train_state"  # the step, which TorchTitan saves in full checkpoints only
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
    """The largest complete ``step-N`` in ``folder`` (model-only or full); -1: none."""
    return max(_steps_holding(folder, _COMPLETE), default=-1)


def is_model_only(folder: str) -> bool:
    """Whether the checkpoint in ``folder`` holds the model alone: TorchTitan's last-step save under
    ``[checkpoint] last_save_model_only`` (its default) has no training state, so no step, optimizer
    or data position to resume from. An unreadable one counts as full (:func:`verify` names it)."""
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        return os.path.isfile(os.path.join(folder, _COMPLETE[1]))  # HF safetensors: model only
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 -- damaged: verify() reports it with the file's name
        return False
    return not any(key.split(".")[0] == _TRAIN_STATE for key in keys)


def latest_full_step(folder: str) -> int:
    """The largest complete ``step-N`` in ``folder`` that a run can resume from (not model-only,
    not the seed checkpoint, step 0); -1: none."""
    steps = sorted((s for s in _steps_holding(folder, _COMPLETE) if s > 0), reverse=True)
    return next((s for s in steps if not is_model_only(os.path.join(folder, f"step-{s}"))), -1)


def resume_folder(job_config: Any) -> tuple[str, int] | None:
    """``(folder, step)`` of the checkpoint this run loads: ``load_step``, else the latest unless it
    is model-only and the run trains on (then the latest full one: ``WLBCheckpointManager.load``)."""
    ckpt = job_config.checkpoint
    base = checkpoint_folder(job_config)
    if not ckpt.enable or not os.path.isdir(base):
        return None
    step = int(ckpt.load_step) if ckpt.load_step >= 0 else latest_checkpoint_step(base)
    if ckpt.load_step < 0 and 0 < step < job_config.training.steps:
        # A model-only latest with none full before it stays: check_resume refuses, naming it.
        full = latest_full_step(base)
        step = full if full > 0 else step
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
    if 0 < step < job_config.training.steps and is_model_only(folder):
        raise CheckpointError(_model_only_message(job_config, folder, step))
    if fingerprint is not None and step > 0:
        saved = saved_fingerprint(folder, metadata)
        if saved is not None:
            from torchtitan_wlb.data.dataloader import check_fingerprint

            check_fingerprint(saved, fingerprint, f"checkpoint {folder}")
    return step


def _model_only_message(job_config: Any, folder: str, step: int) -> str:
    """Why a model-only checkpoint cannot be resumed from, and what can be."""
    base = checkpoint_folder(job_config)
    full = latest_full_step(base)
    where = (
        f"[checkpoint] load_step = {step}" if job_config.checkpoint.load_step >= 0 else "resuming"
    )
    lost = "no optimizer state or data position"
    if full >= 0:
        return (
            f"{where}: {folder} holds only the model ([checkpoint] last_save_model_only wrote it "
            f"at the last step), {lost}; resume from the full checkpoint "
            f"{os.path.join(base, f'step-{full}')} with [checkpoint] load_step = {full} (or -1)"
        )
    return (
        f"{where}: {folder} holds only the model ([checkpoint] last_save_model_only wrote it at "
        f"the last step), {lost}, and {base} holds no full checkpoint to resume from; train "
        f"on from its weights in another --job.dump_folder with --checkpoint.initial_load_path "
        f"{folder}, and keep the last save full with --checkpoint.no-last-save-model-only"
    )
