"""Entry point, one process per rank: ``python -m torchtitan_wlb.train --job.config_file FILE``.
Bad input ends with one line and exit status 2, not a traceback."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn
from unittest import mock

from torchtitan_wlb import cpu_support, log_filter, parent_watch

cpu_support.activate()

# torchtitan binds its device type at import time: these imports must follow activate().
from torchtitan.tools.logging import init_logger, logger  # noqa: E402

from torchtitan_wlb.data.sources import DataError  # noqa: E402
from torchtitan_wlb.resume import CheckpointError  # noqa: E402
from torchtitan_wlb.validate import ConfigError, TOMLDecodeError  # noqa: E402

# Bad user input once training has started (while parsing, any ValueError is: unknown fields).
USER_ERRORS = (ConfigError, DataError, CheckpointError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    parent_watch.watch_parent()  # a rank whose launcher died stops at once (no orphan training)
    init_logger()
    log_filter.install()
    from torchtitan.train import main as torchtitan_main

    from torchtitan_wlb.run_messages import nothing_to_do
    from torchtitan_wlb.trainer import WLBTrainer
    from torchtitan_wlb.validate import check_job_config, parse_job_config

    args = sys.argv[1:] if argv is None else argv
    try:
        # Parse and check once, before TorchTitan creates process groups or builds the model.
        job_config = parse_job_config(args)
        check_job_config(job_config)
    except (*USER_ERRORS, ValueError, TOMLDecodeError) as e:
        logger.error(f"configuration error: {e}")
        return 2
    if done := nothing_to_do(job_config):  # the checkpoint already holds training.steps
        logger.info(done)
        return 0
    try:
        with mock.patch.object(sys, "argv", [sys.argv[0], *args]):  # what TorchTitan's main parses
            torchtitan_main(WLBTrainer)
    except USER_ERRORS as e:
        logger.error(f"error: {e}")
        return 2
    return 0


def exit_now(code: int) -> NoReturn:
    """End the rank process without interpreter finalization, once ``main`` has returned.

    A gloo worker thread can still be releasing the last collective's work when the interpreter
    finalizes: the work's tensors take the GIL to drop their Python objects, finalization makes
    that thread exit through C++ frames that may not unwind, and the process aborts (SIGABRT, exit
    -6) after a run that finished (torch 2.13: ProcessGroupGloo::runLoop -> ~AsyncWork -> decref ->
    PyThread_exit_thread -> std::terminate; ~1 launch in 15 on the CPU tests and benchmarks).
    Nothing is left to finalize: ``trainer.close()`` has closed the checkpointer and the metric
    writers, and the JSONL and audit logs are written and closed per record; logging and the
    standard streams are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to write
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
