"""Variable-length micro-batches through torch.distributed.pipelining schedules, and their loss.

torch sizes receive buffers once, from micro-batch 0; every rank knows each micro-batch's length
from the packing plan, so the runner re-sizes them before each step: no padding, no shape exchange
(docs/pipeline.md). The only module touching private pipelining state, gated on verified torches.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_wlb.device_clock import CUDA, DeviceClock

# (major, minor) bounds, both inclusive, of the supported torch releases (docs/pipeline.md).
SUPPORTED_TORCH_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 13))

# Set to 1 to skip the version gate (to try a newer torch); the attribute checks still run.
ALLOW_UNVERIFIED_ENV = "WLB_PP_ALLOW_UNVERIFIED_TORCH"

# The private pipelining attributes this module reads or writes, in one place.
_PRIVATE_ATTRS = {
    "schedule": ("_n_microbatches", "_loss_fn", "_has_backward", "_step_microbatches"),
    "stage": ("args_recv_info", "grad_recv_info", "clear_runtime_states"),
}
# What a receive buffer holds under fake collectives, which deliver nothing: uninitialised memory
# may hold NaN or denormal numbers, which make a CPU's arithmetic many times slower.
_FAKE_RECV_VALUE = 1.0e-2
# Stage methods of older releases that check each micro-batch against the first one's shapes.
_SHAPE_VALIDATORS = ("_validate_fwd_input", "_validate_fwd_outputs")


class UnsupportedTorchVersionError(RuntimeError):
    """Raised when the installed torch is outside :data:`SUPPORTED_TORCH_RANGE`."""


def check_torch_version(version: str | None = None) -> None:
    """Fail early when the private pipelining internals may differ from the verified ones: they
    change between releases without notice, and must not silently give wrong gradients or hang."""
    version = torch.__version__ if version is None else version
    if os.environ.get(ALLOW_UNVERIFIED_ENV) == "1":
        return
    match = re.match(r"^(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedTorchVersionError(
            f"cannot parse torch version {version!r}; expected 'MAJOR.MINOR[...]'"
        )
    low, high = SUPPORTED_TORCH_RANGE
    if not (low <= (int(match.group(1)), int(match.group(2))) <= high):
        raise UnsupportedTorchVersionError(
            f"the varlen pipeline runner uses private pipelining internals verified on torch "
            f"{low[0]}.{low[1]} to {high[0]}.{high[1]}, not {version}; install one of those, or "
            f"set {ALLOW_UNVERIFIED_ENV}=1 to try (then run tests/test_pipeline_varlen.py)"
        )


# torch's and torchtitan's ignored label, written here rather than imported: importing torchtitan
# before cpu_support.activate() binds its device type (validate imports this module first).
IGNORE_INDEX = -100


def count_valid_tokens(
    labels: torch.Tensor | Sequence[torch.Tensor], ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Number of labels != ``ignore_index`` over one tensor or all micro-batches (int64 scalar)."""
    if isinstance(labels, torch.Tensor):
        return (labels != ignore_index).sum(dtype=torch.int64)
    if len(labels) == 0:
        raise ValueError("labels is an empty sequence; pass at least one label tensor")
    return torch.stack([(t != ignore_index).sum(dtype=torch.int64) for t in labels]).sum()


def global_valid_tokens(
    local_count: torch.Tensor | int,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A rank's valid-token count summed over ``group`` (a process group or 1-D device mesh;
    None: the default group, if any), on ``device``; which group: docs/pipeline.md."""
    count = torch.as_tensor(local_count, dtype=torch.int64, device=device).clone()
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group must be a 1-D DeviceMesh (flatten it first), got one with "
                f"{group.ndim} dims {group.mesh_dim_names}"
            )
        group = group.get_group()
    if group is None and not dist.is_initialized():
        return count
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count


def token_mean_loss(
    loss_sum_fn: Callable[..., torch.Tensor], global_count: torch.Tensor | int
) -> Callable[..., torch.Tensor]:
    """``loss_sum_fn(pred, target) / global_count`` for a sum-reduced loss; the count is clamped
    to 1, so a global batch with no valid token gives loss 0 instead of NaN."""
    denominator = torch.as_tensor(global_count).clamp(min=1)

    def loss_fn(pred: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        return loss_sum_fn(pred, target, **kwargs) / denominator

    return loss_fn


@dataclass
class VarlenStepStats:
    """What one :meth:`VarlenPipelineRunner.step` did to the receive buffers of this rank."""

    buffers_resized: int  # replaced because their micro-batch changed length
    buffers_reused: int  # kept from the previous step (same length)
    recv_bytes: int  # of all this step's receive buffers (activations and gradients)


@dataclass
class PipelineActionTimes:
    """Compute seconds of every pipeline action of one step on this rank (row: local stage,
    column: micro-batch), without the waits for neighbours: the costs a pipeline timeline plays."""

    stage_indices: list[int]
    fwd_s: list[list[float]]
    bwd_s: list[list[float]]
    fwd_device_s: list[list[float]]
    bwd_device_s: list[list[float]]

    def to_dict(self) -> dict[str, Any]:
        times = asdict(self)
        return {"stages": times.pop("stage_indices"), **times}


class _ActionTimer:
    """Instance-level wrappers timing each stage's per-micro-batch calls and the schedule's loss,
    removed after the step; CUDA events are read once afterwards (no sync inside the schedule)."""

    # Stage methods timed, as a forward (0) or a backward (1).
    _TIMED = {"forward_one_chunk": 0, "backward_one_chunk": 1, "backward_weight_one_chunk": 1}

    def __init__(self, schedule: Any, stages: Sequence[Any], n_mb: int):
        self.schedule = schedule
        self.stages = list(stages)
        self.row = {id(stage): i for i, stage in enumerate(self.stages)}
        # (row, kind 0 fwd / 1 bwd, mb, (wall, device) seconds or (start, end) CUDA events)
        self.samples: list[tuple[int, int, int, Any]] = []
        self.n_mb = n_mb
        types = {getattr(getattr(s, "device", None), "type", "cpu") for s in self.stages}
        self.clock = DeviceClock("cuda" if "cuda" in types else "cpu")
        self.cuda = self.clock.kind == CUDA
        self._installed: list[tuple[Any, str]] = []

    def _measure(self, row: int, kind: int, mb: int, fn: Callable[[], Any]) -> Any:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self.samples.append((row, kind, mb, (start, end)))
            return out
        start = self.clock.read()
        out = fn()
        self.samples.append((row, kind, mb, self.clock.since(start)))
        return out

    def install(self) -> None:
        for stage in self.stages:
            row = self.row[id(stage)]
            for name, kind in self._TIMED.items():
                original = getattr(stage, name, None)
                if original is None or name in vars(stage):
                    continue

                def wrapped(*args, _o=original, _r=row, _k=kind, **kwargs):
                    by_name = kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                    mb = args[0] if args else by_name
                    return self._measure(_r, _k, int(mb), lambda: _o(*args, **kwargs))

                setattr(stage, name, wrapped)
                self._installed.append((stage, name))
        original_loss = getattr(self.schedule, "_maybe_compute_loss", None)
        if original_loss is not None and "_maybe_compute_loss" not in vars(self.schedule):

            def wrapped_loss(stage, output, target_mbs, mb_index, *args, **kwargs):
                row = self.row.get(id(stage))
                call = lambda: original_loss(stage, output, target_mbs, mb_index, *args, **kwargs)  # noqa: E731
                if row is None or not getattr(stage, "is_last", False):
                    return call()
                return self._measure(row, 0, int(mb_index), call)

            self.schedule._maybe_compute_loss = wrapped_loss
            self._installed.append((self.schedule, "_maybe_compute_loss"))

    def remove(self) -> None:
        for obj, name in self._installed:
            delattr(obj, name)
        self._installed.clear()

    def result(self) -> PipelineActionTimes:
        if self.cuda and self.samples:
            torch.cuda.synchronize()
        # [wall, device] x [fwd, bwd] x stage x micro-batch
        sums = np.zeros((2, 2, len(self.stages), self.n_mb))
        for row, kind, mb, sample in self.samples:
            if self.cuda:
                sample = (sample[0].elapsed_time(sample[1]) / 1e3,) * 2
            if 0 <= mb < self.n_mb:
                sums[:, kind, row, mb] += sample
        # Field order: fwd_s, bwd_s, fwd_device_s, bwd_device_s.
        stages = [int(s.stage_index) for s in self.stages]
        return PipelineActionTimes(stages, *sums.reshape(4, len(self.stages), self.n_mb).tolist())


def _forward_actions(actions: Sequence[Any]) -> list[Any]:
    """A rank's schedule actions without the backward ones (and their gradient sends, receives
    and reductions); an overlapped forward-backward action keeps its forward."""
    from torch.distributed.pipelining import schedules as s

    backward = {
        s.FULL_BACKWARD, s.BACKWARD_INPUT, s.BACKWARD_WEIGHT, s.SEND_B, s.RECV_B, s.REDUCE_GRAD
    }  # fmt: skip
    kept = []
    for action in actions:
        if action is None or action.computation_type not in backward | {s.OVERLAP_F_B}:
            kept.append(action)
        elif action.computation_type == s.OVERLAP_F_B:
            kept += [a for a in action.sub_actions or () if a.computation_type not in backward]
    return kept


def _fake_collectives(stage: Any) -> bool:
    """Whether ``stage`` talks to its neighbours over fake collectives (TorchTitan's
    ``comm.mode = "fake_backend"``: one process stands for every rank, nothing is delivered)."""
    group = getattr(stage, "group", None)
    return dist.is_initialized() and dist.get_backend(group) == "fake"


def _empty_like_layout(shape: Sequence[int], ref: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``shape`` with ``ref``'s dtype, device and dimension order (``ref`` is
    torch's buffer, so the new one keeps the memory layout the sender produces)."""
    order = sorted(range(ref.dim()), key=lambda d: (-ref.stride(d), d))
    permuted = torch.empty([shape[d] for d in order], dtype=ref.dtype, device=ref.device)
    return permuted.permute([order.index(d) for d in range(ref.dim())])  # back to ref's order


class VarlenPipelineRunner:
    """Runs one optimizer step's micro-batches, each with its own length, through a single- or
    multi-stage schedule built with ``scale_grads=False`` (the loss normalises gradients), in place
    of ``schedule.step(...)``; its arguments and their use: docs/pipeline.md."""

    def __init__(
        self,
        schedule: Any,
        *,
        seq_dim: int = 1,
        verify_seq_lens: bool = False,
        time_actions: bool = False,
    ):
        check_torch_version()
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleMulti,
            PipelineScheduleSingle,
        )

        if isinstance(schedule, PipelineScheduleSingle):
            self.stages = [schedule._stage]
            self._init_fn = schedule._initialize_stage
        elif isinstance(schedule, PipelineScheduleMulti):
            self.stages = list(schedule._stages)
            self._init_fn = schedule._initialize_stages
        else:
            raise ValueError(
                f"schedule must be a torch.distributed.pipelining PipelineScheduleSingle or "
                f"PipelineScheduleMulti, got {type(schedule).__name__}"
            )
        needs = [(schedule, _PRIVATE_ATTRS["schedule"])]
        for obj, attrs in needs + [(stage, _PRIVATE_ATTRS["stage"]) for stage in self.stages]:
            for attr in attrs:
                if not hasattr(obj, attr):
                    raise UnsupportedTorchVersionError(
                        f"{type(obj).__name__} has no attribute {attr!r} in torch "
                        f"{torch.__version__}; the varlen runner needs it"
                    )
        if getattr(schedule, "scale_grads", False):
            raise ValueError(
                "schedule.scale_grads=True reweights the tokens of micro-batches of different "
                "lengths; build it with scale_grads=False (torchtitan's build_pipeline_schedule "
                "does) and pass global_valid_tokens to step()"
            )
        if not isinstance(seq_dim, int) or seq_dim < 0:
            raise ValueError(f"seq_dim must be a non-negative int, got {seq_dim!r}")

        self.schedule = schedule
        self.seq_dim = seq_dim
        self.verify_seq_lens = verify_seq_lens
        self.time_actions = time_actions
        self.last_action_times: PipelineActionTimes | None = None
        # Releases differ in what the set-up and the step take (target, loss_kwargs).
        self._init_params = set(inspect.signature(self._init_fn).parameters)
        step_params = inspect.signature(schedule._step_microbatches).parameters
        self._step_takes_loss_kwargs = "loss_kwargs" in step_params
        # Whether the buffers of the schedule's last set-up (first step, eval/train switch) were
        # checked against seq_lens[0]; a schedule set up elsewhere cannot be (lengths unknown).
        self._layout_checked = self._initialized_flags()[0] is True

    @property
    def n_microbatches(self) -> int:
        """Micro-batches per step, fixed when the schedule was built."""
        return int(self.schedule._n_microbatches)

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank holds stage 0 (it must pass ``microbatch_inputs``)."""
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank holds the last stage (it must pass ``targets``)."""
        return any(stage.is_last for stage in self.stages)

    def step(
        self,
        microbatch_inputs: Sequence[torch.Tensor] | None,
        microbatch_kwargs: Sequence[Mapping[str, Any]] | None,
        targets: Sequence[torch.Tensor] | None,
        seq_lens: Sequence[int],
        *,
        global_valid_tokens: torch.Tensor | int | None = None,
        losses: list | None = None,
        loss_kwargs: Mapping[str, Any] | None = None,
    ) -> VarlenStepStats:
        """Forward and backward of one step's micro-batches, each loss divided by
        ``global_valid_tokens`` (None: the raw loss); the arguments: docs/pipeline.md."""
        lens, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs = self._step_args(
            microbatch_inputs, microbatch_kwargs, targets, seq_lens, loss_kwargs
        )
        if self.verify_seq_lens:
            self._verify_same_seq_lens(lens)
        schedule = self.schedule
        if schedule._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("VarlenPipelineRunner.step() needs gradients enabled")
        original_loss_fn = schedule._loss_fn
        if global_valid_tokens is not None and original_loss_fn is not None:
            schedule._loss_fn = token_mean_loss(original_loss_fn, global_valid_tokens)
        saved_validate = [getattr(s, "_runtime_validate", None) for s in self.stages]
        shadowed: list[tuple[Any, str]] = []
        timer = None
        if self.time_actions:
            timer = _ActionTimer(schedule, self.stages, self.n_microbatches)
        try:
            self._prepare_stages(shadowed)
            self._ensure_initialized(arg_mbs, kwarg_mbs, target_mbs, loss_kwargs)
            stats = self._resize_recv_buffers(lens)
            step_kwargs = {"loss_kwargs": loss_kwargs} if self._step_takes_loss_kwargs else {}
            if timer is not None:
                timer.install()
            schedule._step_microbatches(
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs=False, **step_kwargs
            )
            if timer is not None:
                self.last_action_times = timer.result()
        finally:
            if timer is not None:
                timer.remove()
            schedule._loss_fn = original_loss_fn
            for stage, name in shadowed:
                delattr(stage, name)
            for stage, flag in zip(self.stages, saved_validate, strict=True):
                if flag is not None:
                    stage._runtime_validate = flag
        return stats

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        """Within it, :meth:`step` runs the micro-batches' forwards only (evaluation). Torch's own
        ``schedule.eval()`` keeps a multi-stage schedule's backward actions and relies on each
        stage skipping them; the V-shaped schedules' hand-over between a rank's two stages cannot
        be skipped that way, so their action lists are cut to the forward actions for the call."""
        schedule = self.schedule
        saved = schedule._has_backward, getattr(schedule, "pipeline_order_with_comms", None)
        schedule._has_backward = False
        if saved[1] is not None:
            schedule.pipeline_order_with_comms = {
                rank: _forward_actions(actions) for rank, actions in saved[1].items()
            }
        try:
            yield
        finally:
            schedule._has_backward = saved[0]
            if saved[1] is not None:
                schedule.pipeline_order_with_comms = saved[1]

    def _step_args(
        self,
        microbatch_inputs: Sequence[torch.Tensor] | None,
        microbatch_kwargs: Sequence[Mapping[str, Any]] | None,
        targets: Sequence[torch.Tensor] | None,
        seq_lens: Sequence[int],
        loss_kwargs: Mapping[str, Any] | None,
    ) -> tuple[
        list[int],
        list[tuple[Any, ...]] | None,
        list[dict[str, Any]],
        list[torch.Tensor] | None,
        dict[str, Any] | None,
    ]:
        """:meth:`step`'s arguments checked (one entry per micro-batch, where this rank's stages
        need them) and in the form the schedule takes: the lengths as ints, inputs as tuples,
        kwargs as dicts. Errors name the argument, before any stage state is touched."""
        n = self.n_microbatches
        lens = [int(x) for x in seq_lens]
        if len(lens) != n:
            raise ValueError(
                f"seq_lens has {len(lens)} entries but the schedule was built for {n} "
                f"micro-batches per step; pass one length per micro-batch"
            )
        if any(x < 1 for x in lens):
            raise ValueError(f"seq_lens must all be >= 1, got {lens}")
        for name, values, needed, why in (
            ("microbatch_inputs", microbatch_inputs, self.has_first_stage, "rank holds stage 0"),
            ("targets", targets, self.has_last_stage, "rank holds the last stage"),
            ("microbatch_kwargs", microbatch_kwargs, microbatch_kwargs is not None, "a dict each"),
        ):
            if needed and (values is None or len(values) != n):
                got = "None" if values is None else f"{len(values)} entries"
                raise ValueError(
                    f"{name} must have {n} entries, one per micro-batch ({why}), got {got}"
                )
        arg_mbs = None
        if self.has_first_stage:
            arg_mbs = [x if isinstance(x, tuple) else (x,) for x in microbatch_inputs]
        kwarg_mbs = [dict(kw) for kw in microbatch_kwargs or [{}] * n]
        target_mbs = list(targets) if self.has_last_stage else None
        if loss_kwargs is not None and not self._step_takes_loss_kwargs:
            raise ValueError(
                f"loss_kwargs is not supported by {type(self.schedule).__name__} in torch "
                f"{torch.__version__}; pass loss_kwargs=None"
            )
        return lens, arg_mbs, kwarg_mbs, target_mbs, dict(loss_kwargs) if loss_kwargs else None

    def _prepare_stages(self, shadowed: list[tuple[Any, str]]) -> None:
        """Clear the stages' per-step state and turn off their shape validation, which compares
        every micro-batch with micro-batch 0's shapes (torch 2.13 under
        TORCH_DISTRIBUTED_DEBUG=DETAIL only, older releases always) and so rejects variable
        lengths. Each validator shadowed is appended to ``shadowed`` as it is, so that
        :meth:`step` removes exactly those even if this stops part-way."""
        for stage in self.stages:
            stage.has_backward = self.schedule._has_backward
            stage.clear_runtime_states()
            if hasattr(stage, "_runtime_validate"):
                stage._runtime_validate = False
            for name in _SHAPE_VALIDATORS:
                if hasattr(stage, name) and name not in vars(stage):
                    setattr(stage, name, lambda *args, **kwargs: None)
                    shadowed.append((stage, name))
            if _fake_collectives(stage) and "_recv_meta" not in vars(stage):
                stage._recv_meta = functools.partial(self._fake_recv_meta, stage)
                shadowed.append((stage, "_recv_meta"))

    def _fake_recv_meta(self, stage: Any, src_stage: int) -> Any:
        """What a neighbour rank would send to ``stage`` during the schedule's shape inference,
        under fake collectives (``comm.mode = "fake_backend"``), which deliver nothing. Every
        stage of a Llama pipeline hands on one hidden state, so a stage's input is shaped as this
        rank's first stage's output, and the gradient it receives as its own output. Only a rank
        holding an earlier stage than ``stage`` (rank 0 does) knows that shape."""
        from torch.distributed.pipelining._utils import (
            _derive_grad_metas,
            _StageBackwardMeta,
            _StageForwardMeta,
        )

        if src_stage > stage.stage_index:  # the gradient of this stage's output
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(stage._stage_meta.outputs))
        for earlier in self.stages:
            outputs = getattr(getattr(earlier, "_stage_meta", None), "outputs", None)
            if earlier.stage_index < stage.stage_index and outputs is not None:
                return _StageForwardMeta(forward_metas=tuple(outputs))
        raise RuntimeError(
            f"fake collectives: stage {stage.stage_index} cannot learn its input's shape, this "
            "rank holds no earlier stage; run the pipeline as rank 0 (LOCAL_RANK=0)"
        )

    def _verify_same_seq_lens(self, lens: list[int]) -> None:
        """Raise on every rank if the ranks of the pipeline passed different ``seq_lens``."""
        stage = self.stages[0]
        local = torch.tensor(lens, dtype=torch.int64, device=stage.device)
        high, low = local.clone(), local.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=stage.group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=stage.group)
        if not torch.equal(high, low):
            raise ValueError(
                f"the pipeline's ranks passed different seq_lens (this rank: {lens}; min "
                f"{low.tolist()}, max {high.tolist()}); derive them from the same packing plan"
            )

    def _ensure_initialized(
        self,
        arg_mbs: list[tuple[Any, ...]] | None,
        kwarg_mbs: list[dict[str, Any]],
        target_mbs: list[torch.Tensor] | None,
        loss_kwargs: dict[str, Any] | None,
    ) -> None:
        """Run the schedule's one-time stage set-up now (a no-op once done), before the buffers
        are resized: inside ``_step_microbatches`` it would overwrite them."""
        optional = {"target": target_mbs[0] if target_mbs else None, "loss_kwargs": loss_kwargs}
        kwargs = {k: v for k, v in optional.items() if k in self._init_params}
        args0 = arg_mbs[0] if arg_mbs is not None else ()
        before = self._initialized_flags()
        self._init_fn(args0, kwarg_mbs[0], **kwargs)
        if self._initialized_flags() != before:
            self._layout_checked = False

    def _initialized_flags(self) -> tuple[Any, Any]:
        """The schedule's (forward, backward) set-up flags; they change when it (re-)sets up."""
        sched = self.schedule
        prefix = "_stage" if hasattr(sched, "_stage_forward_initialized") else "_stages"
        return tuple(
            getattr(sched, f"{prefix}_{k}_initialized", None) for k in ("forward", "backward")
        )

    def _resize_recv_buffers(self, lens: list[int]) -> VarlenStepStats:
        """Give every micro-batch's receive buffers that micro-batch's own length. A stage whose
        neighbour is on this rank (the middle of a V schedule) receives nothing from it: the
        schedule hands it the neighbour's tensor itself, so those buffers are left alone."""
        resized = reused = nbytes = 0
        local = {int(stage.stage_index) for stage in self.stages}
        for stage in self.stages:
            fake = _fake_collectives(stage)
            tables = [] if int(stage.stage_index) - 1 in local else [stage.args_recv_info]
            if stage.has_backward and int(stage.stage_index) + 1 not in local:
                tables.append(stage.grad_recv_info)
            for table, (mb, length) in itertools.product(tables, enumerate(lens)):
                for info in table[mb]:
                    buf = getattr(info, "buffer", None)
                    if buf is None:  # root input of stage 0, or an output without gradient
                        continue
                    if not self._layout_checked:
                        self._check_layout(stage, info, buf, lens[0])
                    if buf.shape[self.seq_dim] == length:
                        reused += 1
                    else:
                        shape = list(buf.shape)
                        shape[self.seq_dim] = length
                        # Older releases set requires_grad at set-up only; keep it.
                        buf = _empty_like_layout(shape, buf).requires_grad_(buf.requires_grad)
                        info.buffer = buf
                        resized += 1
                    if fake:  # nothing arrives: finite values instead of uninitialised memory
                        with torch.no_grad():
                            buf.fill_(_FAKE_RECV_VALUE)
                    nbytes += buf.numel() * buf.element_size()
        self._layout_checked = True
        return VarlenStepStats(buffers_resized=resized, buffers_reused=reused, recv_bytes=nbytes)

    def _check_layout(self, stage: Any, info: Any, buf: torch.Tensor, first_len: int) -> None:
        """On the first step, check the inferred buffers against ``seq_dim`` and ``seq_lens``."""
        meta = getattr(info, "tensor_meta", None)
        if meta is not None and hasattr(meta, "placements"):
            raise ValueError(
                f"stage {stage.stage_index} receives a DTensor ({info!r}); variable-length "
                f"micro-batches take plain tensors between stages only (convert TP outputs)"
            )
        if buf.dim() <= self.seq_dim or buf.shape[self.seq_dim] != first_len:
            raise ValueError(
                f"stage {stage.stage_index}'s receive buffer from micro-batch 0 has shape "
                f"{tuple(buf.shape)}, whose dim seq_dim={self.seq_dim} should equal seq_lens[0]="
                f"{first_len}: pass the token counts of the tensors crossing stages (after CP)"
            )
