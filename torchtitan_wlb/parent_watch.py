"""A rank whose launcher has died stops at once: no orphan keeps training or writing checkpoints
(how and why by polling: docs/architecture.md). Imports nothing of the package."""

from __future__ import annotations

import os
import signal
import threading

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
