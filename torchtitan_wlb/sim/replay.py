"""Step times predicted from micro-batch fits and played through the pipeline schedule, against the
measured ones: fitted on the first half of the steps, every error reported on the second half."""

from __future__ import annotations

import numpy as np

from torchtitan_wlb.sim.fit import Calibration, fit_pipeline
from torchtitan_wlb.sim.records import Records, pipeline_steps
from torchtitan_wlb.sim.timeline import build_schedule, simulate_pipeline


def play_pipeline(fwd: np.ndarray, bwd: np.ndarray, pp: int) -> float:
    """Makespan of one step's (interleaved) 1F1B; ``fwd``, ``bwd`` are [virtual stages, m]."""
    n_v, m = fwd.shape
    sched = build_schedule(pp, m, max(1, n_v // pp))
    return float(simulate_pipeline(sched, fwd[None], bwd[None]).makespan[0])


def _need_two(steps: list[int], what: str) -> None:
    if len(steps) < 2:
        raise ValueError(f"step-time check needs >= 2 {what}, got {len(steps)}")


def _errors(pred: np.ndarray, meas: np.ndarray) -> dict:
    rel = np.abs(pred - meas) / meas
    return {"mean_abs_rel_error": float(rel.mean()), "max_abs_rel_error": float(rel.max())}


def _holdout(pred: np.ndarray, meas: np.ndarray) -> dict:
    """The per-step overhead fitted on the first half (median residual), errors on the second."""
    half = len(meas) // 2
    overhead = float(np.median(meas[:half] - pred[:half]))
    return {"step_overhead_s": overhead, **_errors(pred[half:] + overhead, meas[half:])}


def _report(play, records: Records, measured: dict[int, float], what: str) -> dict:
    """Errors of ``play(records, measured)`` -> (steps, predicted, measured seconds), as
    ``_holdout``, and without the step overhead."""
    steps, pred, meas = play(records, measured)
    _need_two(steps, what)
    return {
        "steps_compared": len(steps) - len(steps) // 2,
        **_holdout(pred, meas),
        "mean_abs_rel_error_no_overhead": _errors(pred, meas)["mean_abs_rel_error"],
    }


def _cross(play, records: Records, measured: dict[int, float], others: list[tuple]) -> dict:
    """Other runs' steps predicted by ``play`` plus the step overhead of all this run's steps."""
    _, pred, meas = play(records, measured)
    overhead, cross = float(np.median(meas - pred)), []
    for other in others:
        steps, pred, meas = play(*other)
        if not steps:
            raise ValueError(
                "a --predict-records file has no complete steps with micro-batch records"
            )
        cross.append({"steps_compared": len(steps), **_errors(pred + overhead, meas)})
    return {"cross": cross}


def step_prediction(
    calib: Calibration,
    records: Records,
    measured: dict[int, float],
    pp: int = 1,
    others: list[tuple] = (),
) -> dict:
    """The steps' times predicted from their micro-batches against the measured ones. A rank's step
    is its micro-batches' fitted times summed (PP = 1), or with PP > 1 each split evenly over the
    stages (forward 1/3, backward 2/3) and played through 1F1B; a step takes its slowest rank's."""

    def play(recs: Records, meas: dict[int, float]):
        by_rank_step: dict[tuple[int, int], list[np.ndarray]] = {}
        for r in recs:
            if r.step >= 0 and r.step in meas:
                by_rank_step.setdefault((r.rank, r.step), []).append(r.doc_lens)
        pred = dict.fromkeys(sorted({s for _, s in by_rank_step}), 0.0)
        for (_, step), mbs in by_rank_step.items():
            t = calib.predict(mbs)
            per_stage = np.broadcast_to(t[None, :] / pp, (pp, len(mbs)))
            t = float(t.sum()) if pp == 1 else play_pipeline(per_stage / 3, per_stage * 2 / 3, pp)
            pred[step] = max(pred[step], t)
        return list(pred), np.array(list(pred.values())), np.array([meas[s] for s in pred])

    out = _report(
        play, records, measured, "steps with both micro-batch records and a measured time"
    )
    return out | (_cross(play, records, measured, others) if others else {})


def pipeline_step_prediction(
    records: Records,
    measured: dict[int, float],
    pp: int,
    *,
    predict: list[tuple] | None = None,
    overhead: bool = True,
) -> dict:
    """Fit per-stage action costs on the first half of the steps, predict the second half.

    Each step is also played with the *measured* action times (``replay_*``: how much of the error
    is the timeline and the per-step constant rather than the cost fit). ``predict``: other runs
    whose steps the fit on all of this run's steps predicts (``cross``).
    """
    steps = pipeline_steps(records)
    common = sorted(set(steps) & set(measured))
    what = "complete pipeline steps with a measured time"
    _need_two(common, what)
    half = len(common) // 2
    first, second = set(common[:half]), set(common[half:])

    def player(fits: dict[str, dict[int, Calibration]]):
        def play(recs: Records, meas: dict[int, float]):
            stp = pipeline_steps(recs)
            which = sorted(set(stp) & set(meas))
            pred = [
                play_pipeline(
                    *(
                        np.stack([c.predict(stp[s][0]) for c in part.values()])
                        for part in fits.values()
                    ),
                    pp,
                )
                for s in which
            ]
            return which, np.array(pred), np.array([meas[s] for s in which])

        return play

    fits = fit_pipeline([r for r in records if r.step in first], overhead=overhead)
    report, cross = _report(player(fits), records, measured, what), {}
    if predict:
        full = fit_pipeline([r for r in records if r.step in set(common)], overhead=overhead)
        cross = _cross(player(full), records, measured, predict)
    n_v = len(fits["fwd_s"])
    replay = np.array([play_pipeline(*steps[s][1], pp) for s in common])
    test = {k: [r for r in records if r.step in second and r.stage == k] for k in fits["fwd_s"]}
    act_pred = np.concatenate(
        [
            part[k].predict([r.doc_lens for r in rs])
            for part in fits.values()
            for k, rs in test.items()
        ]
    )
    act_meas = np.array([getattr(r, a) for a in fits for rs in test.values() for r in rs])
    return {
        "fit": "per-stage forward/backward costs and the step overhead on the first half of "
        "the steps; errors on the second half",
        "schedule": "1f1b" if n_v <= pp else f"interleaved_1f1b (v={n_v // pp})",
        "steps_fitted": half,
        **report,
        "heldout_action_mean_abs_rel_error": float(np.mean(np.abs(act_pred - act_meas) / act_meas)),
        "replay_measured_actions": _holdout(replay, np.array([measured[s] for s in common])),
        "stages": {f"stage{k}_{a[:3]}": fits[a][k].summary() for k in fits["fwd_s"] for a in fits},
        **cross,
    }
