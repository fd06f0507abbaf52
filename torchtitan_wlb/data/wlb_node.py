"""torchdata node that packs a document stream into per-step micro-batches with a packer.

Every DP rank computes the same global plan from the same stream (no communication) and yields its
``N // dp`` micro-batches. The state holds source snapshots, not tokens: a restore re-reads them
(items and state: docs/packing.md, "The torchdata node"). A source with ``fetch_tokens`` (an indexed
corpus) gives lengths and places only: the node reads the tokens of this rank's micro-batches.
"""

from __future__ import annotations

import itertools
import sys
from operator import attrgetter
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from torchtitan_wlb.cost_fit import CostModelSchedule
from torchtitan_wlb.packing import Packer
from torchtitan_wlb.packing.base import check_int
from torchtitan_wlb.packing.driver import next_plan, pull_until, take_until
from torchtitan_wlb.packing.placement import dp_order

TOKEN_DTYPE = np.int32
"""dtype of the token arrays the node yields (token ids are below 2**31 in every vocabulary)."""

_EMPTY = np.zeros(0, np.int64)
_ZERO = np.zeros(1, np.int64)


def as_tokens(doc_id: int, tokens: Any) -> np.ndarray:
    """One document's tokens as a 1-D ``TOKEN_DTYPE`` array (no copy when it already is one)."""
    tokens = np.asarray(tokens)
    if tokens.dtype == TOKEN_DTYPE:
        return tokens
    if tokens.dtype.kind not in "iu":
        raise ValueError(
            f"document {doc_id}: tokens must be a 1-D integer array of length >= 1, got "
            f"shape {tokens.shape} dtype {tokens.dtype}"
        )
    info = np.iinfo(TOKEN_DTYPE)
    if tokens.size and (tokens.min() < info.min or tokens.max() > info.max):
        raise ValueError(
            f"document {doc_id}: token ids must fit in {np.dtype(TOKEN_DTYPE).name}, got values "
            f"in [{tokens.min()}, {tokens.max()}]"
        )
    return tokens.astype(TOKEN_DTYPE)


class WLBPackingNode(BaseNode[dict]):
    """Packs documents into ``N`` micro-batches per step and yields this DP rank's share;
    ``schedule`` sets the packer's cost model by step number, so that every DP rank and a resumed
    run pack each step with the same model."""

    POOL_SIZE = 4
    """Output buffers kept for reuse; when all are still referenced a fresh one is not kept."""

    def __init__(
        self,
        source: BaseNode,
        packer: Packer,
        *,
        dp_rank: int = 0,
        dp_degree: int = 1,
        schedule: CostModelSchedule | None = None,
    ) -> None:
        super().__init__()
        n = packer.n
        check_int("dp_degree", dp_degree, 1)
        if n % dp_degree != 0:
            raise ValueError(
                f"micro_batches N={n} must be divisible by dp_degree={dp_degree} "
                "(each DP rank takes N // dp_degree micro-batches)"
            )
        check_int("dp_rank", dp_rank, 0)
        if dp_rank >= dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank!r}")
        self.source = source
        self.packer = packer
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.schedule = schedule
        # Lengths and places from the source, tokens read for this rank's micro-batches only.
        self._lazy = callable(getattr(source, "fetch_tokens", None))
        self._per_rank = n // dp_degree
        self._initial_packer_state = packer.state_dict()
        self._tokens: dict[int, np.ndarray] = {}  # every held document: read-ahead + pending
        self._snapshots: list[tuple[int, dict[str, Any], int]] = []  # (step, source state, reads)
        self._held = _EMPTY  # per snapshot: how many of the documents its pull read are held
        self._snap_base = 0  # serial number of ``_snapshots[0]``
        self._snap_of: dict[int, int] = {}  # held document id -> serial of the pull that read it
        self._ahead_ids = _EMPTY  # read, not given to the packer yet (stream order)
        self._ahead_lens = _EMPTY
        self._source_done = False
        self._exhausted = False
        self._buffers: list[np.ndarray] = []  # output buffers (see ``_out_buffer``)
        self._free_refs = 0  # a pooled buffer's reference count when nothing else holds it
        self._add_buffer(self._per_rank * packer.cap).fill(0)  # see ``_add_buffer``

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._tokens = {}
        self._held, self._snap_base, self._snap_of = _EMPTY, 0, {}
        self._ahead_ids = self._ahead_lens = _EMPTY
        self._lazy_reset()
        if initial_state is None:
            self.source.reset(None)
            self.packer.load_state_dict(self._initial_packer_state)
            self._snapshots = []
            self._source_done = self._exhausted = False
            return
        self.packer.load_state_dict(initial_state["packer"])
        self._exhausted = bool(initial_state["exhausted"])
        self._source_done = bool(initial_state["source_done"])
        self._snapshots = [(int(s), st, int(k)) for s, st, k in initial_state["snapshots"]]
        ahead = np.asarray(initial_state["ahead"], np.int64).reshape(-1, 2)
        self._ahead_ids, self._ahead_lens = ahead[:, 0].copy(), ahead[:, 1].copy()
        pending = self.packer.pending()
        held = dict(zip(pending.ids.tolist(), pending.lens.tolist(), strict=True))
        held.update(zip(self._ahead_ids.tolist(), self._ahead_lens.tolist(), strict=True))
        self._replay(held)
        self.source.reset(initial_state["source"])

    def get_state(self) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(),
            "packer": self.packer.state_dict(),
            "snapshots": [[s, st, k] for s, st, k in self._snapshots],
            "ahead": np.stack([self._ahead_ids, self._ahead_lens], axis=1).tolist(),
            "source_done": self._source_done,
            "exhausted": self._exhausted,
        }

    def next(self) -> dict[str, Any]:
        if self.schedule is not None:  # plan i (0-based) is trained at step i + 1
            self.packer.cost_model = self.schedule.model_for_step(self.packer.steps_done + 1)
        plan = next_plan(self.packer, self)
        if plan is None:
            raise StopIteration
        mine = self._rank_micro_batches(plan.doc_lens)
        counts = np.fromiter(map(len, plan.doc_ids), np.int64, len(plan.doc_ids))
        ends = np.cumsum(counts)
        # Every emitted document leaves the node; this rank keeps the tokens of its own.
        pick = None
        if self.dp_degree > 1:
            pick = np.concatenate([np.arange(ends[j] - counts[j], ends[j]) for j in mine.tolist()])
        if self._lazy:  # rows of the window: the places of this rank's documents
            rel = np.concatenate(plan.doc_ids) - self._lz_base
            pulls = self._lz_rows[rel, 3]
            parts = self._lz_rows[rel if pick is None else rel[pick], :3].tolist()
        else:
            emitted = np.concatenate(plan.doc_ids).tolist()
            parts = list(map(self._tokens.pop, emitted))
            pulls = np.fromiter(map(self._snap_of.pop, emitted), np.int64, len(emitted))
            if pick is not None:
                parts = list(map(parts.__getitem__, pick.tolist()))
        lens = [plan.doc_lens[j] for j in mine.tolist()]
        # Buffer offsets of this rank's micro-batches: the running token count at each one's end.
        running = np.concatenate([_ZERO, np.cumsum(np.concatenate(lens))])
        bounds = running[np.concatenate([_ZERO, np.cumsum(counts[mine])])].tolist()
        buf = self._out_buffer(bounds[-1])
        if self._lazy:
            self.source.fetch_tokens(parts, buf[: bounds[-1]])
        elif parts:
            np.concatenate(parts, out=buf[: bounds[-1]])
        micro_batches = [
            {"tokens": buf[lo:hi], "doc_lens": d, "doc_ids": plan.doc_ids[j]}
            for lo, hi, d, j in zip(bounds[:-1], bounds[1:], lens, mine.tolist(), strict=True)
        ]
        self._prune(pulls)
        stats = {**plan.stats, "step": plan.step}
        if self.schedule is not None:
            stats["cost_attn_coef"] = self.packer.cost_model.attn_coef
            stats["cost_linear_coef"] = self.packer.cost_model.linear_coef
        return {"micro_batches": micro_batches, "stats": stats}

    @property
    def exhausted(self) -> bool:
        """Whether the data has ended for the packer (it is flushed from then on)."""
        return self._exhausted

    def pull(self, budget: int, horizon: int) -> tuple[np.ndarray, np.ndarray]:
        """The next documents by the budget rule, read-ahead first, keeping their tokens; then
        read ahead ``horizon`` tokens (what is left when less: joins this pull, ending the data),
        recording the source's state before these reads so that a restore can replay them."""
        if budget <= 0 or self._exhausted:
            return _EMPTY, _EMPTY
        snapshot = self.source.state_dict()
        k, _ = take_until(budget, np.cumsum(self._ahead_lens), 0)
        head_ids, head_lens = self._ahead_ids[:k], self._ahead_lens[:k]
        self._ahead_ids, self._ahead_lens = self._ahead_ids[k:], self._ahead_lens[k:]
        read_ids, read_lens, read = self._read(budget - int(head_lens.sum()))
        ids, lens = [head_ids, read_ids], [head_lens, read_lens]
        more_ids, more_lens, more = self._read(horizon - int(self._ahead_lens.sum()))
        self._ahead_ids = np.concatenate([self._ahead_ids, more_ids])
        self._ahead_lens = np.concatenate([self._ahead_lens, more_lens])
        if self._source_done and int(self._ahead_lens.sum()) < horizon:
            # Less than a step is left: it ends the data now.
            ids.append(self._ahead_ids)
            lens.append(self._ahead_lens)
            self._ahead_ids = self._ahead_lens = _EMPTY
            self._exhausted = True
        n_read = read_ids.size + more_ids.size
        if n_read:
            serial = self._snap_base + len(self._snapshots)
            if self._lazy:
                self._lazy_commit(serial)
            else:
                self._snap_of.update(zip(read + more, itertools.repeat(serial)))
            self._snapshots.append((self.packer.steps_done, snapshot, n_read))
            self._held = np.append(self._held, n_read)
        return np.concatenate(ids), np.concatenate(lens)

    def _read(self, tokens: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Documents from the source by the budget rule (``read_documents`` when it has it, else
        item by item) until the source ends; their tokens are kept. Returns their ids (an array
        and a list: the per-document bookkeeping takes Python ints, made once), lengths."""
        if tokens <= 0 or self._source_done:
            return _EMPTY, _EMPTY, []
        if self._lazy:
            return self._read_lengths(tokens)
        batched = getattr(self.source, "read_documents", None)
        if batched is not None:
            doc_ids, arrays = batched(tokens)
            doc_ids = np.asarray(doc_ids, np.int64).reshape(-1)
            arrays = list(arrays)
        else:
            ids_read: list[int] = []
            arrays = []

            def pull() -> int | None:
                try:
                    doc_id, array = self._unpack(next(self.source))
                except StopIteration:
                    return None
                ids_read.append(doc_id)
                arrays.append(array)
                return array.size

            pull_until(tokens, pull)
            doc_ids = np.asarray(ids_read, np.int64)
        lens, ids = self._check(doc_ids, arrays)
        if int(lens.sum()) < tokens:
            self._source_done = True
        self._tokens.update(zip(ids, arrays, strict=True))
        return doc_ids, lens, ids

    # A source of lengths and places (``fetch_tokens``) numbers its documents consecutively, so
    # the node keeps, instead of a token array per held document, one window of rows indexed by
    # id - ``_lz_base``: (document, first token, length, serial of the pull that read it), from the
    # oldest live pull on. Per step that is a few array operations, not dict operations per
    # document (about 100,000 a step at DP = 512, 128K, N = 8 per rank).

    def _lazy_reset(self) -> None:
        self._lz_base = 0
        self._lz_rows = np.zeros((0, 4), np.int64)
        self._lz_first = _EMPTY  # per live pull: the id of its first document
        self._lz_staged: list[np.ndarray] = []

    def _read_lengths(self, tokens: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``_read`` from a source of lengths and places: the rows are staged for
        :meth:`_lazy_commit`, no tokens are read."""
        doc_ids, lens, where = self.source.read_lengths(tokens)
        if int(lens.sum()) < tokens:
            self._source_done = True
        if not lens.size:
            return _EMPTY, _EMPTY, []
        self.packer.check_lengths(doc_ids, lens)
        expect = self._lz_staged[-1][-1, 4] + 1 if self._lz_staged else None
        if doc_ids[0] != (expect if expect is not None else doc_ids[0]) or (
            doc_ids.size > 1 and bool((np.diff(doc_ids) != 1).any())
        ):
            raise ValueError("a source of lengths must number its documents consecutively")
        rows = np.empty((lens.size, 5), np.int64)
        rows[:, :2], rows[:, 2], rows[:, 4] = where, lens, doc_ids
        self._lz_staged.append(rows)
        return doc_ids, lens, []

    def _lazy_commit(self, serial: int) -> None:
        """The staged rows become pull ``serial``'s, appended to the window."""
        rows = np.concatenate(self._lz_staged)
        self._lz_staged = []
        rows[:, 3] = serial
        first = int(rows[0, 4])
        if not self._lz_rows.size:
            self._lz_base = first
        elif first != self._lz_base + len(self._lz_rows):
            raise ValueError("a source of lengths must number its documents consecutively")
        self._lz_rows = np.concatenate([self._lz_rows, rows[:, :4]])
        self._lz_first = np.append(self._lz_first, first)

    def _lazy_prune(self, k: int) -> None:
        """Drop the rows of the ``k`` oldest pulls (the window starts at the next live one)."""
        self._lz_first = self._lz_first[k:]
        if not self._lz_first.size:
            self._lz_base, self._lz_rows = 0, self._lz_rows[:0]
            return
        new_base = int(self._lz_first[0])
        self._lz_rows = self._lz_rows[new_base - self._lz_base :]
        self._lz_base = new_base

    def _lazy_replay(self, held: dict[int, int]) -> None:
        """``_replay`` for a source of lengths: re-read each pull's lengths and places."""
        self.source.reset(self._snapshots[0][1])
        for serial, (_, _, count) in enumerate(self._snapshots):
            ids, lens, where = self.source.read_lengths(sys.maxsize, max_items=count)
            if ids.size != count:
                raise RuntimeError(
                    f"replaying the source gave {ids.size} documents where pull {serial} read "
                    f"{count}: the source is not deterministic"
                )
            rows = np.empty((count, 5), np.int64)
            rows[:, :2], rows[:, 2], rows[:, 4] = where, lens, ids
            self._lz_staged = [rows]
            self._lazy_commit(self._snap_base + serial)
        ids = np.fromiter(held, np.int64, len(held))
        lens = np.fromiter(held.values(), np.int64, len(held))
        rel = ids - self._lz_base
        inside = (rel >= 0) & (rel < len(self._lz_rows))
        if not inside.all():
            raise RuntimeError(
                f"{int((~inside).sum())} held documents (e.g. {int(ids[~inside].min())}) were not "
                "found when replaying the source: the source is not deterministic"
            )
        bad = np.flatnonzero(self._lz_rows[rel, 2] != lens)
        if bad.size:
            i = int(bad[0])
            raise RuntimeError(
                f"replayed document {int(ids[i])} has {int(self._lz_rows[rel[i], 2])} tokens, "
                f"checkpoint says {int(lens[i])}: the source is not deterministic"
            )
        serials = self._lz_rows[rel, 3] - self._snap_base
        self._held = np.bincount(serials, minlength=len(self._snapshots)).astype(np.int64)

    def _rank_micro_batches(self, doc_lens: list[np.ndarray]) -> np.ndarray:
        """The plan's micro-batches this DP rank trains: contiguous slices for ``original`` (the
        baseline, as TorchTitan), dealt by workload (``dp_order``) for the other packers."""
        if self.dp_degree == 1:
            return np.arange(len(doc_lens))
        sizes = np.fromiter(map(len, doc_lens), np.int64, len(doc_lens))
        costs = self.packer.cost_model.doc_cost(np.concatenate(doc_lens))
        loads = np.bincount(np.repeat(np.arange(sizes.size), sizes), costs, minlength=sizes.size)
        order = dp_order(loads, self.dp_degree, balanced=self.packer.name != "original")
        lo = self.dp_rank * self._per_rank
        return order[lo : lo + self._per_rank]

    def _out_buffer(self, size: int) -> np.ndarray:
        """A ``TOKEN_DTYPE`` buffer of at least ``size`` elements that nothing else refers to: a
        pooled one whose reference count is back to the pool's own (docs/packing.md)."""
        free = self._free_refs
        for k in range(len(self._buffers)):
            if self._buffers[k].size >= size and sys.getrefcount(self._buffers[k]) <= free:
                return self._buffers[k]
        if len(self._buffers) >= self.POOL_SIZE:
            return np.empty(size, TOKEN_DTYPE)
        return self._add_buffer(size)

    def _add_buffer(self, size: int) -> np.ndarray:
        """A new pooled buffer of at least ``size`` (and at least a full step's) elements. The
        node builds its first one and touches its pages when it is built: setup, like the model's
        parameters, so that the first step does not pay a page fault per 4 KiB of its output
        (about 5,000 of them for 20 MB at ``N = 32``, several ms; docs/packing.md)."""
        self._buffers.append(np.empty(max(size, self._per_rank * self.packer.cap), TOKEN_DTYPE))
        self._free_refs = sys.getrefcount(self._buffers[-1])
        return self._buffers[-1]

    def _unpack(self, item: Any) -> tuple[int, Any]:
        """One source item's id and tokens (as a ``TOKEN_DTYPE`` array); from a source of lengths
        (``fetch_tokens``), its place ``(document, first token, length)``."""
        if self._lazy:
            doc_id = int(item["doc_id"])
            return doc_id, (int(item["where"][0]), int(item["where"][1]), int(item["length"]))
        if not isinstance(item, dict) or "doc_id" not in item or "tokens" not in item:
            raise ValueError(
                "the document stream must yield dicts with 'doc_id' and 'tokens', got "
                f"{type(item).__name__}"
            )
        doc_id = int(item["doc_id"])
        return doc_id, as_tokens(doc_id, item["tokens"])

    def _check(self, doc_ids: np.ndarray, arrays: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
        """Check a batch read from the source (vectorised) and return the lengths and the ids as
        a list; arrays of another integer dtype are converted in place in ``arrays``."""
        if doc_ids.size != len(arrays):
            raise ValueError(
                f"the source gave {doc_ids.size} document ids but {len(arrays)} arrays"
            )
        if not arrays:
            return _EMPTY, []
        if set(map(attrgetter("dtype"), arrays)) != {np.dtype(TOKEN_DTYPE)}:
            arrays[:] = [as_tokens(i, a) for i, a in zip(doc_ids.tolist(), arrays, strict=True)]
        lens = np.fromiter(map(attrgetter("size"), arrays), np.int64, len(arrays))
        if set(map(attrgetter("ndim"), arrays)) != {1} or int(lens.min()) < 1:
            ndim = np.fromiter(map(attrgetter("ndim"), arrays), np.int64, len(arrays))
            bad = np.flatnonzero((ndim != 1) | (lens < 1))
            i, a = int(doc_ids[bad[0]]), arrays[bad[0]]
            raise ValueError(
                f"document {i}: tokens must be a 1-D integer array of length >= 1, got "
                f"shape {a.shape} dtype {a.dtype}"
            )
        self.packer.check_lengths(doc_ids, lens)
        ids = doc_ids.tolist()  # sets, not np.unique: a tenth of the time at ~1,000 ids
        if len(set(ids)) != len(ids) or not self._tokens.keys().isdisjoint(ids):
            seen = set(self._tokens)
            twice = next(i for i in ids if i in seen or seen.add(i))
            raise ValueError(f"document id {twice} appears twice among pending documents")
        return lens, ids

    def _prune(self, pulls: np.ndarray) -> None:
        """Count the emitted documents (``pulls``: the serial of the pull that read each) out of
        their snapshots and drop the oldest snapshots that no longer hold any (one ``bincount``)."""
        if pulls.size:
            self._held -= np.bincount(pulls - self._snap_base, minlength=self._held.size)
        live = np.flatnonzero(self._held)
        k = int(live[0]) if live.size else int(self._held.size)
        if k:
            del self._snapshots[:k]
            self._held = self._held[k:]
            self._snap_base += k
            if self._lazy:
                self._lazy_prune(k)

    def _replay(self, held: dict[int, int]) -> None:
        """Re-read the pulls since the oldest held document was read; keep the held documents."""
        self._held = np.zeros(len(self._snapshots), np.int64)  # per pull; none: dropped next step
        if self._lazy and self._snapshots:  # the window's rows stay aligned with the pulls
            self._lazy_replay(held)
            return
        if not held:
            return
        if not self._snapshots:
            raise ValueError("checkpoint holds documents but no source snapshots")
        self.source.reset(self._snapshots[0][1])
        for serial, (_, _, count) in enumerate(self._snapshots):
            for _ in range(count):
                doc_id, tokens = self._unpack(next(self.source))
                if doc_id in held:
                    size = tokens[2] if self._lazy else tokens.size
                    if size != held[doc_id]:
                        raise RuntimeError(
                            f"replayed document {doc_id} has {size} tokens, checkpoint "
                            f"says {held[doc_id]}: the source is not deterministic"
                        )
                    self._tokens[doc_id] = tokens
                    self._snap_of[doc_id] = self._snap_base + serial
                    self._held[serial] += 1
        if missing := set(held) - set(self._tokens):
            raise RuntimeError(
                f"{len(missing)} held documents (e.g. {min(missing)}) were not found when "
                "replaying the source: the source is not deterministic"
            )
