"""The packer interface: documents (ids and lengths) in, one global plan of ``N`` micro-batches
per optimizer step out. Deterministic, so every data-parallel rank computes the same plan without
communication; its state is plain arrays, so a restored packer continues bit-for-bit.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchtitan_wlb.cost_model import CostModel


@dataclass(frozen=True)
class PackingConfig:
    """Knobs shared by the packers (each packer reads the ones it needs)."""

    micro_batches: int
    """N: micro-batches per optimizer step across all DP ranks (>= 1)."""
    context_len: int
    """L: the model's context length; one global batch holds ``N * L`` tokens (>= 1)."""
    smax: int | None = None
    """S_max: token cap of one micro-batch (>= context_len). ``None``: ``context_len`` for the
    fixed-length packers, ``floor(1.25 * context_len)`` for ``wlb``/``wlb_paper``."""
    queue_thresholds: tuple[int, ...] | None = None
    """Outlier-queue thresholds L_1 < ... < L_n in tokens (``wlb``, ``wlb_paper``); ``None``:
    derived from the cost model."""
    max_delay_steps: int = 12
    """K: a queued document waits at most this many steps, then is forced out (>= 0)."""
    packing_window: int = 1
    """G: global batches packed together by ``fixed_greedy`` and ``solver`` (>= 1)."""
    solver_time_limit_s: float = 60.0
    """``solver``: seconds HiGHS may spend per window; load-dependent, so with
    ``solver_node_limit`` set, reaching it is an error."""
    solver_node_limit: int | None = None
    """``solver``: branch-and-bound nodes per window, a deterministic bound (every rank computes
    the same plan); None: the time limit alone (one-process benchmarks)."""
    balance_target: float = 1.01
    """``wlb``: a queued outlier group is released only if the predicted max/mean workload of the
    step stays within this factor (>= 1)..."""
    adaptive_max_delay_steps: int = 32
    """``wlb``: K may grow up to this while the running mean delay stays under 90 % of
    ``delay_target`` (<= max_delay_steps: K stays fixed)."""
    delay_target: float = 0.38
    """``wlb``: running mean delay (steps per token) above which the adaptive K shrinks (> 0);
    the whole-pass delay ends 0.05-0.12 above it (docs/packing.md), under 0.5 steps."""
    release_slack: float = 0.25
    """``wlb``: ...plus ``release_slack * age / max_delay_steps`` for a group led by an outlier
    that has waited ``age`` steps (>= 0)."""
    read_ahead_steps: int = 2
    """``wlb``: global batches of documents read ahead of the packer (>= 1). The end of the data
    is seen when fewer than this many are left; they are all handed over then and the drain
    plans them with the held outliers. 1: the end is seen one step early (the other packers)."""

    def __post_init__(self) -> None:
        check_int("micro_batches", self.micro_batches, 1)
        check_int("context_len", self.context_len, 1)
        if self.smax is not None:
            check_int("smax", self.smax, 1)
            if self.smax < self.context_len:
                raise ValueError(
                    f"smax={self.smax} is below context_len={self.context_len}; "
                    "S_max must be >= the context length"
                )
        check_int("max_delay_steps", self.max_delay_steps, 0)
        check_int("packing_window", self.packing_window, 1)
        if not self.solver_time_limit_s > 0:
            raise ValueError(
                f"solver_time_limit_s must be > 0 seconds, got {self.solver_time_limit_s}"
            )
        if self.solver_node_limit is not None:
            check_int("solver_node_limit", self.solver_node_limit, 1)
        if not self.balance_target >= 1.0:
            raise ValueError(f"balance_target must be >= 1.0, got {self.balance_target}")
        check_int("adaptive_max_delay_steps", self.adaptive_max_delay_steps, 0)
        if not self.delay_target > 0.0:
            raise ValueError(f"delay_target must be > 0 steps, got {self.delay_target}")
        if not self.release_slack >= 0.0:
            raise ValueError(f"release_slack must be >= 0, got {self.release_slack}")
        check_int("read_ahead_steps", self.read_ahead_steps, 1)
        if self.queue_thresholds is not None:
            th = tuple(self.queue_thresholds)
            for t in th:
                check_int("queue_thresholds entry", t, 1)
            if any(b <= a for a, b in zip(th, th[1:], strict=False)):
                raise ValueError(f"queue_thresholds must be strictly increasing, got {list(th)}")


def check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class PackedStep:
    """One optimizer step's global plan."""

    step: int
    """Index of the step (0-based, counts every call to ``Packer.step``)."""
    doc_ids: list[np.ndarray]
    """``N`` arrays: the document ids of each micro-batch, in packing order."""
    doc_lens: list[np.ndarray]
    """``N`` arrays: the matching document lengths."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Per-step metrics: imbalance, min/max tokens, token-weighted delays, queue depths, pack_ms
    (CPU milliseconds of the packing thread)."""


_EMPTY = np.zeros(0, np.int64)


def _column(value: np.ndarray | int, n: int) -> np.ndarray:
    if isinstance(value, np.ndarray):  # the hot path: subsets and concatenations of pools
        return value.astype(np.int64, copy=False)
    return np.full(n, value, np.int64)


class DocPool:
    """Documents held by a packer as parallel int64 columns (vectorised selection and state).

    ``arrival``: the step the document entered the packing order (delays count from it).
    ``pulled``: the step it was read, earlier only for documents ``wlb`` handed back. ``tag``:
    packer-specific (``wlb``'s queue level, a windowed packer's micro-batch).
    """

    FIELDS = ("ids", "lens", "arrival", "tag", "pulled")

    def __init__(
        self,
        ids: np.ndarray = _EMPTY,
        lens: np.ndarray = _EMPTY,
        arrival: np.ndarray | int = 0,
        tag: np.ndarray | int = 0,
        pulled: np.ndarray | int | None = None,
    ) -> None:
        """Scalar columns are broadcast (``pulled`` defaults to ``arrival``); array columns are
        kept, not copied: pools never change a column in place, they replace it."""
        n = len(ids)
        self.ids, self.lens = _column(ids, n), _column(lens, n)
        self.arrival, self.tag = _column(arrival, n), _column(tag, n)
        self.pulled = _column(arrival if pulled is None else pulled, n)

    def __len__(self) -> int:
        return int(self.ids.size)

    @classmethod
    def _of(cls, *columns: np.ndarray) -> DocPool:
        """A pool of the int64 array columns :data:`FIELDS`, kept as they are (no checks or
        conversions): the per-step paths build several pools a step from int64 columns."""
        pool = cls.__new__(cls)
        pool.ids, pool.lens, pool.arrival, pool.tag, pool.pulled = columns
        return pool

    def subset(self, index: np.ndarray) -> DocPool:
        return DocPool._of(*(getattr(self, f)[index] for f in self.FIELDS))

    def take(self, mask: np.ndarray) -> DocPool:
        """Remove the documents selected by ``mask`` (bool or index array) and return them."""
        if len(mask) == 0 or (mask.dtype == bool and not mask.any()):
            return DocPool()  # nothing selected: this pool keeps every document
        sel = np.zeros(len(self), bool)
        sel[mask] = True
        out = self.subset(sel)
        for f in self.FIELDS:  # the rest stay
            setattr(self, f, getattr(self, f)[~sel])
        return out

    @classmethod
    def concat(cls, pools: list[DocPool]) -> DocPool:
        pools = [p for p in pools if p.ids.size]
        if len(pools) <= 1:  # columns are never changed in place, so they can be shared
            return cls._of(*(getattr(pools[0], f) for f in cls.FIELDS)) if pools else cls()
        return cls._of(*(np.concatenate([getattr(p, f) for p in pools]) for f in cls.FIELDS))

    def state(self) -> dict[str, list[int]]:
        return {f: getattr(self, f).tolist() for f in self.FIELDS}

    @classmethod
    def from_state(cls, state: dict[str, list[int]]) -> DocPool:
        return cls(*(np.asarray(state[f], np.int64).reshape(-1) for f in cls.FIELDS))


class Packer(ABC):
    """Base of all packers: validation, step counting, metrics and state. The documents a packer
    holds live in the :class:`DocPool` attributes named by ``_pools`` (``carry``: did not fit)."""

    name: str = "base"
    variable_length: bool = False
    """Whether micro-batches may exceed the context length up to ``smax`` (else capped at it)."""
    _pools: tuple[str, ...] = ("carry",)

    def __init__(self, config: PackingConfig, cost_model: CostModel) -> None:
        self.config = config
        self.cost_model = cost_model
        self.n = config.micro_batches
        self._step = 0
        self.carry = DocPool()
        self.cap = config.context_len  # token cap of a micro-batch: the longest document taken

    def tokens_wanted(self) -> int:
        """Tokens of new documents to pull before the next ``step`` (0: pull none): one global
        batch less what the packer carries, so every packer consumes data at TorchTitan's rate."""
        return max(0, self.n * self.config.context_len - int(self.carry.lens.sum()))

    def read_ahead_tokens(self) -> int:
        """Tokens the stream reads ahead of the packer: when fewer are left, the data ends (the
        rest is handed over at once and the packer is flushed). One global batch by default."""
        return self.n * self.config.context_len

    def has_pending(self) -> bool:
        """Whether documents are still carried, queued or planned (flush until False)."""
        return any(len(getattr(self, p)) for p in self._pools)

    def pending(self) -> DocPool:
        """Every document the packer still holds (carried, queued or planned)."""
        return DocPool.concat([getattr(self, p) for p in self._pools])

    @abstractmethod
    def _plan(self, ids: np.ndarray, lens: np.ndarray, flush: bool) -> tuple[DocPool, np.ndarray]:
        """Place documents for the current step: the emitted documents and their micro-batch."""

    def queue_depths(self) -> list[int]:
        """Documents waiting per outlier queue (empty for packers without queues)."""
        return []

    def check_lengths(self, ids: np.ndarray, lens: np.ndarray) -> None:
        """Lengths in ``[1, cap]``: a longer document can never be placed; an error, not a drop."""
        if lens.size and int(lens.min()) < 1:
            k = int(np.argmax(lens < 1))
            raise ValueError(f"document {int(ids[k])} has length {lens[k]}; lengths must be >= 1")
        if lens.size and int(lens.max()) > self.cap:
            k = int(np.argmax(lens > self.cap))
            raise ValueError(
                f"document {int(ids[k])} has {lens[k]} tokens, more than the micro-batch cap "
                f"{self.cap}; split long documents in the loader (max_doc_len <= {self.cap})"
            )

    def step(self, ids: np.ndarray, lens: np.ndarray, *, flush: bool = False) -> PackedStep:
        """Add this step's new documents and return the step's ``N`` micro-batches."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        lens = np.asarray(lens, dtype=np.int64).reshape(-1)
        if ids.shape != lens.shape:
            raise ValueError(f"got {ids.size} document ids but {lens.size} lengths")
        self.check_lengths(ids, lens)
        # CPU time of this thread: the packing cost on one core, unaffected by other processes
        # competing for the machine (wall time would charge their time slices to the packer).
        t0 = time.thread_time()
        docs, mb = self._plan(ids, lens, flush)
        pack_ms = (time.thread_time() - t0) * 1e3
        # Micro-batch numbers fit 16 bits: NumPy's stable sort is then a radix sort (same order).
        order = np.argsort(mb.astype(np.int16) if self.n <= 2**15 else mb, kind="stable")
        bounds = np.searchsorted(mb[order], np.arange(self.n + 1)).tolist()
        ids_sorted, lens_sorted = docs.ids[order], docs.lens[order]
        out_ids = [ids_sorted[i:j] for i, j in zip(bounds, bounds[1:], strict=False)]
        out_lens = [lens_sorted[i:j] for i, j in zip(bounds, bounds[1:], strict=False)]
        plan = PackedStep(self._step, out_ids, out_lens, self._stats(docs, mb, pack_ms))
        self._step += 1
        return plan

    def _stats(self, docs: DocPool, mb: np.ndarray, pack_ms: float) -> dict[str, Any]:
        cost = self.cost_model.doc_cost(docs.lens)
        loads = np.bincount(mb, weights=cost, minlength=self.n)
        tokens = np.bincount(mb, weights=docs.lens, minlength=self.n).astype(np.int64)
        mean = loads.mean()
        # Documents handed over early at the end of the data arrive at their stream step (wlb's
        # read-ahead); one trained before it counts as no delay, not a negative one.
        delay = np.maximum(self._step - docs.arrival, 0)
        ntok = int(docs.lens.sum())
        return {
            "imbalance": float(loads.max() / mean) if mean > 0 else 1.0,
            "min_tokens": int(tokens.min()),
            "max_tokens": int(tokens.max()),
            "tokens": ntok,
            "num_docs": int(docs.ids.size),
            "mean_delay": float((delay * docs.lens).sum() / ntok) if ntok else 0.0,
            "max_delay": int(delay.max()) if delay.size else 0,
            "queue_depths": self.queue_depths(),
            "pack_ms": pack_ms,
            "max_workload": float(loads.max()),
            "mean_workload": float(mean),
            "max_doc_workload": float(cost.max()) if cost.size else 0.0,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (ints and lists): enough to continue exactly."""
        pools = {p: getattr(self, p).state() for p in self._pools}
        return {"packer": self.name, "step": self._step, **pools}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("packer") != self.name:
            raise ValueError(
                f"state was saved by packer {state.get('packer')!r}, cannot load into {self.name!r}"
            )
        self._step = int(state["step"])
        for p in self._pools:
            setattr(self, p, DocPool.from_state(state[p]))

    @property
    def steps_done(self) -> int:
        return self._step
