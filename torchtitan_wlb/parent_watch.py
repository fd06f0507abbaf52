"""A rank whose launcher has died stops at once: no orphan keeps training or writing checkpoints.

torchrun starts every rank in a session of its own, so killing the launch's process group (a
scheduler cancelling the job, ``kill -9 -PGID``, a closed terminal) kills only torchrun: the ranks
would go on training together and write checkpoints and logs nobody asked for. Each rank therefore
watches its parent: a daemon thread polls ``os.getppid()`` and, once the process has been
re-parented (the launcher is gone), ends it with SIGKILL -- no cleanup, no further write, exactly
as if the kill had reached it. A checkpoint being written at that moment stays incomplete (no
``.metadata``), so it is never resumed from.

Polling, not ``prctl(PR_SET_PDEATHSIG)``: the death signal follows the parent *thread* that forked
the rank, which need not live as long as the launcher; polling works on every POSIX system. It
imports nothing of the package (it runs first in every rank).
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["watch_parent"]

_started = False


def watch_parent(interval_s: float = 0.25) -> bool:
    """Start the watch (once per process); False where there is nothing to watch (no parent
    process to lose, or no POSIX re-parenting to observe)."""
    global _started
    if _started:
        return True
    parent = os.getppid()
    if os.name != "posix" or parent <= 1:
        return False

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(interval_s):
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="wlb-parent-watch", daemon=True).start()
    _started = True
    return True
