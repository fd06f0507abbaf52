"""The clock that times a rank's compute for the metrics and the online cost model: the device's
own time, not the wall's, which on a shared CPU counts other processes (docs/cost_model.md)."""

from __future__ import annotations

import time

import torch

CUDA, THREAD_CPU, WALL = "cuda", "thread_cpu", "wall"


def clock_kind(device_type: str) -> str:
    """The device clock for a rank computing on ``device_type``: ``"cuda"``, ``"thread_cpu"`` (on
    CPU with one intra-op thread) or ``"wall"`` (docs/cost_model.md)."""
    if device_type == "cuda":
        return CUDA
    if device_type == "cpu" and torch.get_num_threads() == 1:
        return THREAD_CPU
    return WALL


class DeviceClock:
    """Reads the wall clock and the device clock together; stateless between :meth:`read` and
    :meth:`since`, so timed regions may nest. The kind is fixed when the clock is built."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.kind = clock_kind(self.device.type)

    def read(self) -> tuple[float, float]:
        """A start mark: (wall, thread CPU time; 0 unless the clock is ``thread_cpu``)."""
        return time.perf_counter(), time.thread_time() if self.kind == THREAD_CPU else 0.0

    def since(self, start: tuple[float, float]) -> tuple[float, float]:
        """(wall, device) seconds since ``start``; on CUDA after a synchronize, both the wall's."""
        if self.kind == CUDA:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - start[0]
        return wall, time.thread_time() - start[1] if self.kind == THREAD_CPU else wall
