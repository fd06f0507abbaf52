"""Choice of the outlier-queue thresholds and the max wait K from a sample of lengths, as the paper
does: by packing the sample with every candidate (deterministic; rule in docs/packing.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.packing.base import Packer, PackingConfig
from torchtitan_wlb.packing.driver import LengthStream, drive
from torchtitan_wlb.packing.registry import build_packer
from torchtitan_wlb.packing.wlb import default_thresholds

DEFAULT_WAITS = (2, 4, 6, 8, 12, 16, 24, 32)
_MIN_TUNE_STEPS = 100


@dataclass(frozen=True)
class TuneResult:
    """The chosen configuration and what it achieved on the sample."""

    queue_thresholds: tuple[int, ...]
    max_wait: int
    imbalance: float  # mean max/mean workload over the sample's steps
    mean_delay: float  # token-weighted mean delay in steps on the sample


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


def simulate(
    name: str, lengths: np.ndarray, config: PackingConfig, cost_model: CostModel, steps: int
) -> tuple[float, float]:
    """Mean imbalance and token-weighted delay of ``run_sample``."""
    run = run_sample(name, lengths, config, cost_model, steps)
    return run.imbalance, run.mean_delay


def tune_queues(
    sample_lengths: np.ndarray,
    config: PackingConfig,
    cost_model: CostModel,
    *,
    packer: str = "wlb",
    delay_budget: float = 0.5,
    waits: tuple[int, ...] = DEFAULT_WAITS,
    levels: tuple[int, ...] = (1, 2, 3),
    steps: int | None = None,
    tolerance: float = 0.005,
) -> TuneResult:
    """Queue thresholds and K for ``packer`` on ``sample_lengths`` (already split): the candidate
    rule and the ``steps`` default are in docs/packing.md ("Automatic choice")."""
    lengths = np.asarray(sample_lengths, np.int64)
    if lengths.size == 0 or np.any(lengths < 1):
        raise ValueError("tune_queues needs a non-empty sample of lengths >= 1")
    if not delay_budget >= 0:
        raise ValueError(f"delay_budget must be >= 0 steps, got {delay_budget}")
    # A short sample is simulated at a smaller N (the delay a K causes does not depend on N).
    n_tune = config.micro_batches
    if lengths.sum() < _MIN_TUNE_STEPS * n_tune * config.context_len:
        n_tune = max(1, int(lengths.sum() // (_MIN_TUNE_STEPS * config.context_len)))
    config = replace(config, micro_batches=n_tune)
    if steps is None:
        batches = int(lengths.sum() // (n_tune * config.context_len))
        steps = max(1, batches - min(2 * max(waits), batches // 2))
    candidates = {default_thresholds(cost_model, config.context_len, k) for k in levels}
    if config.queue_thresholds is not None:
        candidates.add(tuple(config.queue_thresholds))
    results: list[TuneResult] = []
    for th in sorted(candidates):
        for k in waits:
            cfg = replace(config, queue_thresholds=th, max_wait=k)
            imb, delay = simulate(packer, lengths, cfg, cost_model, steps)
            results.append(TuneResult(th, k, imbalance=imb, mean_delay=delay))
    within = [r for r in results if r.mean_delay <= delay_budget]
    if not within:
        return min(results, key=lambda r: (r.mean_delay, r.imbalance))
    # Imbalance differences below the tolerance are sampling noise: the least delay wins.
    best = min(r.imbalance for r in within)
    near = [r for r in within if r.imbalance <= best + tolerance]
    return min(near, key=lambda r: (r.mean_delay, r.imbalance))
