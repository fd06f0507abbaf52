"""Micro-benchmark: receive shapes from the packing plan vs a shape exchange, on 2 PP ranks.

    python -m torchtitan_wlb.tools.pp_shape_bench --json

On gloo (PP = 2, 1F1B, a tiny torchtitan llama3): a full varlen step, the runner against torch's
own step on equal lengths, its buffer re-sizing, and three ways to exchange shapes instead. Why
and every key: docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtitan_wlb.tools.cli import ToolParser, json_text, require_at_least


def _build_pipeline(args: argparse.Namespace, mesh: Any) -> Any:
    """torch's 1F1B schedule of a tiny llama3 split into 2 stages."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import JobConfig
    from torchtitan.distributed.pipeline_parallel import (
        build_pipeline_schedule,
        generate_llm_fqn_per_model_part,
        pipeline_module_split,
    )
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    model_args = TransformerModelArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=max(1, args.dim // 64),
        vocab_size=args.vocab,
        multiple_of=64,
        max_seq_len=args.max_len,
    )
    torch.manual_seed(0)
    model = Transformer(model_args)
    with torch.no_grad():
        model.init_weights()
    fqns = generate_llm_fqn_per_model_part(2, args.layers, 1, 1)
    stages, _ = pipeline_module_split(model, mesh, "1F1B", torch.device("cpu"), fqns)
    job = JobConfig()
    job.parallelism.pipeline_parallel_schedule = "1F1B"
    job.parallelism.pipeline_parallel_degree = 2
    job.parallelism.pipeline_parallel_microbatch_size = 1
    job.training.local_batch_size = args.n_mb
    return build_pipeline_schedule(job, stages, cross_entropy_loss)


def _timed(fn, reps: int) -> float:
    """Median wall time of ``fn`` in seconds, max over ranks, each rep started after a barrier."""
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class _Inputs:
    """Random micro-batch lengths, tokens and labels from one seeded generator (alike on every
    rank, drawn in the same order)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.g = args, torch.Generator().manual_seed(0)

    def lengths(self) -> list[int]:
        a = self.args
        return torch.randint(a.min_len, a.max_len + 1, (a.n_mb,), generator=self.g).tolist()

    def tokens(self, lengths: list[int]) -> list[list[torch.Tensor]]:
        """Random tokens, then labels, of micro-batches of ``lengths`` tokens."""
        vocab = self.args.vocab
        return [
            [torch.randint(0, vocab, (1, n), generator=self.g) for n in lengths] for _ in (0, 1)
        ]


def _varlen_step(runner: Any, lengths: list[int], tokens: Any, labels: Any) -> None:
    runner.step(
        tokens if runner.has_first_stage else None,
        None,
        labels if runner.has_last_stage else None,
        lengths,
        global_valid_tokens=sum(lengths),
    )


def _worker(rank: int, args: argparse.Namespace, init_file: str, out_file: str) -> None:
    from torchtitan_wlb.pipeline import VarlenPipelineRunner

    torch.set_num_threads(args.threads)
    url, timeout = f"file://{init_file}", timedelta(seconds=300)
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2, timeout=timeout)
    try:
        mesh = dist.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        runner = VarlenPipelineRunner(_build_pipeline(args, mesh))
        inputs = _Inputs(args)
        results, alt = _varlen_times(runner, inputs, args.reps)
        results.update(_exchange_times(rank == 0, alt[0], args.dim, args.reps))
        results.update(_stock_times(rank, args, mesh, runner, inputs))
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _varlen_times(
    runner: Any, inputs: _Inputs, reps: int
) -> tuple[dict[str, float], list[list[int]]]:
    """Full varlen steps with new lengths every step, and the receive buffers' re-sizing alone
    (two length vectors alternated so that every call re-sizes); also those two vectors."""
    batches = [(lens, *inputs.tokens(lens)) for lens in (inputs.lengths() for _ in range(reps + 1))]
    _varlen_step(runner, *batches[0])  # first step: schedule set-up and shape inference
    it = iter(batches[1:])
    results = {"step_ms": 1e3 * _timed(lambda: _varlen_step(runner, *next(it)), reps)}
    alt = [inputs.lengths(), inputs.lengths()]
    counter = iter(range(10**9))
    results["resize_us"] = 1e6 * _timed(
        lambda: runner._resize_recv_buffers(alt[next(counter) % 2]), reps * 20
    )
    return results, alt


def _exchange_times(send: bool, lengths: list[int], dim: int, reps: int) -> dict[str, float]:
    """Shape exchange, stage 0 -> stage 1: all lengths in one tensor, one tensor per micro-batch,
    or one pickled shape per micro-batch (as torch's shape inference does)."""
    lens_t = torch.tensor(lengths, dtype=torch.int64)

    def exchange(tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if send:
                dist.send(t, dst=1)
            else:
                dist.recv(torch.empty_like(t), src=0)

    def exchange_objects() -> None:
        for n in lengths:
            if send:
                dist.send_object_list([(1, n, dim)], dst=1)
            else:
                dist.recv_object_list([None], src=0)

    per_mb = [torch.tensor([n]) for n in lengths]
    return {
        key: 1e6 * _timed(fn, reps * 20)
        for key, fn in (
            ("exchange_batched_us", lambda: exchange([lens_t])),
            ("exchange_per_mb_tensor_us", lambda: exchange(per_mb)),
            ("exchange_per_mb_object_us", exchange_objects),
        )
    }


def _stock_times(
    rank: int, args: argparse.Namespace, mesh: Any, runner: Any, inputs: _Inputs
) -> dict[str, float]:
    """The runner against torch's own step on equal-length micro-batches (a fresh pipeline for
    torch), the two alternated so that load from other processes hits both alike."""
    stock_schedule = _build_pipeline(args, mesh)
    eq_lens = [(args.min_len + args.max_len) // 2] * args.n_mb
    eq_tokens, eq_labels = inputs.tokens(eq_lens)
    batch_tokens, batch_labels = torch.cat(eq_tokens), torch.cat(eq_labels)

    def stock_step() -> None:
        if rank == 0:
            stock_schedule.step(batch_tokens, target=None, losses=None, return_outputs=False)
        else:
            stock_schedule.step(target=batch_labels, losses=[], return_outputs=False)

    stock_step()
    _varlen_step(runner, eq_lens, eq_tokens, eq_labels)
    stock_times, runner_times = [], []
    for _ in range(args.reps):
        stock_times.append(_timed(stock_step, 1))
        runner_times.append(_timed(lambda: _varlen_step(runner, eq_lens, eq_tokens, eq_labels), 1))
    return {
        "stock_step_ms": 1e3 * statistics.median(stock_times),
        "runner_equal_step_ms": 1e3 * statistics.median(runner_times),
    }


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.pp_shape_bench", __doc__)
    for flag, default, text in (
        ("--n-mb", 4, "micro-batches per step"),
        ("--min-len", 64, "shortest micro-batch (tokens)"),
        ("--max-len", 1024, "longest micro-batch (tokens)"),
        ("--dim", 128, "model width"),
        ("--layers", 2, "transformer layers"),
        ("--vocab", 512, "vocabulary size"),
        ("--reps", 10, "timed steps per measurement"),
        ("--threads", 1, "torch threads per rank"),
    ):
        p.add_argument(flag, type=int, default=default, help=text)
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser()
    args = p.parse_args(argv)
    if args.n_mb < 2:
        p.error(f"--n-mb must be >= 2 (1F1B on 2 stages), got {args.n_mb}")
    if not 1 <= args.min_len <= args.max_len:
        p.error(f"need 1 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
    require_at_least(p, args, ("dim", "layers", "vocab", "reps", "threads"))
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(args, init_file, out_file), nprocs=2, join=True)
        with open(out_file) as f:
            results = json.load(f)
    results["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    results["torch"] = torch.__version__
    print(json_text(results, indent=None if args.json else 2))
    return results


if __name__ == "__main__":
    main()
