"""Launcher of the multi-process training tests: torchrun's agent, ranks forked, not started anew.

    python tests/fork_launch.py --nproc_per_node=2 ARGS...   # ARGS as for torchtitan_wlb.train

The same elastic agent as ``torchrun --nproc_per_node=N --rdzv_backend c10d --rdzv_endpoint
localhost:0 --role rank -m torchtitan_wlb.train ARGS`` (rendezvous, the ranks' environment, the
failure of one rank ending the others and the launch with a non-zero status), but the agent
imports ``torchtitan_wlb.train`` and TorchTitan's trainer once, then forks its ranks from itself,
where torchrun starts a fresh interpreter per rank that imports them again. That import is most of
a small run's cost (several CPU seconds per rank, against a fraction of a second per training step
of the tiny model); the tests launch dozens of ranks.

Nothing is shared between the ranks but the imported modules: each rank initialises its own
process group, model and data after the fork, exactly as a torchrun rank does. The ranks' parent is
the agent, as under torchrun, so :mod:`torchtitan_wlb.parent_watch` watches the same process. Two
other differences: the ranks stay in the agent's session (torchrun gives each its own), and their
output is line-buffered (torchrun's ``python -u``: unbuffered). The tests that need torchrun itself
(its sessions: tests/test_orphan_ranks.py) and one full run through it (tests/test_drain.py)
still launch it.

``WLB_TEST_KILL`` works as with ``tests/kill_points.py`` (the same hook, installed in each rank);
``WLB_TEST_GRADS`` writes step 1's gradients (``tests/grad_dump.py``); ``WLB_TEST_SYNTHETIC_TIMES``
feeds the online cost model known times (``tests/synthetic_times.py``).

Under pytest even the agent's import is paid once: the suite starts ``tests/launch_server.py``,
which imports everything once and forks each launch's agent from itself; this script then only
hands its arguments, environment and standard streams over to it (and falls back to launching
here when no server is running, or when it was started from another checkout or environment).
"""

import os
import sys
import uuid

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))
sys.path.insert(0, TESTS)

PREFIX = "--nproc_per_node="


def preload() -> None:
    """What the agent and its ranks run: imported once, before the ranks are forked (and, with
    the launch server, before the agents are), so that every rank inherits them."""
    from torchtitan_wlb import cpu_support

    cpu_support.activate()  # before TorchTitan is imported (it binds its device type then)
    import grad_dump  # noqa: F401
    import kill_points  # noqa: F401
    import synthetic_times  # noqa: F401
    import torchtitan.train  # noqa: F401

    from torchtitan_wlb import train, trainer, validate  # noqa: F401


def _skip_final_sleep() -> None:
    """TorchTitan's rank 0 sleeps 2 seconds at the end of training, "for other ranks to
    complete"; every rank has passed the last step's collectives by then, and the launch waits
    for all of them anyway. Dozens of launches would spend minutes idle: the ranks' TorchTitan
    sees a ``time`` module whose ``sleep`` returns at once (its timers are the real ones)."""
    import time
    import types

    import torchtitan.train

    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if k[0] != "_"})
    clock.sleep = lambda seconds: None
    torchtitan.train.time = clock


def _rank(args: list[str]) -> None:
    """One rank: the kill hook if asked for, then the real entry point."""
    from torchtitan.config import ConfigManager

    from torchtitan_wlb import train

    sys.argv = [train.__file__, *args]
    # TorchTitan's ConfigManager.parse_args took sys.argv[1:] as its default when it was
    # imported (before this launch's arguments were known): this rank's arguments instead.
    ConfigManager.parse_args.__defaults__ = (list(args),)
    for stream in (sys.stdout, sys.stderr):  # as torchrun's ``python -u``: no line lost to a kill
        stream.reconfigure(line_buffering=True)
    if os.environ.get("WLB_TEST_KILL"):
        import kill_points

        kill_points.install(os.environ["WLB_TEST_KILL"])
    if os.environ.get("WLB_TEST_GRADS"):
        import grad_dump

        grad_dump.install(os.environ["WLB_TEST_GRADS"])
    if os.environ.get("WLB_TEST_SYNTHETIC_TIMES"):
        import synthetic_times

        synthetic_times.install(os.environ["WLB_TEST_SYNTHETIC_TIMES"])
    _skip_final_sleep()
    code = train.main(args)
    sys.stdout.flush()
    if code:
        sys.exit(code)


def launch(argv: list[str]) -> int:
    """``argv`` = ``[--nproc_per_node=N, ARGS...]``: the elastic agent, its ranks forked."""
    if not argv or not argv[0].startswith(PREFIX):
        sys.exit(f"usage: {sys.argv[0]} {PREFIX}N ARGS...")
    nproc, args = int(argv[0][len(PREFIX) :]), argv[1:]
    preload()
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        role="rank",
        rdzv_endpoint="localhost:0",
        rdzv_backend="c10d",
        max_restarts=0,
        start_method="fork",
    )
    elastic_launch(config, _rank)(args)
    return 0


if __name__ == "__main__":
    from launch_server import request

    code = request(sys.argv[1:])
    sys.exit(launch(sys.argv[1:]) if code is None else code)
