"""Choice of the outlier-queue thresholds, the max wait K and S_max from a sample of lengths, as the
paper does: by packing the sample with every candidate (deterministic; rule in docs/packing.md).
The one recommender: ``pack_bench --tune`` searches thresholds x K, ``wlb-analyze`` thresholds x
S_max, both with :func:`choose`'s rule."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing.base import Packer, PackingConfig
from torchtitan_wlb.packing.driver import LengthStream, drive
from torchtitan_wlb.packing.registry import build_packer
from torchtitan_wlb.packing.wlb import default_thresholds

DEFAULT_WAITS = (2, 4, 6, 8, 12, 16, 24, 32)
DELAY_BUDGET = 0.5  # token-weighted mean delay (steps) a choice may cost: the paper's 0.5
_MIN_TUNE_STEPS = 100


@dataclass(frozen=True)
class TuneResult:
    """One candidate configuration and what it achieved on the sample."""

    queue_thresholds: tuple[int, ...]
    max_wait: int
    imbalance: float  # mean max/mean workload over the sample's steps
    mean_delay: float  # token-weighted mean delay in steps on the sample
    smax: int = 0  # the micro-batch cap the packer ran with (S_max)
    steps: int = 0  # steps packed on the sample


@dataclass(frozen=True)
class SampleRun:
    """A packer's first steps over a sample: their mean imbalance and token-weighted delay, how
    many steps it packed, and the packer (its cap and thresholds are what it was run with)."""

    imbalance: float
    mean_delay: float
    steps: int
    packer: Packer


def run_sample(
    name: str, lengths: np.ndarray, config: PackingConfig, cost_model: CostModel, steps: int
) -> SampleRun:
    """Packer ``name`` over the first ``steps`` steps of ``lengths`` (fewer if the sample ends
    first); documents still pending are not counted, as in a long run."""
    packer = build_packer(name, config, cost_model)
    stream = LengthStream(lengths, end_of_data=False)  # a sample: its end is not the data's
    imb, delay_tok, tok = [], 0.0, 0
    for plan in drive(packer, stream, steps):
        imb.append(plan.stats["imbalance"])
        delay_tok += plan.stats["mean_delay"] * plan.stats["tokens"]
        tok += plan.stats["tokens"]
        if stream.remaining == 0:
            break
    mean_imb = float(np.mean(imb)) if imb else 1.0
    return SampleRun(mean_imb, delay_tok / tok if tok else 0.0, len(imb), packer)


def tune_trials(
    sample_lengths: np.ndarray,
    config: PackingConfig,
    cost_model: CostModel,
    *,
    packer: str = "wlb",
    waits: Sequence[int] = DEFAULT_WAITS,
    levels: Sequence[int] = (1, 2, 3),
    smaxes: Sequence[int] | None = None,
    steps: int | None = None,
) -> list[TuneResult]:
    """Every candidate of the search run over ``sample_lengths`` (already split): the queue
    thresholds of ``levels`` (and the configured ones) x ``smaxes`` (None: the configured cap) x
    ``waits``; ``steps`` None sizes the run (steps and N) to the sample (docs/packing.md), else
    ``steps`` steps at the configured N are scored."""
    lengths = np.asarray(sample_lengths, np.int64)
    if lengths.size == 0 or np.any(lengths < 1):
        raise ValueError("tuning needs a non-empty sample of lengths >= 1")
    if steps is None:  # sized to the sample: a short one at a smaller N (K's delay is not N's)
        n_tune = config.micro_batches
        if lengths.sum() < _MIN_TUNE_STEPS * n_tune * config.context_len:
            n_tune = max(1, int(lengths.sum() // (_MIN_TUNE_STEPS * config.context_len)))
        config = replace(config, micro_batches=n_tune)
        batches = int(lengths.sum() // (n_tune * config.context_len))
        steps = max(1, batches - min(2 * max(waits), batches // 2))
    candidates = {default_thresholds(cost_model, config.context_len, k) for k in levels}
    if config.queue_thresholds is not None:
        candidates.add(tuple(config.queue_thresholds))
    trials = []
    for th, smax, k in itertools.product(
        sorted(candidates), sorted(set(smaxes or [config.smax])), waits
    ):
        cfg = replace(config, queue_thresholds=th, max_delay_steps=k, smax=smax)
        run = run_sample(packer, lengths, cfg, cost_model, steps)
        trials.append(TuneResult(th, k, run.imbalance, run.mean_delay, run.packer.cap, run.steps))
    return trials


def _check_budget(delay_budget: float) -> None:
    if not delay_budget >= 0:
        raise ValueError(f"delay_budget must be >= 0 steps, got {delay_budget}")


def choose(
    trials: Sequence[TuneResult], delay_budget: float = DELAY_BUDGET, tolerance: float = 0.005
) -> TuneResult:
    """The recommendation among ``trials``, by the one rule of docs/packing.md ("Automatic
    choice"): the most balanced within the delay budget, where imbalances less than ``tolerance``
    apart are noise and the smaller S_max, then the least delay decide; none within the budget:
    the least delay. Remaining ties go to fewer queues, then the smaller K."""
    _check_budget(delay_budget)
    if not trials:
        raise ValueError("choose needs at least one trial")

    def order(r: TuneResult) -> tuple:
        return len(r.queue_thresholds), r.queue_thresholds, r.max_wait

    within = [r for r in trials if r.mean_delay <= delay_budget]
    if not within:
        return min(trials, key=lambda r: (r.mean_delay, r.imbalance, r.smax, *order(r)))
    best = min(r.imbalance for r in within)
    near = [r for r in within if r.imbalance <= best + tolerance]
    return min(near, key=lambda r: (r.smax, r.mean_delay, r.imbalance, *order(r)))


def tune_queues(
    sample_lengths: np.ndarray,
    config: PackingConfig,
    cost_model: CostModel,
    *,
    delay_budget: float = DELAY_BUDGET,
    tolerance: float = 0.005,
    **search: Any,
) -> TuneResult:
    """Queue thresholds, K (and S_max when ``smaxes`` are given) for ``packer`` on
    ``sample_lengths`` (already split): :func:`choose` of :func:`tune_trials`, which takes the
    ``search`` keywords (``packer``, ``waits``, ``levels``, ``smaxes``, ``steps``)."""
    _check_budget(delay_budget)  # before the search, not after it
    trials = tune_trials(sample_lengths, config, cost_model, **search)
    return choose(trials, delay_budget, tolerance)
