"""Test hook of the online cost model test: ``torchtitan_wlb.train`` fed synthetic times.

Measured times differ from run to run, so a resumed run would refit other coefficients than the
uninterrupted one after the resume. ``WLB_TEST_SYNTHETIC_TIMES`` makes every rank of a run launched
by ``tests/fork_launch.py`` replace each micro-batch's measured forward+backward time, just before
the step's statistics are gathered, with a known ``t = a * sum(d^2) + b * sum(d) + c`` (attention
far dearer than the analytic FLOP model says), times a deterministic factor that differs per rank
and micro-batch (the ranks are fed different timings). The package needs no test hooks: this wraps
the trainer's and the fit's methods.

- ``plain``: as above.
- ``gather`` (a context-parallel run): a token whose K/V are all-gathered costs ``G``, a fifth of a
  local one: not physical, but it makes the fitted model choose other CP shardings than the
  throughput profile does.
- ``stage`` (a pipeline-parallel run): the per-stage action times the pipeline runner records are
  replaced instead: stage ``s`` of ``p`` takes the share ``STAGE_SHARES[s]`` of ``t`` (a third
  forward, two thirds backward), so the trainer's own sum over the pipeline group must put ``t``
  back together for the fit to recover ``a``.
"""

import dataclasses
import os

A, B, C = 1e-7, 1e-5, 1e-3
STAGE_SHARES = (0.3, 0.7)  # of a micro-batch's time, per pipeline stage (PP = 2)
KINDS = ("plain", "gather", "stage")


def _seconds(
    step: int, i: int, sq: float, lin: float, gathered: float = 0.0, g: float = B
) -> float:
    """The synthetic truth for micro-batch ``i`` of ``step`` on this rank, within 1 % noise; an
    all-gathered token costs ``g``."""
    rank = int(os.environ.get("RANK", "0"))
    noise = 1.0 + 0.01 * (((step * 7 + rank * 3 + i * 5) % 11) - 5) / 5
    return (A * sq + B * lin + g * gathered + C) * noise


def install(kind: str) -> None:
    """Install the synthetic times of ``kind`` (one of :data:`KINDS`) in this rank."""
    if kind not in KINDS:
        raise ValueError(f"WLB_TEST_SYNTHETIC_TIMES = {kind!r}: use one of {KINDS}")
    if kind == "stage":
        _install_stage_times()
    else:
        _install_fit_times(B / 5 if kind == "gather" else B)


def _install_fit_times(g: float) -> None:
    from torchtitan_wlb.online_fit import OnlineFit

    original = OnlineFit.end_step

    def end_step(self, step):
        rows = self.rows
        for i, (sq, lin, gathered, _) in enumerate(rows):
            rows[i] = (sq, lin, gathered, _seconds(step, i, sq, lin, gathered, g))
        return original(self, step)

    OnlineFit.end_step = end_step


def _install_stage_times() -> None:
    from torchtitan_wlb.trainer import WLBTrainer

    original = WLBTrainer._pipeline_step

    def _pipeline_step(self, *args, **kwargs):
        # This step's document lengths: the trainer fills this list, then runs the pipeline.
        step_doc_lens, runner = self._pp_doc_lens, self._pp_runner
        run = runner.step

        def step(*a, **k):
            run(*a, **k)
            times, p = runner.last_action_times, self.parallel_dims.pp
            total = [
                _seconds(self.step, i, float(sum(d * d for d in lens)), float(sum(lens)))
                for i, lens in enumerate(step_doc_lens)
            ]
            fwd = [[STAGE_SHARES[s] * t / 3 for t in total] for s in times.stage_indices]
            bwd = [[STAGE_SHARES[s] * t * 2 / 3 for t in total] for s in times.stage_indices]
            assert len(STAGE_SHARES) == p and len(total) == len(times.fwd_device_s[0])
            runner.last_action_times = dataclasses.replace(
                times, fwd_s=fwd, bwd_s=bwd, fwd_device_s=fwd, bwd_device_s=bwd
            )

        runner.step = step
        try:
            return original(self, *args, **kwargs)
        finally:
            del runner.step

    WLBTrainer._pipeline_step = _pipeline_step
