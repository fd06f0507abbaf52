"""Build a config's whole 4D layout on one CPU process with fake collectives, without training.

    python -m torchtitan_wlb.tools.dry_run train_configs/paper/*.toml [--ngpu N] [-- overrides]

For every config this creates TorchTitan's fake process group with as many ranks as the layout
needs, then constructs the full WLBTrainer as rank 0 would: device mesh, the model on the meta
device, pipeline split and schedule (with the variable-length runner), TP/FSDP plans, rank 0's
weights, optimizer and the data pipeline. What fails on a cluster because of the layout (degrees
that do not divide heads or layers, too few micro-batches for the schedule, an unknown flavor)
fails here in seconds. No training step runs (use ``COMM_MODE=fake_backend ./run_train.sh`` for a
one-step dry run of a layout small enough to compute on a CPU).

Tokenizer and data are swapped for the built-in ones so that no cluster assets are needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from torchtitan_wlb import cpu_support

cpu_support.activate()


def layout_world_size(job_config) -> int:
    """Processes the config's parallel degrees need (dp_shard = -1 counts as 1)."""
    p = job_config.parallelism
    shard = max(p.data_parallel_shard_degree, 1)
    return (
        p.data_parallel_replicate_degree
        * shard
        * p.context_parallel_degree
        * p.tensor_parallel_degree
        * p.pipeline_parallel_degree
    )


def dry_run(config_file: str, ngpu: int | None, overrides: list[str]) -> tuple[int, float]:
    """Build the trainer of ``config_file``; returns (world size, seconds)."""
    import torch
    from torchtitan.config import ConfigManager

    from torchtitan_wlb.trainer import WLBTrainer

    with tempfile.TemporaryDirectory() as dump:
        args = [
            "--job.config_file", config_file, "--model.hf_assets_path", "",
            "--training.dataset", "wlb_builtin", "--training.dataset_path", "",
            "--comm.mode", "fake_backend", "--training.steps", "1",
            "--checkpoint.no-enable", "--job.dump_folder", dump, "--metrics.no-enable-tensorboard",
            *overrides,
        ]  # fmt: skip
        probe = ConfigManager().parse_args(args)
        world = ngpu or layout_world_size(probe)
        os.environ.update(NGPU=str(world), LOCAL_RANK="0", RANK="0", WORLD_SIZE=str(world))
        start = time.perf_counter()
        trainer = WLBTrainer(ConfigManager().parse_args(args))
        try:
            elapsed = time.perf_counter() - start
        finally:
            trainer.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return world, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_wlb.tools.dry_run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("configs", nargs="+", help="TOML config files")
    parser.add_argument("--ngpu", type=int, default=None, help="world size (default: from degrees)")
    argv = sys.argv[1:] if argv is None else argv
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    from torchtitan.tools.logging import init_logger

    init_logger()
    failed = 0
    for config in args.configs:
        if not os.path.isfile(config):
            print(f"FAIL {config}: no such file", file=sys.stderr)
            failed += 1
            continue
        try:
            world, seconds = dry_run(config, args.ngpu, overrides)
        except Exception as e:  # report every config, then exit non-zero
            print(f"FAIL {config}: {type(e).__name__}: {e}", file=sys.stderr)
            failed += 1
        else:
            print(f"OK   {config}: {world} ranks built in {seconds:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
