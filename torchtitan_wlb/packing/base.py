"""The packer interface shared by every packing strategy.

A packer turns a stream of documents (ids and lengths; no tokens) into one *global* plan per
optimizer step: ``N`` micro-batches, each a list of document ids. It is a deterministic function of
the documents it has been given, so every data-parallel rank, fed the same stream, computes the
same plan without communication and keeps its own slice of the ``N`` micro-batches.

Driving protocol (implemented once in :mod:`torchtitan_wlb.packing.driver`, which the data node,
the tools and the simulator use):

1. ``budget = packer.tokens_wanted()``; pull documents from the stream, in order, until their
   token count reaches ``budget`` (the document crossing the budget is included; pull nothing when
   ``budget == 0``). This is one *global batch*: ``N * context_len`` tokens minus what the packer
   still carries, so that every strategy consumes the data at the same rate as TorchTitan's
   fixed-length packing.
2. ``plan = packer.step(ids, lens)``: the step's ``N`` micro-batches. Documents not placed are
   kept (carried or queued) and placed in a later step.
3. At the end of the data (a pull that runs out before its budget) that step and every later one
   are planned with ``flush=True`` while ``packer.has_pending()``: queued documents are released
   and nothing is lost. A run that stops before its data ends flushes the same way with no new
   documents (``driver.drain``).

All state lives in NumPy arrays exposed through ``state_dict`` / ``load_state_dict`` so that a
restored packer continues bit-for-bit.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchtitan_wlb.cost_model import CostModel

__all__ = ["PackingConfig", "PackedStep", "Packer", "DocPool", "validate_lengths"]


@dataclass(frozen=True)
class PackingConfig:
    """Knobs shared by the packers (each packer reads the ones it needs)."""

    micro_batches: int
    """N: micro-batches per optimizer step across all DP ranks (>= 1)."""
    context_len: int
    """L: the model's context length; one global batch holds ``N * L`` tokens (>= 1)."""
    smax: int | None = None
    """S_max: token cap of one micro-batch. ``None`` -> ``context_len`` for the fixed-length
    packers and ``round(1.25 * context_len)`` for ``wlb``/``wlb_paper``. Must be >= context_len."""
    queue_thresholds: tuple[int, ...] | None = None
    """Outlier-queue thresholds L_1 < ... < L_n in tokens (``wlb``, ``wlb_paper``); a document with
    ``L_i <= d < L_{i+1}`` waits in queue i. ``None`` -> derived from the cost model."""
    max_wait: int = 12
    """K: a queued document waits at most this many steps, then is forced out (>= 0)."""
    window: int = 1
    """G: global batches packed together by ``fixed_greedy`` and ``solver`` (>= 1)."""
    solver_time_limit: float = 10.0
    """Seconds HiGHS may spend per window (``solver``); the best solution found is used. Where it
    stops depends on the machine's load: with ``solver_node_limit`` set, reaching it is an error."""
    solver_node_limit: int | None = None
    """Branch-and-bound nodes HiGHS may explore per window (``solver``): a deterministic bound, so
    every rank computes the same plan. None: the time limit alone bounds the solve (one-process
    benchmarks; plans may then differ from run to run)."""
    balance_target: float = 1.01
    """``wlb``: a queued outlier group is released only if the predicted max/mean workload of the
    step stays within this factor (>= 1)..."""
    adaptive_max_wait: int = 32
    """``wlb``: K may grow from ``max_wait`` up to this while the running token-weighted mean
    delay stays under 90 % of ``delay_target`` (<= max_wait: K stays fixed). The bound on any
    document's wait is max(max_wait, adaptive_max_wait)."""
    delay_target: float = 0.3
    """``wlb``: running mean delay (steps per token) above which the adaptive K shrinks back
    towards ``max_wait`` (> 0)."""
    release_slack: float = 0.25
    """``wlb``: ...plus ``release_slack * age / max_wait`` for a group led by an outlier that has
    waited ``age`` steps (>= 0). An ageing outlier accepts a slightly unbalanced step early
    instead of being forced out alone, much less balanced, at ``max_wait``."""

    def __post_init__(self) -> None:
        _check_int("micro_batches", self.micro_batches, 1)
        _check_int("context_len", self.context_len, 1)
        if self.smax is not None:
            _check_int("smax", self.smax, 1)
            if self.smax < self.context_len:
                raise ValueError(
                    f"smax={self.smax} is below context_len={self.context_len}; "
                    "S_max must be >= the context length"
                )
        _check_int("max_wait", self.max_wait, 0)
        _check_int("window", self.window, 1)
        if not self.solver_time_limit > 0:
            raise ValueError(f"solver_time_limit must be > 0 seconds, got {self.solver_time_limit}")
        if self.solver_node_limit is not None:
            _check_int("solver_node_limit", self.solver_node_limit, 1)
        if not self.balance_target >= 1.0:
            raise ValueError(f"balance_target must be >= 1.0, got {self.balance_target}")
        _check_int("adaptive_max_wait", self.adaptive_max_wait, 0)
        if not self.delay_target > 0.0:
            raise ValueError(f"delay_target must be > 0 steps, got {self.delay_target}")
        if not self.release_slack >= 0.0:
            raise ValueError(f"release_slack must be >= 0, got {self.release_slack}")
        if self.queue_thresholds is not None:
            th = tuple(self.queue_thresholds)
            for t in th:
                _check_int("queue_thresholds entry", t, 1)
            if any(b <= a for a, b in zip(th, th[1:], strict=False)):
                raise ValueError(f"queue_thresholds must be strictly increasing, got {list(th)}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def validate_lengths(ids: np.ndarray, lens: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Check one batch of incoming documents; return them as int64 arrays.

    A document longer than ``cap`` can never be placed: the loader must split it first (its
    ``max_doc_len`` policy), so it is an error here rather than a silent drop.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    if ids.shape != lens.shape:
        raise ValueError(f"got {ids.size} document ids but {lens.size} lengths")
    if lens.size:
        bad = np.flatnonzero(lens < 1)
        if bad.size:
            raise ValueError(
                f"document {int(ids[bad[0]])} has length {int(lens[bad[0]])}; lengths must be >= 1"
            )
        too_long = np.flatnonzero(lens > cap)
        if too_long.size:
            i = too_long[0]
            raise ValueError(
                f"document {int(ids[i])} has {int(lens[i])} tokens, more than the micro-batch cap "
                f"{cap}; split long documents in the loader (max_doc_len <= {cap})"
            )
    return ids, lens


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


class DocPool:
    """Documents waiting in a packer: parallel int64 arrays (id, length, arrival, tag, pulled).

    ``arrival`` is the step a document entered the packing order (delays and the max wait count
    from it); ``pulled`` is the step its tokens were read from the stream, which differs only
    for documents a packer handed back unread-in-order (``wlb``'s back-pressure) and tells the
    data node how far back to replay the source on restore. ``tag`` is packer-specific (the
    queue level for ``wlb``, the planned step for windowed packers). Kept as arrays so that
    state save/restore and per-step selection are vectorised.
    """

    FIELDS = ("ids", "lens", "arrival", "tag", "pulled")

    def __init__(self) -> None:
        self.ids = np.zeros(0, np.int64)
        self.lens = np.zeros(0, np.int64)
        self.arrival = np.zeros(0, np.int64)
        self.tag = np.zeros(0, np.int64)
        self.pulled = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return int(self.ids.size)

    def add(
        self,
        ids: np.ndarray,
        lens: np.ndarray,
        arrival: np.ndarray | int,
        tag: np.ndarray | int = 0,
        pulled: np.ndarray | int | None = None,
    ) -> None:
        """Append documents; ``pulled`` defaults to ``arrival``."""
        n = ids.size

        def col(value: np.ndarray | int) -> np.ndarray:
            return np.broadcast_to(np.asarray(value, np.int64), (n,))

        self.ids = np.concatenate([self.ids, ids.astype(np.int64)])
        self.lens = np.concatenate([self.lens, lens.astype(np.int64)])
        self.arrival = np.concatenate([self.arrival, col(arrival)])
        self.tag = np.concatenate([self.tag, col(tag)])
        self.pulled = np.concatenate([self.pulled, col(arrival if pulled is None else pulled)])

    def take(self, mask: np.ndarray) -> DocPool:
        """Remove the documents selected by ``mask`` (bool or index array) and return them."""
        sel = np.zeros(len(self), bool)
        sel[mask] = True
        out = DocPool()
        for f in self.FIELDS:
            arr = getattr(self, f)
            setattr(out, f, arr[sel])
            setattr(self, f, arr[~sel])
        return out

    def subset(self, index: np.ndarray) -> DocPool:
        out = DocPool()
        for f in self.FIELDS:
            setattr(out, f, getattr(self, f)[index])
        return out

    @staticmethod
    def concat(pools: list[DocPool]) -> DocPool:
        out = DocPool()
        for f in DocPool.FIELDS:
            setattr(out, f, np.concatenate([getattr(p, f) for p in pools]))
        return out

    def state(self) -> dict[str, list[int]]:
        return {f: getattr(self, f).tolist() for f in self.FIELDS}

    @classmethod
    def from_state(cls, state: dict[str, list[int]]) -> DocPool:
        out = cls()
        for f in cls.FIELDS:
            # States written before ``pulled`` existed: every document was pulled on arrival.
            value = state[f] if f in state or f != "pulled" else state["arrival"]
            setattr(out, f, np.asarray(value, dtype=np.int64).reshape(-1))
        return out


class Packer(ABC):
    """Base of all packers: validation, step counting, metrics and state handling."""

    name: str = "base"
    variable_length: bool = False
    """Whether micro-batches may exceed the context length up to ``smax`` (else capped at it)."""

    def __init__(self, config: PackingConfig, cost_model: CostModel) -> None:
        self.config = config
        self.cost_model = cost_model
        self.n = config.micro_batches
        self._step = 0

    # ------------------------------------------------------------------ interface
    @property
    @abstractmethod
    def cap(self) -> int:
        """Token cap of one micro-batch (the longest document the packer accepts)."""

    @abstractmethod
    def tokens_wanted(self) -> int:
        """Tokens of new documents to pull before the next ``step`` (0: pull none)."""

    @abstractmethod
    def has_pending(self) -> bool:
        """Whether documents are still carried, queued or planned (flush until False)."""

    @abstractmethod
    def _plan(self, ids: np.ndarray, lens: np.ndarray, flush: bool) -> tuple[DocPool, np.ndarray]:
        """Place documents for the current step: the emitted documents and their micro-batch."""

    def queue_depths(self) -> list[int]:
        """Documents waiting per outlier queue (empty for packers without queues)."""
        return []

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        return None

    # ------------------------------------------------------------------ driver
    def step(self, ids: np.ndarray, lens: np.ndarray, *, flush: bool = False) -> PackedStep:
        """Add this step's new documents and return the step's ``N`` micro-batches."""
        ids, lens = validate_lengths(ids, lens, self.cap)
        # CPU time of this thread: the packing cost on one core, unaffected by other processes
        # competing for the machine (wall time would charge their time slices to the packer).
        t0 = time.thread_time()
        docs, mb = self._plan(ids, lens, flush)
        pack_ms = (time.thread_time() - t0) * 1e3
        order = np.argsort(mb, kind="stable")
        bounds = np.searchsorted(mb[order], np.arange(self.n + 1))
        ids_sorted, lens_sorted = docs.ids[order], docs.lens[order]
        out_ids = [ids_sorted[bounds[j] : bounds[j + 1]] for j in range(self.n)]
        out_lens = [lens_sorted[bounds[j] : bounds[j + 1]] for j in range(self.n)]
        stats = self._stats(docs, mb, pack_ms)
        plan = PackedStep(step=self._step, doc_ids=out_ids, doc_lens=out_lens, stats=stats)
        self._step += 1
        return plan

    def _stats(self, docs: DocPool, mb: np.ndarray, pack_ms: float) -> dict[str, Any]:
        cost = self.cost_model.doc_cost(docs.lens)
        loads = np.bincount(mb, weights=cost, minlength=self.n)
        tokens = np.bincount(mb, weights=docs.lens, minlength=self.n).astype(np.int64)
        mean = loads.mean()
        delay = self._step - docs.arrival
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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (ints and lists): enough to continue exactly."""
        return {"packer": self.name, "step": self._step, **self._extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("packer") != self.name:
            raise ValueError(
                f"state was saved by packer {state.get('packer')!r}, cannot load into {self.name!r}"
            )
        self._step = int(state["step"])
        self._load_extra_state(state)

    @property
    def steps_done(self) -> int:
        return self._step

    @abstractmethod
    def pending(self) -> DocPool:
        """Every document the packer still holds (carried, queued or planned)."""

    def pending_ids(self) -> np.ndarray:
        """Ids of every document the packer still holds (the node keeps their tokens)."""
        return self.pending().ids
