"""What a run says about itself: where its checkpoint is, where it resumes, what it runs.

TorchTitan's Trainer loads the latest checkpoint silently, trains zero steps when that checkpoint
already holds ``training.steps`` and exits 0 without a word. This module answers those questions
from the config and the checkpoint folder alone (no process group, no model), so that the entry
point can stop in one line before building anything (:func:`nothing_to_do`) and the trainer can open
a run with its layout, packer, dataset and checkpoint plan (:func:`run_summary`).
"""

from __future__ import annotations

import os
import re
from typing import Any

from torchtitan_wlb.data.sources import BUILTIN_NAME

FAKE_COMM_MODES = ("fake_backend", "local_tensor")


def checkpoint_folder(job_config: Any) -> str:
    """Where TorchTitan loads and saves this job's checkpoints."""
    return os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder)


def latest_checkpoint_step(folder: str) -> int:
    """The step TorchTitan resumes from in ``folder``: the largest ``step-N`` holding a complete
    checkpoint (its DCP ``.metadata`` or a Hugging Face index), -1 when there is none."""
    if not os.path.isdir(folder):
        return -1
    steps = [
        int(m.group(1))
        for name in os.listdir(folder)
        if (m := re.fullmatch(r"step-(\d+)", name))
        and any(
            os.path.isfile(os.path.join(folder, name, probe))
            for probe in (".metadata", "model.safetensors.index.json")
        )
    ]
    return max(steps, default=-1)


def resume_step(job_config: Any) -> int:
    """The step this job will resume from (-1: it starts from scratch)."""
    ck = job_config.checkpoint
    if not ck.enable or ck.create_seed_checkpoint or job_config.comm.mode in FAKE_COMM_MODES:
        return -1
    folder = checkpoint_folder(job_config)
    if ck.load_step >= 0:
        return ck.load_step if os.path.isdir(os.path.join(folder, f"step-{ck.load_step}")) else -1
    return latest_checkpoint_step(folder)


def nothing_to_do(job_config: Any) -> str | None:
    """One line when the job's checkpoint already reached ``training.steps``, else None.

    TorchTitan would build the model, load the checkpoint, train zero steps and exit silently.
    """
    step, total = resume_step(job_config), job_config.training.steps
    if step < 0 or step < total:
        return None
    return (
        f"nothing to do: the checkpoint in {checkpoint_folder(job_config)} is at step {step} >= "
        f"training.steps = {total}; train further with --training.steps {step + total}, or start "
        "afresh in another --job.dump_folder"
    )


def _layout(parallel_dims: Any, device_type: str, comm_mode: str) -> str:
    pd = parallel_dims
    degrees = {
        "dp_replicate": pd.dp_replicate,
        "dp_shard": pd.dp_shard,
        "cp": pd.cp,
        "tp": pd.tp,
        "pp": pd.pp,
    }
    shown = " x ".join(f"{k} {v}" for k, v in degrees.items() if v > 1) or "no parallelism"
    backend = (
        comm_mode if comm_mode in FAKE_COMM_MODES else ("gloo" if device_type == "cpu" else "nccl")
    )
    return f"{count(pd.world_size, device_type + ' rank')} over {backend}: {shown}"


def count(n: int, noun: str) -> str:
    """``1 step``, ``20 steps``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def run_summary(
    job_config: Any, parallel_dims: Any, device_type: str, start_step: int
) -> list[str]:
    """The lines a run opens with: layout, model, data, checkpoints, and where training starts
    (``start_step`` from :func:`resume_step`)."""
    jc, wlb = job_config, job_config.wlb
    pd = parallel_dims
    n = jc.training.global_batch_size
    n = n if n > 0 else pd.dp_replicate * pd.dp_shard  # TorchTitan: one per DP rank
    lines = [
        f"run: {_layout(pd, device_type, jc.comm.mode)}; {jc.model.name} "
        f"{jc.model.flavor}; {count(jc.training.steps, 'step')}",
    ]
    if wlb.loader == "documents":
        lines.append(
            f"data: dataset {jc.training.dataset!r}"
            + (" (built-in corpus)" if jc.training.dataset == BUILTIN_NAME else "")
            + (f" at {jc.training.dataset_path}" if jc.training.dataset_path else "")
            + f"; packing {wlb.packing!r}, {n} micro-batches per step of up to "
            f"{wlb.micro_batch_max_len or jc.training.seq_len:,} tokens (context "
            f"{jc.training.seq_len:,})"
            + (f"; CP sharding {wlb.cp_sharding!r}" if pd.cp_enabled else "")
        )
    else:
        lines.append(
            f"data: dataset {jc.training.dataset!r} through TorchTitan's loader (no packing)"
        )
    ck = jc.checkpoint
    folder = checkpoint_folder(jc)
    if not ck.enable:
        lines.append("checkpoints: off")
    else:
        lines.append(
            f"checkpoints: {folder}, "
            + ("every step" if ck.interval == 1 else f"every {ck.interval} steps")
            + " and at the last"
            + (f", keeping the latest {ck.keep_latest_k}" if ck.keep_latest_k > 0 else "")
        )
    if start_step == 0:  # a seed checkpoint: weights only, training starts at step 1
        lines.append(f"starting at step 1 from the model-only checkpoint {folder}/step-0")
    elif start_step > 0:
        lines.append(f"resuming from step {start_step} ({folder}/step-{start_step})")
    else:
        lines.append("starting at step 1" + (f" (no checkpoint in {folder})" if ck.enable else ""))
    return lines
