"""Build a config's whole 4D layout on one CPU process with fake collectives, without training.

    python -m torchtitan_wlb.tools.dry_run train_configs/paper/*.toml
    python -m torchtitan_wlb.tools.dry_run train_configs/llama3_70b_128k.toml --verbose
    python -m torchtitan_wlb.tools.dry_run train_configs/debug_cpu.toml --ngpu 4 \\
        -- --parallelism.tensor_parallel_degree 2

One OK or FAIL line per config, exit status 1 when one fails; what is built: docs/slurm.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import sys
import tempfile
import time
import warnings
from typing import Any

from torchtitan_wlb import cpu_support

cpu_support.activate()

from torchtitan_wlb import log_filter  # noqa: E402
from torchtitan_wlb.tools.cli import ToolParser, progress  # noqa: E402


def _layout_trainer_class() -> type:
    """WLBTrainer whose model stays on the meta device: parallelising runs as usual, but the
    weights of a 70B layout (gigabytes on rank 0 alone) are never materialised."""
    from torchtitan_wlb.trainer import WLBTrainer

    class LayoutTrainer(WLBTrainer):
        # TorchTitan's Trainer assigns self.train_spec in __init__: wrap its parallelize_fn then
        # (the pipeline split parallelises each stage with it).
        @property
        def train_spec(self) -> Any:
            return self._layout_train_spec

        @train_spec.setter
        def train_spec(self, spec: Any) -> None:
            def parallelize(model: Any, *args: Any, **kwargs: Any) -> Any:
                model = spec.parallelize_fn(model, *args, **kwargs)
                model.to_empty = lambda *, device, recurse=True: model
                model.init_weights = lambda *a, **k: None
                return model

            self._layout_train_spec = dataclasses.replace(spec, parallelize_fn=parallelize)

    return LayoutTrainer


def dry_run(config_file: str, ngpu: int | None, overrides: list[str]) -> tuple[str, float]:
    """Build the trainer of ``config_file`` on the meta device; returns (description, seconds)."""
    import torch
    from torchtitan.config import ConfigManager

    from torchtitan_wlb.validate import layout_degrees, layout_world_size

    trainer_class = _layout_trainer_class()
    with tempfile.TemporaryDirectory() as dump:
        args = [
            "--job.config_file", config_file, "--model.hf_assets_path", "",
            "--training.dataset", "wlb_builtin", "--training.dataset_path", "",
            "--comm.mode", "fake_backend", "--training.steps", "1",
            "--checkpoint.no-enable", "--job.dump_folder", dump, "--metrics.no-enable-tensorboard",
            *overrides,
        ]  # fmt: skip
        probe = ConfigManager().parse_args(args)
        world = ngpu or layout_world_size(probe.parallelism)
        os.environ.update(NGPU=str(world), LOCAL_RANK="0", RANK="0", WORLD_SIZE=str(world))
        start = time.perf_counter()
        trainer = trainer_class(ConfigManager().parse_args(args))
        elapsed = time.perf_counter() - start
        trainer.close()
        del trainer
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    got = layout_degrees(probe, world)  # the build passed the same check
    keys = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
    shown = " x ".join(f"{k} {got[k]}" for k in keys if got[k] > 1) or "no parallelism"
    return (
        f"{world} rank{'' if world == 1 else 's'} ({shown}), {probe.model.name} "
        f"{probe.model.flavor}, context {probe.training.seq_len:,}"
    ), elapsed


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.dry_run", __doc__)
    p.add_argument("configs", nargs="+", help="TOML config files")
    p.add_argument("--ngpu", type=int, default=None, help="world size (default: from degrees)")
    p.add_argument("--verbose", action="store_true", help="show TorchTitan's log and warnings")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # TorchTitan's flags follow "--"
    argv, overrides = argv[:cut], argv[cut + 1 :]
    p = parser()
    args = p.parse_args(argv)
    if args.ngpu is not None and args.ngpu < 1:
        p.error(f"--ngpu {args.ngpu} must be >= 1")
    from torchtitan.tools.logging import init_logger

    init_logger()
    log_filter.install()
    if not args.verbose:
        logging.getLogger().setLevel(logging.ERROR)
        warnings.simplefilter("ignore")
    failed = 0
    bar = progress(args.configs, desc="dry run", unit="config")
    for config in bar:
        bar.set_postfix_str(os.path.basename(config))
        line = f"FAIL {config}: no such file"
        if os.path.isfile(config):
            try:
                description, seconds = dry_run(config, args.ngpu, overrides)
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
                line = f"OK   {config}: {description}, built in {seconds:.1f}s, peak memory "
                line += f"{peak:.2f} GiB"
            except Exception as e:  # report every config, then exit non-zero
                line = f"FAIL {config}: {type(e).__name__}: {e}"
        failed += line.startswith("FAIL")
        bar.write(line, file=sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
