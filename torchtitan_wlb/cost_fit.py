"""The online cost model: ``t = a * sum(d**2) + b * local + g * gathered + c`` fitted to measured
micro-batch times while training, from sufficient statistics that add up over micro-batches, steps
and ranks, so that every rank solves the same system bit for bit. ``local`` and ``gathered`` split
a rank's tokens by whether their K/V are all-gathered under CP (docs/cost_model.md)."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from torchtitan_wlb.cost_model import CostModel, nnls, read_profile

N_TERMS = 4  # sum(d^2), local tokens, gathered tokens, 1
_ATTN, _LOCAL, _GATHERED, _FIXED = range(N_TERMS)
STATS_SIZE = N_TERMS * N_TERMS + N_TERMS + 2
# Smallest accepted eigenvalue of the normalised normal matrix (unit diagonal): below it the terms
# are (nearly) collinear in this window and the fit would be noise.
_MIN_EIGEN = 1e-9
# The first refit needs no full window: it comes once the window's fitted steps hold this many
# micro-batch rows per coefficient the window can see (4 under CP with local and gathered tokens,
# else 3), at the latest once the window is full.
FIRST_FIT_ROWS_PER_TERM = 8


@dataclass(frozen=True)
class FitStats:
    """Sufficient statistics of ``t ~ x . (a, b, g, c)``, ``x = (Σd², local tokens, gathered
    tokens, 1)``, rows weighted by ``w = 1 / t**2`` (relative error): ``gram = Σ w x x^T``,
    ``moment = Σ w x t``, ``sq = Σ w t**2`` and ``count``."""

    gram: np.ndarray
    moment: np.ndarray
    sq: float
    count: float

    @classmethod
    def zeros(cls) -> FitStats:
        return cls(np.zeros((N_TERMS, N_TERMS)), np.zeros(N_TERMS), 0.0, 0.0)

    @classmethod
    def from_samples(
        cls, sum_sq: Any, sum_lin: Any, seconds: Any, sum_gathered: Any = None
    ) -> FitStats:
        """Micro-batches' statistics: ``Σd²``, local tokens, ``seconds`` (> 0), gathered tokens."""
        if sum_gathered is None:
            sum_gathered = np.zeros(np.size(seconds))
        sq_, lin, t, gath = (
            np.asarray(v, np.float64).reshape(-1) for v in (sum_sq, sum_lin, seconds, sum_gathered)
        )
        if not sq_.shape == lin.shape == t.shape == gath.shape:
            raise ValueError(
                f"FitStats.from_samples: sum_sq, sum_lin, seconds and sum_gathered must have the "
                f"same length, got {sq_.size}, {lin.size}, {t.size}, {gath.size}"
            )
        if t.size and (not np.all(np.isfinite(t)) or np.any(t <= 0)):
            raise ValueError(f"measured times must be finite and > 0, got {t.tolist()!r}")
        x = np.stack([sq_, lin, gath, np.ones_like(t)], axis=1)
        w = 1.0 / (t * t)
        return cls((x * w[:, None]).T @ x, x.T @ (w * t), float(np.sum(w * t * t)), float(t.size))

    def to_vector(self) -> np.ndarray:
        """The 22 numbers as one float64 vector (what ranks exchange and checkpoints hold)."""
        return np.concatenate([self.gram.reshape(-1), self.moment, [self.sq, self.count]])

    @classmethod
    def from_vector(cls, vector: Any) -> FitStats:
        v = np.asarray(vector, np.float64).reshape(-1)
        if v.size != STATS_SIZE:
            raise ValueError(
                f"a FitStats vector has {STATS_SIZE} numbers, got {v.size} (statistics saved by "
                "an older version with 3 terms cannot be resumed: start the fit afresh)"
            )
        k = N_TERMS * N_TERMS
        gram, moment = v[:k].reshape(N_TERMS, N_TERMS).copy(), v[k : k + N_TERMS].copy()
        return cls(gram, moment, float(v[-2]), float(v[-1]))

    def __add__(self, other: FitStats) -> FitStats:
        return FitStats.from_vector(self.to_vector() + other.to_vector())

    def gathered_share(self) -> float:
        """The share of the rows' tokens whose K/V were gathered (weighted like the rows, by
        ``1 / t**2``; micro-batch times vary little, so it is close to the plain share)."""
        local, gathered = self.gram[_FIXED, _LOCAL], self.gram[_FIXED, _GATHERED]
        return float(gathered / (local + gathered)) if local + gathered > 0 else 0.0

    def rms_error(self, coef: np.ndarray) -> float:
        """Root-mean-square relative prediction error of ``coef`` on these rows, from the
        statistics alone: Σ ((prediction - t) / t)² = sq - 2 coef . moment + coef . gram . coef."""
        coef = np.asarray(coef, np.float64)
        sse = max(0.0, float(self.sq - 2.0 * coef @ self.moment + coef @ self.gram @ coef))
        return math.sqrt(sse / self.count) if self.count else math.nan


def stage_sums(
    keys: Sequence[Hashable], stages: Sequence[int], times: Any
) -> tuple[list[Hashable], np.ndarray]:
    """Per-stage times of pipeline micro-batches summed into one row per micro-batch, the row this
    fit takes (its time through every stage). ``keys[i]`` names record i's micro-batch, ``times``
    is ``[record]`` or ``[record, column]``; returns the sorted keys and their summed rows. A
    micro-batch missing a stage that other records have is left out: its sum is not its time."""
    times = np.asarray(times, np.float64)
    times = times[:, None] if times.ndim == 1 else times
    ids: dict[Hashable, int] = {}
    group = np.array([ids.setdefault(key, len(ids)) for key in keys], np.int64)
    _, stage = np.unique(np.asarray(stages, np.int64), return_inverse=True)
    seen = np.zeros((len(ids), int(stage.max(initial=-1)) + 1), bool)
    seen[group, stage] = True
    sums = np.zeros((len(ids), times.shape[1]))
    np.add.at(sums, group, times)  # in record order, as a running sum would
    done = sorted(key for key, i in ids.items() if seen[i].all())
    return done, sums[[ids[key] for key in done]]


@dataclass(frozen=True)
class Coefficients:
    """``t = a * Σd² + b * local tokens + g * gathered tokens + c`` per micro-batch."""

    a: float
    """Per unit of ``Σd²`` (under CP: ``Σd²`` times the rank's share of the attention pairs)."""
    b: float
    """Per token whose K/V stay on the rank (every token without CP)."""
    c: float = 0.0
    """Fixed cost per micro-batch."""
    g: float | None = None
    """Per token whose K/V are all-gathered over CP; None: the same as ``b`` (no CP seen)."""
    gathered_share: float = 0.0
    """The fitted window's share of gathered tokens (a record of what the fit saw)."""
    unit: str = "seconds"

    @property
    def gathered(self) -> float:
        """The cost per gathered token in effect (``b`` when no gathered token was fitted)."""
        return self.b if self.g is None else self.g

    def as_array(self) -> np.ndarray:
        return np.array([self.a, self.b, self.gathered, self.c], np.float64)

    def predict(self, sum_sq: Any, sum_lin: Any, sum_gathered: Any = 0.0) -> np.ndarray:
        sq, lin, gath = (np.asarray(v, float) for v in (sum_sq, sum_lin, sum_gathered))
        return self.a * sq + self.b * lin + self.gathered * gath + self.c

    def cost_model(self, whole_max_len: int = 0) -> CostModel:
        """The per-document model the packers balance: under CP (``g`` fitted) a document longer
        than ``whole_max_len`` pays ``g`` per token, for the plan gathers it, a shorter one ``b``
        (0: every document gathered). ``c`` is left out: every micro-batch pays it once, so it
        moves no balance decision of a plan. A token kind the window never saw has no fitted
        cost (0): then every token pays the kind it did see. A fit that prices one kind it saw
        at 0 (timing noise on a model whose tokens cost little) does not tell the kinds apart:
        one cost, the two mixed by the window's gathered share, as if no CP were seen."""
        share = self.gathered_share
        if self.g is None or share <= 0.0:
            return CostModel(self.a, self.b, self.unit)
        if share >= 1.0 or whole_max_len <= 0:
            return CostModel(self.a, self.gathered, self.unit)
        if self.b <= 0.0 or self.g <= 0.0:
            return CostModel(self.a, (1.0 - share) * self.b + share * self.g, self.unit)
        return CostModel(self.a, self.b, self.unit, self.g, int(whole_max_len))

    @classmethod
    def of(cls, model: CostModel) -> Coefficients:
        return cls(model.attn_coef, model.linear_coef, 0.0, unit=model.unit)


def fit_nnls(
    stats: FitStats, constant: bool = True, online_checks: bool = True
) -> tuple[np.ndarray | None, str]:
    """The one fit of the cost model: non-negative least squares of ``(a, b, g, c)`` in relative
    error, ``(coef, "")`` or ``(None, reason)``. The online model refits with it, and so do the
    simulator's calibration and the imbalance report (their rows as :meth:`FitStats.from_samples`).

    A token kind absent from the rows leaves its coefficient 0; the terms are scaled to a
    unit-diagonal normal matrix first (``Σd²`` is ~10^7 times ``1``). ``constant=False`` fits no
    fixed cost (``c = 0``: the simulator's profile of per-document costs). ``online_checks``: the
    online model adopts nothing from too few micro-batches (a row more than coefficients) or with
    no per-token cost, nor from collinear terms (the fit would be timing noise); offline, a
    handful of exact rows, or terms that move together, are fitted as they are (collinear terms
    share their cost by the least-norm solution)."""
    diag = np.diag(stats.gram)
    active = diag > 0
    if not constant:
        active[_FIXED] = False
    needed = active[_ATTN] and (active[_LOCAL] or active[_GATHERED])
    if not (needed and (active[_FIXED] or not constant)):
        return None, "sum(d^2), the token count or the count is zero for every micro-batch"
    idx = np.flatnonzero(active)
    if online_checks and stats.count < idx.size + 1:
        return None, f"too few micro-batches to fit {idx.size} coefficients ({stats.count:.0f})"
    scale = 1.0 / np.sqrt(diag[idx])
    g = stats.gram[np.ix_(idx, idx)] * scale[:, None] * scale[None, :]
    h = stats.moment[idx] * scale
    # Least squares from the normal equations g, h: min |root c - target|², root^T root = g.
    eig = np.linalg.eigvalsh(g)
    if eig[0] >= _MIN_EIGEN * eig[-1]:
        lower = np.linalg.cholesky(g)
        root, target = lower.T, np.linalg.solve(lower, h)
    elif online_checks:
        return None, (
            "degenerate window: the micro-batches' sum(d^2), token counts and count are (nearly) "
            f"collinear (normalised eigenvalue {eig[0] / eig[-1]:.2e} < {_MIN_EIGEN:g}); e.g. all "
            "of one length, leaving only timing noise to fit"
        )
    else:  # collinear terms, fitted offline: the least-norm split between them
        eig, vec = np.linalg.eigh(g)
        keep = eig > eig[-1] * idx.size * np.finfo(np.float64).eps
        root = np.sqrt(eig[keep])[:, None] * vec[:, keep].T
        target = (vec[:, keep].T @ h) / np.sqrt(eig[keep])
    best = np.zeros(N_TERMS)
    best[idx] = nnls(root, target) * scale
    if online_checks and best[_ATTN] + best[_LOCAL] + best[_GATHERED] <= 0:
        return None, "no non-negative fit with a > 0, b > 0 or g > 0 (only the fixed cost c)"
    return best, ""


def profile_cost_model(path: str) -> CostModel:
    """``W(d) = a * d**2 + b * d`` in seconds (a, b >= 0), fitted to a measured cost profile
    (``[wlb] cost_profile``) by the one fit: relative error, so short documents count as much as
    long ones, and no fixed cost (a profile times documents, not micro-batches)."""
    d, t = read_profile(path)
    coef, _ = fit_nnls(FitStats.from_samples(d * d, d, t), constant=False, online_checks=False)
    if coef is None or coef[_ATTN] == coef[_LOCAL] == 0:
        raise ValueError("cost profile fit gave zero cost for every length; check the table")
    return CostModel(attn_coef=float(coef[_ATTN]), linear_coef=float(coef[_LOCAL]), unit="seconds")


@dataclass(frozen=True)
class RefitResult:
    """What one refit decided, with the errors it was judged by (RMS relative, held-out steps)."""

    adopted: bool
    reason: str
    candidate: Coefficients | None
    candidate_error: float
    incumbent_error: float


def refit(fit_part: FitStats, holdout: FitStats, incumbent: Coefficients) -> RefitResult:
    """Fit on ``fit_part``; adopt only if it predicts ``holdout`` better than ``incumbent``, judged
    at its best scale on ``fit_part`` (so that a model in FLOPs competes on its shape)."""
    coef, why = fit_nnls(fit_part)
    shape = incumbent.as_array()
    denom = float(shape @ fit_part.gram @ shape)  # the scale s >= 0 minimising its error
    inc = shape * (max(0.0, float(shape @ fit_part.moment) / denom) if denom > 0 else 0.0)
    inc_err = holdout.rms_error(inc)
    if coef is None:
        return RefitResult(False, why, None, math.nan, inc_err)
    a, b, g, c = (float(coef[k]) for k in (_ATTN, _LOCAL, _GATHERED, _FIXED))
    g = g if fit_part.gram[_GATHERED, _GATHERED] > 0 else None  # no gathered token: as b
    cand = Coefficients(a, b, c, g=g, gathered_share=fit_part.gathered_share())
    cand_err = holdout.rms_error(coef)
    why = f"refit predicts the held-out steps no better ({cand_err:.4f} vs {inc_err:.4f} RMS "
    why = "adopted" if cand_err < inc_err else why + "relative error)"
    return RefitResult(cand_err < inc_err, why, cand, cand_err, inc_err)


@dataclass(frozen=True)
class OnlineFitConfig:
    """When the online model refits and when a refit takes effect (all in optimizer steps); each
    field ``<name>`` is documented as ``[wlb] fit_<name>`` (docs/configuration.md)."""

    warmup_steps: int = 2
    window_steps: int = 8
    holdout_steps: int = 2
    interval_steps: int = 4
    apply_lag_steps: int = 2
    """A refit decided after step s packs step s + lag onwards (>= 1). With 2 the node packs step
    s + 2 while step s + 1 trains, off the critical path; 1 would make step s + 1 wait for it."""

    def __post_init__(self) -> None:
        lowest = {"warmup_steps": 0, "window_steps": 0, "holdout_steps": 0, "interval_steps": 1}
        for name, low in {**lowest, "apply_lag_steps": 1}.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"OnlineFitConfig.{name} = {value!r} must be an integer >= {low}")
        if not 1 <= self.holdout_steps < self.window_steps:
            raise ValueError(
                f"OnlineFitConfig: holdout_steps must be in [1, window_steps), got "
                f"{self.holdout_steps} with window_steps = {self.window_steps}"
            )

    def is_refit_step(
        self, step: int, anchor: int | None, fit_rows: float, terms: int = N_TERMS
    ) -> bool:
        """Whether a refit is decided after ``step``, given ``anchor``, the step later refits are
        counted from (the first adopted refit; None: none adopted yet), the rows the window's
        fitted steps hold and the coefficients they can see. The first refit comes once they hold
        :data:`FIRST_FIT_ROWS_PER_TERM` rows per coefficient (at the latest once the window is
        full); until one is adopted, every step tries again (the initial model is a guess, and a
        rejected fit from a few steps usually missed a kind of micro-batch the next step adds);
        then every ``interval_steps``, counted from the full window if none was adopted by then.
        Rows and terms come from the all-reduced statistics, so every rank decides alike."""
        full = self.warmup_steps + self.window_steps
        if anchor is None and step > full:
            anchor = full
        if anchor is not None:
            return step > anchor and (step - anchor) % self.interval_steps == 0
        if step < self.warmup_steps + self.holdout_steps + 1:  # a step to fit, and the held-out
            return False
        return fit_rows >= FIRST_FIT_ROWS_PER_TERM * terms or step >= full


class CostModelSchedule:
    """Which cost model packs which step; written by the trainer, read by the packing node, which
    waits for the decisions, so its answer never depends on how far ahead it prefetches.

    A decision reaches the node when it is released (at once, unless ``decide`` is told
    otherwise): the trainer decides at the end of a step and releases at the start of the next
    step's forward, so that the node packs while the model computes rather than beside the
    optimizer step (docs/cost_model.md, "When the node packs")."""

    def __init__(self, initial: CostModel, config: OnlineFitConfig) -> None:
        self.initial, self.config = initial, config
        self._adoptions: list[tuple[int, CostModel]] = []
        self._decided_through = 0
        self._released_through = 0
        self._closed = False
        self._cond = threading.Condition()

    def model_for_step(self, step: int) -> CostModel:
        """The model packing training step ``step`` (1-based), waiting until step ``step - lag``
        is decided and released (whether a step refits can depend on its data:
        :meth:`OnlineFitConfig.is_refit_step`)."""
        needed = step - self.config.apply_lag_steps
        with self._cond:
            self._cond.wait_for(lambda: self._released_through >= needed or self._closed)
            return next((m for e, m in reversed(self._adoptions) if e <= step), self.initial)

    def decide(self, step: int, model: CostModel | None, release: bool = True) -> int:
        """Decide every step through ``step``; ``model``, if given, packs from the returned step.
        ``release=False``: the node sees it at the next :meth:`release` (or later ``decide``),
        except with ``apply_lag_steps = 1``: step ``step + 1`` is packed from this decision, and
        its first micro-batch is fetched before its forward could release it (held back, the
        node and the trainer would wait for each other)."""
        effective = step + self.config.apply_lag_steps
        with self._cond:
            if model is not None:
                self._adoptions.append((effective, model))
            self._decided_through = max(self._decided_through, step)
        if release or self.config.apply_lag_steps == 1:
            self.release()
        return effective

    def release(self) -> None:
        """Let the node pack every step the decisions so far settle."""
        with self._cond:
            if self._released_through < self._decided_through:
                self._released_through = self._decided_through
                self._cond.notify_all()

    def restore(self, adoptions: list[tuple[int, CostModel]], decided_through: int) -> None:
        with self._cond:
            self._adoptions = sorted(adoptions, key=lambda p: p[0])
            self._decided_through = self._released_through = decided_through
            self._cond.notify_all()

    def close(self) -> None:
        """Release a waiting node for good (the run is over; nothing more will be decided)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class OnlineFitter:
    """The trainer's side: a window of rank-summed step statistics, the refits and their history."""

    def __init__(self, schedule: CostModelSchedule, whole_max_len: int = 0) -> None:
        self.schedule = schedule
        self.whole_max_len = whole_max_len  # under CP: what Coefficients.cost_model needs
        self.config = schedule.config
        self._window: deque[tuple[int, np.ndarray]] = deque(maxlen=self.config.window_steps)
        self.incumbent = Coefficients.of(schedule.initial)
        self.history: list[dict[str, Any]] = []
        self.first_adopted: int | None = None  # the step of the first adopted refit

    def observe(self, step: int, vector: np.ndarray, release: bool = True) -> dict[str, Any] | None:
        """Add step ``step``'s rank-summed statistics; at a refit step, refit and return its record.
        ``release``: as :meth:`CostModelSchedule.decide`'s."""
        if step > self.config.warmup_steps:
            self._window.append((step, np.asarray(vector, np.float64).copy()))
        window = [FitStats.from_vector(v) for _, v in self._window]
        k = max(0, len(window) - self.config.holdout_steps)
        fit_part, holdout = sum(window[:k], FitStats.zeros()), sum(window[k:], FitStats.zeros())
        terms = int(np.count_nonzero(np.diag(fit_part.gram) > 0))  # those fit_nnls would fit
        if not self.config.is_refit_step(step, self.first_adopted, fit_part.count, terms):
            self.schedule.decide(step, None, release)
            return None
        result = refit(fit_part, holdout, self.incumbent)
        if result.adopted and self.first_adopted is None:
            self.first_adopted = step
        adopted = result.candidate.cost_model(self.whole_max_len) if result.adopted else None
        effective = self.schedule.decide(step, adopted, release)
        record = {"step": step, **asdict(result)}
        record["effective_step"] = effective if result.adopted else None
        if result.adopted:
            self.incumbent = result.candidate
            self.history.append(record)
        return record

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": [[s, v.tolist()] for s, v in self._window],
            "incumbent": asdict(self.incumbent),
            "history": list(self.history),
            "decided_through": self.schedule._decided_through,
            "first_adopted": self.first_adopted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._window = deque(
            ((int(s), np.asarray(v, np.float64)) for s, v in state["window"]),
            maxlen=self.config.window_steps,
        )
        self.incumbent = Coefficients(**state["incumbent"])
        self.history = list(state["history"])
        decided = int(state["decided_through"])
        self.first_adopted = state["first_adopted"]
        adoptions = [
            (
                int(r["effective_step"]),
                Coefficients(**r["candidate"]).cost_model(self.whole_max_len),
            )
            for r in self.history
        ]
        self.schedule.restore(adoptions, decided)
