"""Training throughput of one Llama 3 model under three attentions, on the same documents: ours
(``wlb``: document attention from the packed documents' boundaries), TorchTitan's FlexAttention
with its block-causal mask built from EOS tokens (``flex``), and TorchTitan's SDPA, causal over the
whole packed sequence without document masking (``sdpa``: the Plain baseline), eager and compiled.

    python -m torchtitan_wlb.tools.attention_bench --flavor tiny --context-len 512 --steps 3 \\
        --warmup 1 --modes eager --json
    python -m torchtitan_wlb.tools.attention_bench --flavor tiny --context-len 512 --steps 3 \\
        --warmup 1 --compile-backend aot_eager --ac full --json   # slow: about 50 s on 2 CPU cores
    python -m torchtitan_wlb.tools.attention_bench --device cuda --flavor byte_1B \\
        --context-len 65536 --steps 6 --warmup 2 --ac full --lengths FILE \\
        --lengths-context 131072 --runs wlb:eager,flex:eager,wlb:compiled,flex:compiled,sdpa:eager \\
        --max-seconds 170 --profile --out attention_bench.json --json   # gpu: FILE: lengths

What is measured and every JSON key: docs/attention_bench.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import re
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_wlb.tools.cli import ToolParser, json_text, require_at_least
from torchtitan_wlb.workloads import GENERATORS, cut_stream, cycle_to, generate, load_lengths

VARIANTS = ("wlb", "flex", "sdpa", "varlen")
DEFAULT_VARIANTS = ("wlb", "flex", "sdpa")
MODES = ("eager", "compiled")
AC_MODES = ("none", "full", "op")
POSITIONS = ("packed", "document")
SHOWN = (  # the text table's columns: JSON key, header, format
    ("tokens_per_s", "tokens/s", ",.0f"),
    ("step_s_mean", "step s", ".3f"),
    ("step_s_p95", "p95 s", ".3f"),
    ("first_step_s", "first s", ".1f"),
    ("useful_tflops", "useful TF/s", ".4g"),
    ("useful_mfu", "MFU", ".1%"),
    ("computed_tflops", "computed TF/s", ".4g"),
    ("peak_memory_gib", "peak GiB", ".1f"),
    ("recompiles", "recompiles", "d"),
)


@dataclasses.dataclass
class MicroBatch:
    """One packed sequence: its documents, input tokens (an EOS at every document's end, nowhere
    else), next-token labels and per-document positions, on the host."""

    doc_lens: np.ndarray
    inputs: Any  # int64 [1, context_len]
    labels: Any  # int64 [1, context_len]
    doc_positions: Any  # int64 [1, context_len], restarting at 0 in every document


def pack_sequences(lengths: np.ndarray, context_len: int, count: int) -> list[np.ndarray]:
    """``count`` sequences of exactly ``context_len`` tokens from the documents in order, as
    TorchTitan's loader cuts them (a document crossing a sequence end continues in the next one):
    every variant sees the same tokens, and TorchTitan's fixed-length inputs need no padding."""
    lengths = cycle_to(lengths, count * context_len)
    pieces = cut_stream(lengths, context_len)
    seq = (np.cumsum(pieces) - 1) // context_len  # the sequence each piece ends in
    return [pieces[seq == i] for i in range(count)]


def scaled_lengths(args: argparse.Namespace) -> np.ndarray:
    """``--lengths`` (scaled from ``--lengths-context`` to ``--context-len`` when given) or
    ``--generator``'s lengths, clipped to ``[1, context_len]``."""
    if not args.lengths:
        return generate(args.generator, 4096, args.context_len, seed=args.seed)
    lens = load_lengths(args.lengths)
    if args.lengths_context:
        lens = np.rint(lens * (args.context_len / args.lengths_context)).astype(np.int64)
    return np.clip(lens, 1, args.context_len)


def make_micro_batch(
    doc_lens: np.ndarray, vocab_size: int, eos_id: int, rng: np.random.Generator
) -> MicroBatch:
    """Random token ids other than ``eos_id``, an EOS closing every document: the boundaries
    TorchTitan's block-causal mask finds are the ones ``doc_lens`` gives ours (checked against
    TorchTitan's own EOS parser)."""
    import torch
    from torchtitan.models.attention import create_varlen_metadata_for_document

    n = int(doc_lens.sum())
    ids = rng.integers(0, vocab_size - 1, size=n + 1)
    ids[ids >= eos_id] += 1  # every id but EOS
    ends = np.cumsum(doc_lens)
    ids[ends - 1] = eos_id
    inputs = torch.from_numpy(ids[:n].copy())[None]
    starts = np.repeat(ends - doc_lens, doc_lens)
    positions = torch.from_numpy(np.arange(n) - starts)[None]
    titan_cu = create_varlen_metadata_for_document(inputs, eos_id).cu_seq_q.numpy()
    if not np.array_equal(titan_cu, np.concatenate([[0], ends])):
        raise RuntimeError("TorchTitan's EOS parser finds other document boundaries than ours")
    return MicroBatch(doc_lens, inputs, torch.from_numpy(ids[1:].copy())[None], positions)


def model_args(variant: str, flavor: str, context_len: int) -> Any:
    """The flavor's arguments for ``variant``: ours, or TorchTitan's Llama 3 arguments with its
    flex block-causal or sdpa causal attention; RoPE covers ``context_len`` in all three."""
    from torchtitan.models.llama3 import TransformerModelArgs

    from torchtitan_wlb.models.llama3_wlb import llama3_wlb_args

    ours = dataclasses.replace(llama3_wlb_args[flavor], max_seq_len=context_len)
    if variant == "wlb":
        return ours
    shared = {f.name: getattr(ours, f.name) for f in dataclasses.fields(TransformerModelArgs)}
    attn_type, mask_type = {
        "flex": ("flex", "block_causal"),
        "sdpa": ("sdpa", "causal"),
        "varlen": ("varlen", "block_causal"),
    }[variant]
    return TransformerModelArgs(**shared | {"attn_type": attn_type, "attn_mask_type": mask_type})


def build_model(variant: str, args: argparse.Namespace, weights: dict | None, device: Any) -> Any:
    """``variant``'s model on ``device``, TorchTitan's initialisation from ``--seed``, then
    ``weights`` (the first model's state dict) loaded: one set of weights for every variant (the
    three share TorchTitan's parameter names)."""
    import torch
    from torchtitan.models.llama3.model.model import Transformer

    from torchtitan_wlb.models.llama3_wlb import WLBTransformer

    cls = WLBTransformer if variant == "wlb" else Transformer
    with torch.device("meta"):
        model = cls(model_args(variant, args.flavor, args.context_len))
    model.to_empty(device=device)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    if weights is not None:
        model.load_state_dict(weights)
    return model


def prepare_model(model: Any, variant: str, mode: str, args: argparse.Namespace) -> Callable:
    """TorchTitan's activation checkpointing, then (compiled mode) its per-block compile, in
    ``parallelize_llama``'s order; returns the loss function (compiled too, as TorchTitan's
    default ``components = ["model", "loss"]``)."""
    import torch
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config.job_config import ActivationCheckpoint, Compile
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_compile

    from torchtitan_wlb.models.llama3_wlb import mark_lengths_dynamic

    compiled = mode == "compiled"
    if args.ac != "none":
        ac = ActivationCheckpoint(mode="full" if args.ac == "full" else "selective")
        ac.selective_ac_option = "op"
        apply_ac(model, ac, model_compile_enabled=compiled, op_sac_save_list=_op_sac_save_list)
    if not compiled:
        return cross_entropy_loss
    apply_compile(model, Compile(enable=True, backend=args.compile_backend))
    if variant == "wlb":  # as our trainer does: one graph for every packed length
        for block in model.layers.values():
            block.register_forward_pre_hook(mark_lengths_dynamic, with_kwargs=True)
    return torch.compile(cross_entropy_loss, backend=args.compile_backend)


def attention_masks(model: Any, variant: str, batch: Any, args: argparse.Namespace) -> Any:
    """What each variant's forward takes as ``attention_masks``, built per step as the trainers
    build it: our metadata from the documents' lengths, TorchTitan's block mask from the EOS
    tokens (its ``get_attention_masks``), nothing for causal SDPA."""
    from torchtitan_wlb.attention import metadata_from_doc_lens
    from torchtitan_wlb.data.tokenizer import ByteTokenizer

    if variant == "wlb":
        return metadata_from_doc_lens(batch.doc_lens, batch.inputs.device, args.attention_backend)
    if variant in ("flex", "varlen"):
        return model.get_attention_masks(batch.inputs, ByteTokenizer())
    return None


@dataclasses.dataclass
class Trainer:
    """One variant's model, optimizer and loss, with TorchTitan's single-device defaults: AdamW
    (its default hyperparameters, fused on CUDA), gradient clipping at its ``max_norm``, bf16
    autocast on CUDA (its AMP without FSDP), float32 on CPU."""

    model: Any
    variant: str
    loss_fn: Callable
    args: argparse.Namespace
    train: bool
    optimizer: Any = None

    def __post_init__(self) -> None:
        import torch
        from torchtitan.config.job_config import Optimizer, Training

        self.cuda = next(self.model.parameters()).device.type == "cuda"
        opt, self.max_norm = Optimizer(), Training().max_norm
        if self.train:
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=self.args.lr,
                betas=(opt.beta1, opt.beta2),
                eps=opt.eps,
                weight_decay=opt.weight_decay,
                **({"fused": True} if self.cuda else {"foreach": True}),
            )

    def amp(self) -> contextlib.AbstractContextManager:
        import torch

        if not self.cuda:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=torch.bfloat16)

    def step(self, batch: MicroBatch) -> float:
        """One training step on ``batch`` (masks built inside it); its loss (a device sync)."""
        import torch

        positions = batch.doc_positions if self.args.positions == "document" else None
        grad = torch.enable_grad() if self.train else torch.no_grad()
        with grad, self.amp():
            masks = attention_masks(self.model, self.variant, batch, self.args)
            pred = self.model(batch.inputs, attention_masks=masks, positions=positions)
            loss = self.loss_fn(pred, batch.labels) / batch.labels.numel()
        del pred
        if self.train:
            loss.backward()
            params = list(self.model.parameters())
            torch.nn.utils.clip_grad_norm_(params, self.max_norm, foreach=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def cpu_forward_only(variant: str, device: Any) -> str | None:
    """Why ``variant`` cannot train on ``device``, or None: torch's FlexAttention has no backward
    on a CPU (``NotImplementedError`` from ``flex_attention``), so there it runs forward only."""
    if variant == "flex" and device.type == "cpu":
        return "FlexAttention has no backward on CPU: forward only"
    return None


@dataclasses.dataclass
class FlopsModel:
    """Model FLOPs of a step (torchtitan_wlb/mfu.py): ``6 N`` per token, 12 per causal pair,
    head dimension, head and layer; a third of it forward only."""

    per_token: float
    per_pair: float

    def step(self, doc_lens: np.ndarray, train: bool) -> float:
        from torchtitan_wlb.mfu import FlopsCounter

        counter = FlopsCounter()
        counter.documents(doc_lens)
        return counter.flops(self.per_token, self.per_pair) / (1 if train else 3)


def _graphs_built() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def timed_steps(trainer: Trainer, batches: list[MicroBatch], sync: Callable) -> Iterator[tuple]:
    """``(seconds, loss, graphs built so far)`` of each step: wall time between device syncs."""
    for batch in batches:
        sync()
        start = time.perf_counter()
        loss = trainer.step(batch)  # reads the loss: a sync
        sync()
        yield time.perf_counter() - start, loss, _graphs_built()


def profile_step(trainer: Trainer, batch: MicroBatch, device: Any, top: int = 20) -> list[dict]:
    """One more step on ``batch`` under torch's profiler (after the timed steps, which it would
    slow down): the ``top`` operators by their own GPU time (CPU time on a CPU), to tell
    where a variant's step goes, attention kernels included."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        trainer.step(batch)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [
        {"op": e.key, "self_ms": getattr(e, key) / 1e3, "calls": e.count}
        for e in events
        if getattr(e, key) > 0
    ]


def run_one(
    variant: str, mode: str, batches: list[MicroBatch], args: argparse.Namespace, shared: dict
) -> dict:
    """One (variant, mode) run from fresh compile caches: every step timed and its loss kept.
    ``shared``: the device, the first model's weights (set here by the first run), FLOPs."""
    import torch

    device = shared["device"]
    gc.collect()  # what a failed run left behind
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()  # this run compiles for itself: its first step pays its own compiles
    graphs0 = _graphs_built()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(variant, args, shared.get("weights"), device)
    if "weights" not in shared:
        shared["weights"] = {
            k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
        }
    note = cpu_forward_only(variant, device)
    train = not (args.forward_only or note)
    loss_fn = prepare_model(model, variant, mode, args)
    trainer = Trainer(model, variant, loss_fn, args, train)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    try:
        steps = list(timed_steps(trainer, batches, sync))
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        profiled = profile_step(trainer, batches[-1], device) if args.profile else None
    finally:
        del trainer, model
        torch._dynamo.reset()  # compiled graphs let go of the model before the next one is built
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    seconds, losses, graphs = (list(x) for x in zip(*steps, strict=True))
    result = {"variant": variant, "mode": mode, "trained": train, "note": note}
    result |= timing(seconds, batches, args, shared["flops"], variant, train)
    result |= {"losses": losses, "peak_memory_gib": peak}
    result["process_rss_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result["compiled_graphs"] = graphs[-1] - graphs0
    result["recompiles"] = graphs[-1] - graphs[0]
    if profiled is not None:
        result["profile"] = profiled
    return result


def timing(
    seconds: list[float],
    batches: list[MicroBatch],
    args: argparse.Namespace,
    flops: FlopsModel,
    variant: str,
    train: bool,
) -> dict:
    """Throughput over the steps after ``--warmup``: tokens/s, step-time statistics, useful
    (document-masked) and computed TFLOP/s (sdpa: full causal over the sequence), MFU."""
    timed = np.asarray(seconds[args.warmup :])
    kept = batches[args.warmup :]
    tokens = sum(b.labels.numel() for b in kept)
    useful = sum(flops.step(b.doc_lens, train) for b in kept)
    full = [np.array([b.labels.numel()]) for b in kept]
    computed = sum(flops.step(d, train) for d in full) if variant == "sdpa" else useful
    total = float(timed.sum())
    peak = args.peak_flops
    return {
        "tokens_per_s": tokens / total,
        "tokens_per_s_steps": [b.labels.numel() / s for b, s in zip(kept, timed, strict=True)],
        "step_s": list(seconds),
        "step_s_mean": float(timed.mean()),
        "step_s_p95": float(np.percentile(timed, 95)),
        "step_s_max": float(timed.max()),
        "first_step_s": seconds[0],
        "useful_tflops": useful / total / 1e12,
        "useful_mfu": useful / total / peak if peak else None,
        "computed_tflops": computed / total / 1e12,
        "computed_mfu": computed / total / peak if peak else None,
    }


def setup(args: argparse.Namespace) -> dict:
    """The device, the micro-batches on it (one per step, identical for every run), the FLOPs
    model and the ``config`` object of the JSON."""
    import torch
    import torchtitan

    from torchtitan_wlb.attention import resolve_backend
    from torchtitan_wlb.data.tokenizer import ByteTokenizer
    from torchtitan_wlb.mfu import attention_flops_per_pair, resolve_peak_flops
    from torchtitan_wlb.models.llama3_wlb import WLBTransformer

    device = torch.device(args.device)
    ours = model_args("wlb", args.flavor, args.context_len)
    with torch.device("meta"):
        params, per_token = ours.get_nparams_and_flops(WLBTransformer(ours), 0)
    eos = ByteTokenizer().eos_id
    rng = np.random.default_rng(args.seed)
    seqs = pack_sequences(scaled_lengths(args), args.context_len, args.steps)
    batches = []
    for doc_lens in seqs:
        b = make_micro_batch(doc_lens, ours.vocab_size, eos, rng)
        moved = {k: getattr(b, k).to(device) for k in ("inputs", "labels", "doc_positions")}
        batches.append(dataclasses.replace(b, **moved))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak, peak_line = resolve_peak_flops(args.peak_tflops, name, device.type == "cpu")
    args.peak_flops = peak
    config = {
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "unknown"),
        "flavor": args.flavor,
        "params": params,
        "context_len": args.context_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "lengths": args.lengths or f"generator:{args.generator}(seed={args.seed})",
        "lengths_context": args.lengths_context or None,
        "documents_per_step": [len(s) for s in seqs],
        "longest_document_per_step": [int(s.max()) for s in seqs],
        "eos_id": eos,
        "precision": "bfloat16 autocast" if device.type == "cuda" else "float32",
        "attention_backend": resolve_backend(args.attention_backend, device),
        "activation_checkpointing": args.ac,
        "positions": args.positions,
        "compile_backend": args.compile_backend,
        "lr": args.lr,
        "peak_tflops": peak / 1e12 if peak else None,
        "peak_source": peak_line,
        "memory": "torch.cuda.max_memory_allocated" if device.type == "cuda" else None,
    }
    per_pair = attention_flops_per_pair(ours)
    return {"device": device, "batches": batches, "flops": FlopsModel(per_token, per_pair)} | {
        "config": config
    }


def comparison(runs: list[dict]) -> dict:
    """Per mode, ``wlb``'s tokens/s over each other variant's: null where either did not run, or
    one trained and the other ran forward only."""
    found = {(r["variant"], r["mode"]): r for r in runs if "tokens_per_s" in r}
    out = {}
    for mode in [m for m in MODES if any(r["mode"] == m for r in runs)]:
        ours = found.get(("wlb", mode))
        row = {}
        for other in [v for v in VARIANTS[1:] if any(r["variant"] == v for r in runs)]:
            theirs = found.get((other, mode))
            same = ours is not None and theirs is not None and ours["trained"] == theirs["trained"]
            row[f"wlb_over_{other}"] = (
                ours["tokens_per_s"] / theirs["tokens_per_s"] if same else None
            )
        out[mode] = row
    return out


def run_list(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (variant, mode) runs in order: ``--runs``, else every variant's modes in turn."""
    if args.runs:
        return list(args.runs)
    return [(v, m) for v in args.variants or DEFAULT_VARIANTS for m in args.modes or MODES]


def run(args: argparse.Namespace, emit: Callable[[dict], None]) -> dict:
    """Every run asked for, in order; a run that fails is recorded with its error and the next
    one runs; none starts after ``--max-seconds`` (listed as skipped). ``emit`` gets the results
    after every run (``--out``)."""
    start = time.monotonic()
    shared = setup(args)
    results: dict = {"config": shared["config"], "runs": [], "comparison": {}}
    for variant, mode in run_list(args):
        entry: dict = {"variant": variant, "mode": mode}
        if args.max_seconds and time.monotonic() - start > args.max_seconds:
            results["runs"].append(entry | {"skipped": f"--max-seconds {args.max_seconds:g}"})
            continue
        print(f"attention_bench: {variant} {mode} ...", file=sys.stderr, flush=True)
        try:
            entry = run_one(variant, mode, shared["batches"], args, shared)
        except Exception as exc:  # an OOM, a compiler failure: recorded, the next run goes on
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            entry["error"] = f"{type(exc).__name__}: {first}"
        results["runs"].append(entry)
        results["comparison"] = comparison(results["runs"])
        emit(results)
    emit(results)
    return results


def table(results: dict) -> str:
    """The runs as a text table, each run's losses below, then the comparison line."""
    head = f"{'variant':8s} {'mode':9s} " + " ".join(f"{h:>13s}" for _, h, _ in SHOWN)
    lines = [head]
    for r in results["runs"]:
        lead = f"{r['variant']:8s} {r['mode']:9s} "
        if "tokens_per_s" not in r:
            lines.append(lead + r.get("error", f"skipped: {r.get('skipped')}"))
            continue
        cells = [format(r[k], f) if r.get(k) is not None else "n/a" for k, _, f in SHOWN]
        lines.append(
            lead + " ".join(f"{c:>13s}" for c in cells) + (f"  ({r['note']})" if r["note"] else "")
        )
    for r in results["runs"]:
        if "losses" in r:
            losses = " ".join(f"{x:.4f}" for x in r["losses"])
            lines.append(f"losses {r['variant']:5s} {r['mode']:9s} {losses}")
    for mode, row in results["comparison"].items():
        ratios = ", ".join(
            f"{k.replace('_over_', ' / ')} {v:.3f}" if v is not None else f"{k}: n/a"
            for k, v in row.items()
        )
        lines.append(f"tokens/s {mode}: {ratios}")
    return "\n".join(lines)


def _subset(accepted: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """argparse type: a comma-separated, non-empty subset of ``accepted``, in the order given."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        if not names or any(n not in accepted for n in names):
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {','.join(accepted)}, got {text!r}"
            )
        return names

    return parse


def _runs(text: str) -> tuple[tuple[str, str], ...]:
    """argparse type of ``--runs``: comma-separated ``VARIANT:MODE`` pairs, each at most once."""
    pairs = tuple(tuple(item.strip().split(":")) for item in text.split(",") if item.strip())
    ok = all(len(x) == 2 and x[0] in VARIANTS and x[1] in MODES for x in pairs)
    if not pairs or not ok or len(set(pairs)) != len(pairs):
        raise argparse.ArgumentTypeError(
            f"expected distinct VARIANT:MODE pairs, VARIANT one of {','.join(VARIANTS)} and MODE "
            f"one of {','.join(MODES)}; got {text!r}"
        )
    return pairs  # type: ignore[return-value]


def _device(text: str) -> str:
    """argparse type of ``--device``: ``cpu``, ``cuda`` or ``cuda:N``."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.attention_bench", __doc__)
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--flavor", default="tiny", help="a llama3_wlb flavor (docs/models.md)")
    p.add_argument("--context-len", type=int, default=1024, help="tokens per packed sequence")
    p.add_argument("--lengths", default=None, help="JSON list / .npy / text file of doc lengths")
    p.add_argument(
        "--lengths-context", type=int, default=0, help="scale --lengths from this context"
    )
    p.add_argument("--generator", default="longtail_scaled", choices=list(GENERATORS))
    p.add_argument("--seed", type=int, default=0, help="documents, tokens and weights")
    p.add_argument("--steps", type=int, default=4, help="training steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the figures")
    p.add_argument(
        "--variants",
        type=_subset(VARIANTS),
        default=None,
        help="wlb,flex,sdpa (default), varlen (TorchTitan's varlen, CUDA only)",
    )
    p.add_argument("--modes", type=_subset(MODES), default=None, help="eager,compiled (default)")
    p.add_argument(
        "--runs", type=_runs, default=None, help="VARIANT:MODE,... in this order (no --variants)"
    )
    p.add_argument("--max-seconds", type=float, default=0, help="start no run after; 0: none")
    p.add_argument("--compile-backend", choices=("inductor", "aot_eager"), default="inductor")
    p.add_argument("--ac", choices=AC_MODES, default="none", help="activation checkpointing")
    p.add_argument("--positions", choices=POSITIONS, default="packed", help="RoPE positions")
    p.add_argument("--attention-backend", default="auto", help="wlb's attention backend")
    p.add_argument("--lr", type=float, default=8e-4, help="AdamW learning rate, constant")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="MFU's peak; 0: the table's")
    p.add_argument("--forward-only", action="store_true", help="no backward or optimizer step")
    p.add_argument(
        "--profile", action="store_true", help="one more step per run: its top operators"
    )
    p.add_argument("--out", default=None, help="also write the JSON here, after every run")
    p.add_argument("--json", action="store_true", help="print the JSON result last")
    return p


def check_args(p: ToolParser, args: argparse.Namespace) -> None:
    """``p.error`` for any argument the runs would trip over, before any model is built."""
    require_at_least(p, args, ("steps", "context_len"))
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup = {args.warmup} must be >= 0 and below --steps = {args.steps}")
    if args.lengths_context < 0 or (args.lengths_context and not args.lengths):
        p.error(f"--lengths-context = {args.lengths_context} needs --lengths and must be >= 1")
    if args.peak_tflops < 0 or args.lr <= 0:
        p.error(f"--peak-tflops = {args.peak_tflops} must be >= 0 and --lr = {args.lr} > 0")
    import torch

    from torchtitan_wlb.attention import resolve_backend
    from torchtitan_wlb.models.llama3_wlb import llama3_wlb_args
    from torchtitan_wlb.tools.cp_bench import check_device

    if args.flavor not in llama3_wlb_args:
        p.error(f"--flavor {args.flavor!r} is not one of {', '.join(llama3_wlb_args)}")
    check_device(p, args.device)
    if args.runs and (args.variants or args.modes):
        p.error("--runs lists the runs: give it without --variants and --modes")
    if args.max_seconds < 0:
        p.error(f"--max-seconds = {args.max_seconds:g} must be >= 0 (0: no limit)")
    if any(v == "varlen" for v, _ in run_list(args)) and args.device == "cpu":
        p.error("variant varlen: TorchTitan's varlen attention runs on CUDA only")
    try:
        resolve_backend(args.attention_backend, torch.device(args.device))
    except ValueError as exc:
        p.error(f"--attention-backend: {exc}")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)

    def emit(results: dict) -> None:
        if args.out:
            Path(args.out).write_text(json_text(results, indent=1) + "\n")

    try:
        results = run(args, emit)
    except (ValueError, OSError) as exc:  # a bad lengths file, an unwritable --out: one line
        p.error(str(exc))
    print(table(results), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json_text(results))
    return 1 if any("error" in r for r in results["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
