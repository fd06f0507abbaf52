"""What a run says before and after training: the nothing-to-do line, the start-up summary (layout,
model, data, checkpoints, where training starts) and the closing ``done:`` line."""

from __future__ import annotations

from typing import Any

from torchtitan_wlb import resume
from torchtitan_wlb.data.dataloader import micro_batches_per_step
from torchtitan_wlb.data.sources import BUILTIN_NAME


def count(n: int, noun: str) -> str:
    """``1 step``, ``2 steps``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def nothing_to_do(job_config: Any) -> str | None:
    """One line when the job's checkpoint already reached ``training.steps``, else None
    (TorchTitan would build the model, load the checkpoint, train zero steps and exit silently)."""
    step, total = resume.resume_step(job_config), job_config.training.steps
    if step < 0 or step < total:
        return None
    return (
        f"nothing to do: the checkpoint in {resume.checkpoint_folder(job_config)} is at step "
        f"{step} >= training.steps = {total}; train further with --training.steps "
        f"{step + total}, or start afresh in another --job.dump_folder"
    )


def _data_line(job_config: Any, parallel_dims: Any) -> str:
    jc, wlb, pd = job_config, job_config.wlb, parallel_dims
    data, seq_len = f"data: dataset {jc.training.dataset!r}", jc.training.seq_len
    if wlb.advanced.loader != "documents":
        return data + " through TorchTitan's loader (no packing)"
    n = micro_batches_per_step(jc, pd.dp_replicate * pd.dp_shard)
    data += " (built-in corpus)" if jc.training.dataset == BUILTIN_NAME else ""
    data += f" at {jc.training.dataset_path}" if jc.training.dataset_path else ""
    data += f"; packing {_preset_field(wlb, 'packing')}, {n} micro-batches per step of up to "
    data += f"{wlb.micro_batch_max_len or seq_len:,} tokens (context {seq_len:,})"
    return data + (f"; CP sharding {_preset_field(wlb, 'cp_sharding')}" if pd.cp_enabled else "")


def _preset_field(wlb: Any, name: str) -> str:
    """A field the mode presets, and the mode's value where the user's replaced it."""
    shown, mode_value = repr(str(getattr(wlb, name))), wlb.preset_overrides().get(name)
    return shown + (f" (set; mode {wlb.mode!r} has {mode_value!r})" if mode_value else "")


def run_summary(
    job_config: Any, parallel_dims: Any, device_type: str, start_step: int
) -> list[str]:
    """The start-up lines; ``start_step`` is ``resume.resume_step`` (-1: from scratch)."""
    jc, pd = job_config, parallel_dims
    degrees = {k: getattr(pd, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}
    shown = " x ".join(f"{k} {v}" for k, v in degrees.items() if v > 1) or "no parallelism"
    backend = "gloo" if device_type == "cpu" else "nccl"
    backend = jc.comm.mode if jc.comm.mode in resume.FAKE_COMM_MODES else backend
    lines = [
        f"run: {count(pd.world_size, device_type + ' rank')} over {backend}: {shown}; "
        f"{jc.model.name} {jc.model.flavor}; {count(jc.training.steps, 'step')}",
        _data_line(jc, pd),
    ]
    ck, folder = jc.checkpoint, resume.checkpoint_folder(jc)
    every = "every step" if ck.interval == 1 else f"every {ck.interval} steps"
    keep = f", keeping the latest {ck.keep_latest_k}" if ck.keep_latest_k > 0 else ""
    status = f"{folder}, {every} and at the last{keep}" if ck.enable else "off"
    lines.append(f"checkpoints: {status}")
    if start_step == 0:  # a seed checkpoint: weights only, training starts at step 1
        lines.append(f"starting at step 1 from the model-only checkpoint {folder}/step-0")
    elif start_step > 0:
        lines.append(f"resuming from step {start_step} ({folder}/step-{start_step})")
    else:
        where = f" (no checkpoint in {folder})" if ck.enable else ""
        lines.append(f"starting at step 1{where}")
    return lines


def done_line(
    job_config: Any, start_step: int, step: int, seconds: float, checkpoints: bool
) -> str:
    """The closing line: steps trained, where the run stands, its latest checkpoint."""
    folder = resume.checkpoint_folder(job_config)
    latest = resume.latest_checkpoint_step(folder) if checkpoints else -1
    where = f"latest checkpoint {folder}/step-{latest}" if latest >= 0 else "no checkpoint written"
    trained = step - max(start_step, 0)
    return (
        f"done: trained {count(trained, 'step')} in {seconds:.0f}s, now at step "
        f"{step}/{job_config.training.steps}; {where}"
    )


class CompileCounter:
    """How many graphs ``torch.compile`` has built in this process, and how many of them after
    the first step (recompiles: a new packed length, document count or CP plan the first graph's
    guards reject). TorchTitan compiles each transformer block; the blocks share their graphs."""

    def __init__(self) -> None:
        self.after_first_step: int | None = None  # graphs built by the end of the first step
        self.graphs = 0

    @staticmethod
    def _built() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def step_done(self) -> tuple[dict[str, float], str | None]:
        """The figures to log with this step, and a line to print when a graph was built."""
        built = self._built()
        first = self.after_first_step is None
        if first:
            self.after_first_step = built
        new, self.graphs = built > self.graphs, built
        recompiles = built - self.after_first_step
        line = None
        if new:
            line = f"compile: {count(built, 'graph')} built, " + (
                "the first step's" if first else f"{count(recompiles, 'recompile')} since step 1"
            )
        return {"compiled_graphs": built, "recompiles": recompiles}, line
