"""Rank entry point of the online cost model test: ``torchtitan_wlb.train`` fed synthetic times.

Measured times differ from run to run, so a resumed run would refit other coefficients than the
uninterrupted one after the resume. This entry replaces every micro-batch's measured
forward+backward time, just before the step's statistics are gathered, with a known
``t = a * sum(d^2) + b * sum(d) + c`` (attention far dearer than the analytic FLOP model says),
times a deterministic factor that differs per rank and micro-batch (the ranks are fed different
timings). Run by torchrun as a script, so the package needs no test hooks.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_wlb import train  # noqa: E402  (activates CPU support first)
from torchtitan_wlb.trainer import WLBTrainer  # noqa: E402

A, B, C = 1e-7, 1e-5, 1e-3


def install() -> None:
    original = WLBTrainer._maybe_refit
    rank = int(os.environ.get("RANK", "0"))

    def _maybe_refit(self):
        rows = self._fit_rows
        for i, (sq, lin, gathered, _) in enumerate(rows):
            noise = 1.0 + 0.01 * (((self.step * 7 + rank * 3 + i * 5) % 11) - 5) / 5
            rows[i] = (sq, lin, gathered, (A * sq + B * (lin + gathered) + C) * noise)
        return original(self)

    WLBTrainer._maybe_refit = _maybe_refit


if __name__ == "__main__":
    install()
    sys.exit(train.main())
