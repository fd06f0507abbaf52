"""The online cost model as the trainer runs it (docs/cost_model.md): a row per timed micro-batch,
the step's statistics summed over the ranks so every rank refits alike, the refit's outcome logged
and recorded, and the decisions handed to the packing node as the next step's compute starts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchtitan.tools.logging import logger

from torchtitan_wlb.cost_fit import FitStats, OnlineFitter
from torchtitan_wlb.resume import FAKE_COMM_MODES

if TYPE_CHECKING:
    from torchtitan_wlb.cp.plan import CPPlan
    from torchtitan_wlb.pipeline.varlen import PipelineActionTimes


@dataclass(frozen=True)
class FitReduction:
    """How a rank's online-fit statistics become the sum every rank holds (chosen once, at init)."""

    rows_here: bool
    """Whether this rank adds fit rows (under PP with TP: the first stage's ranks alone)."""
    exchange: bool
    """Whether the step's statistics are summed over ``group``: False where this rank already
    holds every row (one pipeline, after the stages exchanged their action times)."""
    group: Any = None
    """The process group of the sum; None: the world."""


def plan_fit_reduction(parallel_dims: Any) -> FitReduction:
    """Whether this rank adds fit rows, and the group the step's statistics are summed over,
    so that every rank holds the same sum.

    Without PP every rank timed its own micro-batches (or CP shards): the world. Under PP the
    stages exchange their action times first, after which every stage holds its pipeline's
    rows, bit for bit; the sum then runs over one stage's ranks, the pipelines (``loss``:
    batch x cp), and not at all with one pipeline: one collective a step, not two (each is
    a synchronisation of every rank; about 1.5 ms a step on the CPU runs). With TP the ranks
    of a stage time its micro-batches apart, so the world sums the first stage's rows."""
    pd = parallel_dims
    if not pd.pp_enabled:
        return FitReduction(rows_here=True, exchange=True)
    if pd.tp_enabled:
        return FitReduction(rows_here=pd.get_mesh("pp").get_local_rank() == 0, exchange=True)
    pipelines = pd.get_optional_mesh("loss")
    if pipelines is None:
        return FitReduction(rows_here=True, exchange=False)
    return FitReduction(rows_here=True, exchange=True, group=pipelines.get_group())


def whole_max_len(job_config: Any, parallel_dims: Any) -> int:
    """Under hybrid or adaptive CP, the length up to which the plan keeps a document whole
    (hybrid's threshold or its floor): the online model prices longer ones as gathered."""
    wlb, pd = job_config.wlb, parallel_dims
    if not pd.cp_enabled or wlb.cp_sharding not in ("hybrid", "adaptive"):
        return 0
    from torchtitan_wlb.cp.plan import default_hybrid_max_len

    return wlb.advanced.cp_hybrid_max_len or default_hybrid_max_len(pd.cp)


def sum_over_group(values: np.ndarray, group: Any, device: torch.device) -> np.ndarray:
    """``values`` summed over ``group`` in rank order: bitwise the same on every rank (an
    all-reduce need not be)."""
    mine = torch.from_numpy(np.ascontiguousarray(values, np.float64)).to(device)
    gathered = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).cpu().numpy().sum(axis=0)


def cp_fit_features(plan: CPPlan, rank: int) -> tuple[float, float, float]:
    """The online fit's terms for ``rank`` under ``plan``: ``Σd²`` times its share of the causal
    attention pairs, its local and its all-gathered tokens (docs/cost_model.md)."""
    pairs = plan.rank_attention_pairs()
    d = plan.doc_lens.astype(np.float64)
    share = float(pairs[rank] / pairs.sum()) if pairs.sum() > 0 else 1.0 / pairs.size
    gathered = int(plan.gather_lens[rank])
    return float(d @ d) * share, float(int(plan.local_lens[rank]) - gathered), float(gathered)


def _refit_line(step: int, record: dict[str, Any]) -> str:
    c, coef = record["candidate"], "none"
    if c:
        g, share = c["g"], c["gathered_share"]
        g = "" if g is None else f" g={g:.4g} (gathered share {share:.2f})"
        coef = f"a={c['a']:.4g} b={c['b']:.4g}{g} c={c['c']:.4g}"
    verdict = f"adopted for step {record['effective_step']} on" if record["adopted"] else "kept"
    return (
        f"online cost model refit after step {step}: {coef} (held-out RMS relative error "
        f"{record['candidate_error']:.4f} vs {record['incumbent_error']:.4f} for the model in "
        f"use); {verdict}" + ("" if record["adopted"] else f": {record['reason']}")
    )


def _refit_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """The refit's figures for the step's metrics (``effective_step`` is None, and so not
    recorded, unless the refit is adopted)."""
    c = record["candidate"]
    metrics = {
        f"cost_refit_{k}": record[k] for k in ("adopted", "incumbent_error", "effective_step")
    }
    metrics["cost_refit_error"] = record["candidate_error"]
    metrics.update({f"cost_refit_{k}": c[k] for k in "abc" if c})
    if c and c["g"] is not None:
        metrics.update(cost_refit_g=c["g"], cost_refit_gathered_share=c["gathered_share"])
    return metrics


class OnlineFit:
    """One rank's rows and the step's collective around the ``OnlineFitter``."""

    def __init__(
        self, fitter: OnlineFitter, reduction: FitReduction, device: torch.device, collective: bool
    ) -> None:
        self.fitter = fitter
        self.reduction = reduction
        self.device = device
        self.collective = collective
        """Whether sums run over real process groups (several processes, no fake collectives)."""
        self.rows: list[tuple[float, float, float, float]] = []
        """The step's rows so far: (Σd², local tokens, gathered tokens, seconds) per micro-batch."""
        self.features: tuple[float, float, float] | None = None
        """The current micro-batch's (Σd², local, gathered) until its time is known."""

    @classmethod
    def build(cls, job_config: Any, parallel_dims: Any, dataloader: Any, device: torch.device):
        """The job's online fit; None unless its dataloader packs with an online cost model."""
        schedule = getattr(dataloader, "cost_schedule", None)
        if schedule is None:
            return None
        fitter = OnlineFitter(schedule, whole_max_len=whole_max_len(job_config, parallel_dims))
        dist = torch.distributed
        several = dist.is_initialized() and dist.get_world_size() > 1
        collective = job_config.comm.mode not in FAKE_COMM_MODES and several
        return cls(fitter, plan_fit_reduction(parallel_dims), device, collective)

    def release(self) -> None:
        """Hand the decisions so far to the packing node (as a step's model compute starts)."""
        self.fitter.schedule.release()

    def skip_to(self, step: int) -> None:
        """Steps before ``step`` (the first of this launch) are decided: the packing node must not
        wait for them beyond the next :meth:`release`."""
        self.fitter.schedule.decide(step - 1, None, release=False)

    def cp_coefficients(self, step: int) -> tuple[float, float, float] | None:
        """The model packing ``step`` as CP's per-rank ``(a, b, g)``, once a fit has priced local
        and gathered tokens apart; the same on every rank (all-reduced fit, adopted at a step
        fixed in advance), so every CP rank builds the same plan."""
        model = self.fitter.schedule.model_for_step(step)
        if model.gathered_coef is None:
            return None
        return model.attn_coef, model.linear_coef, model.gathered_coef

    def whole_documents(self, doc_lens: torch.Tensor) -> None:
        """The micro-batch's features without CP: every document local."""
        d = doc_lens.to(torch.float64)
        self.features = (float((d * d).sum()), float(d.sum()), 0.0)

    def timed(self, device_seconds: float) -> None:
        """The current micro-batch took ``device_seconds``: its row."""
        if self.features is not None:
            self.rows.append((*self.features, device_seconds))
        self.features = None

    def pipeline_timed(
        self, step_doc_lens: list[list[int]], times: PipelineActionTimes, pp_mesh: Any
    ) -> None:
        """The step's rows under PP: each micro-batch's time through every stage (the stages'
        times summed over ``pp_mesh``)."""
        per_mb = np.sum(times.fwd_device_s, axis=0) + np.sum(times.bwd_device_s, axis=0)
        if self.collective:
            per_mb = sum_over_group(per_mb, pp_mesh.get_group(), self.device)
        if self.reduction.rows_here:  # each micro-batch once a pipeline in the sum
            for lens, seconds in zip(step_doc_lens, per_mb.tolist(), strict=True):
                d = np.asarray(lens, np.float64)
                self.rows.append((float(d @ d), float(d.sum()), 0.0, seconds))

    def end_step(self, step: int) -> dict[str, Any]:
        """After the step's last micro-batch: its statistics from every rank to the fitter; a
        refit's outcome logged, and returned as metrics (empty without a refit)."""
        rows, self.rows = self.rows, []
        rows = [r for r in rows if r[3] > 0]  # a measured time (the device clock may read 0)
        sq, lin, gathered, seconds = np.asarray(rows, np.float64).reshape(-1, 4).T
        vector = FitStats.from_samples(sq, lin, seconds, sum_gathered=gathered).to_vector()
        if self.collective and self.reduction.exchange:  # alike on every rank
            vector = sum_over_group(vector, self.reduction.group, self.device)
        # Released when the next step's forward starts (release()), not now.
        record = self.fitter.observe(step, vector, release=False)
        if record is None:
            return {}
        logger.info(_refit_line(step, record))
        return _refit_metrics(record)

    def state_dict(self) -> str:
        return json.dumps(self.fitter.state_dict())

    def load_state_dict(self, saved: str) -> None:
        self.fitter.load_state_dict(json.loads(saved))

    def close(self) -> None:
        self.fitter.schedule.close()  # a packing thread waiting for a decision: let it go
