"""Context-parallel sharding plans for one packed micro-batch (pure NumPy).

A packed micro-batch of ``T`` tokens holds documents of known lengths. Context parallelism over ``c``
ranks cuts it into ``2c`` chunk *slots*; rank ``r`` keeps slot ``r`` (its *head*) and slot
``2c - 1 - r`` (its *tail*), so that under causal attention an early, cheap slot is paired with a late,
expensive one.

* ``per_sequence`` (TorchTitan's head-tail balancer): the slots are ``2c`` contiguous pieces of the
  whole packed sequence. Balanced for one long document, unbalanced for a pack of several documents
  (the slot holding a long document's end does most of the work).
* ``per_document`` (WLB-LLM): every document is cut into ``2c`` chunks and chunk ``j`` goes to slot
  ``j``, so every rank does the same attention work for every document. No padding: each chunk gets
  ``d // 2c`` tokens and the ``d % 2c`` remainder tokens are dealt one per slot, continuing from where
  the previous document's remainder stopped (a counter carried across documents). Per-document work is
  then balanced up to one token per slot.
* ``hybrid``: documents up to ``max_len`` tokens stay *whole* on one rank (assigned so that every rank's
  attention work and token count are balanced); longer ones are split into ``2c`` chunks exactly as
  per-document sharding does (the remainder counter runs over the split documents only). A whole
  document attends to its rank's local keys only, so the CP op all-gathers K/V of the split documents
  alone (``doc_gathered``). The default ``max_len`` is ``2c * 128`` (:func:`default_hybrid_max_len`):
  below it a per-document chunk would be shorter than a 128-token attention tile.

Choosing between the two per micro-batch (``adaptive``) is :mod:`torchtitan_wlb.cp.adaptive`, which
estimates both from a :class:`ShardingDraft` (the segments before the local layout is built); the
tensors a rank feeds the CP op come from :mod:`torchtitan_wlb.cp.local`. This module imports no
torch and nothing else of the package.

**Padding policy.** Plans never add tokens. When ``T`` is not a multiple of ``2c``, slot sizes differ by
at most one token (the first ``T % 2c`` slots, in dealing order ``0, 1, ..., 2c - 1``, get one more), so
local lengths differ by at most two tokens across ranks; the CP op pads only its internal all-gather
buffer to the longest local length. Since dealing starts at slot 0 and slots ``0..c-1`` belong to
ranks ``0..c-1``, every rank holds at least one token whenever ``T >= c``; ``T < c`` is rejected.

**Local layout.** Rank-major: rank ``r``'s tokens are its head slot's segments (in document order)
followed by its tail slot's segments. Under hybrid sharding a whole document is one segment of its
rank's tail slot, placed after the slot's split-document segments, so every rank's local tokens are
``[head split segments][tail split segments][whole documents]`` and the gathered tokens are a prefix. A *segment* is the part of one document inside one slot; its
queries attend to the document's prefix up to the segment's end (bottom-right causal). Within one slot
each document appears at most once, which lets each half run as one varlen call whose key segments are
disjoint ranges of the globally ordered keys (gaps between them are zero-query segments).

**Hybrid padding.** Hybrid plans add no tokens either, but whole documents make local lengths differ
by up to about one whole document between ranks (the assignment balances them); every rank holds at
least one token whenever ``T >= c`` (if fewer than ``c`` documents are whole and the split ones have
fewer than ``c`` tokens, the longest whole documents are split too until they have ``c``).

Construction is vectorised: the cost is O(num_docs * 2c) for the segment table plus O(T) for the
index arrays of the ranks that are asked for; no Python loop runs over documents (hybrid's rank
assignment runs a bounded number of vectorised refinement passes, independent of the document count).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ATTENTION_TILE",
    "FIXED_STRATEGIES",
    "CPPlan",
    "LocalAttentionSpec",
    "ShardingDraft",
    "auto_hybrid_max_len",
    "causal_pairs",
    "default_hybrid_max_len",
    "draft_sharding",
    "validate_doc_lens",
]

FIXED_STRATEGIES = ("per_sequence", "per_document", "hybrid")

ATTENTION_TILE = 128
"""Query/key tile of the varlen attention kernels (flash-attn's 128-row blocks): a chunk shorter than
this runs a mostly padded tile."""


def default_hybrid_max_len(cp_degree: int) -> int:
    """Hybrid's default whole-document threshold: ``2 * cp_degree * ATTENTION_TILE`` tokens.

    Why this length: per-document sharding cuts a document of ``d`` tokens into ``2c`` chunks of
    ``d // 2c`` tokens, which is below the kernel's 128-token tile exactly when ``d < 2c * 128``.
    Keeping documents up to that length whole means no split document ever yields a sub-tile chunk
    (a split document has more than ``2c * 128`` tokens, so every chunk has at least 128), while
    documents long enough to need the whole group's balance are still split.
    """
    return 2 * int(cp_degree) * ATTENTION_TILE


def causal_pairs(q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
    """(query, key) pairs a bottom-right causal segment computes: ``q*kv - q*(q-1)/2`` for q <= kv."""
    q = np.asarray(q_len, dtype=np.float64)
    kv = np.asarray(kv_len, dtype=np.float64)
    return q * kv - q * (q - 1.0) / 2.0


@dataclass(frozen=True)
class LocalAttentionSpec:
    """What one rank's local attention needs, for its head half and its tail half.

    Keys are indexed in *global token order* (the packed micro-batch order, as the CP op lays out the
    all-gathered keys). Segment lists interleave zero-query "gap" segments so that consecutive key
    segments are contiguous: ``[gap_0, doc_0 prefix, gap_1, doc_1 prefix, ..., final gap]``.

    Keys of the two halves are the *gathered* keys only (all documents under per-sequence and
    per-document sharding; the split documents under hybrid), in global order with the whole
    documents left out. A rank's whole documents (hybrid) form a third, purely local varlen call:
    local tokens ``[n_gather_tokens:]`` attend to themselves with ``cu_seqlens_whole`` on both sides.

    Attributes:
        n_head_tokens: local tokens of the head half (the tail half follows them).
        n_gather_tokens: local tokens whose K/V enter the all-gather (head and tail halves); the
            whole documents follow them.
        cu_seqlens_q: ``(head, tail)`` int32 cumulative query lengths into the local tokens of each
            half (each starts at 0).
        cu_seqlens_k: ``(head, tail)`` int32 cumulative key lengths into the gathered key order
            (each ends at the number of gathered tokens, ``T`` without hybrid).
        max_seqlen_q: ``(head, tail)`` longest query segment.
        max_seqlen_k: ``(head, tail)`` longest key segment (gaps included).
        cu_seqlens_whole: int32 document boundaries of the whole documents, relative to local
            token ``n_gather_tokens`` (``[0]`` when the rank has none).
        max_seqlen_whole: longest whole document (0 when none).
    """

    n_head_tokens: int
    n_gather_tokens: int
    cu_seqlens_q: tuple[np.ndarray, np.ndarray]
    cu_seqlens_k: tuple[np.ndarray, np.ndarray]
    max_seqlen_q: tuple[int, int]
    max_seqlen_k: tuple[int, int]
    cu_seqlens_whole: np.ndarray
    max_seqlen_whole: int


@dataclass(frozen=True)
class CPPlan:
    """How one packed micro-batch is split over ``cp_degree`` ranks.

    The segment table lists, in global token order, every (document, slot) piece. Every array is
    int64 unless stated otherwise.

    Attributes:
        doc_lens: ``[n_docs]`` document lengths of the micro-batch.
        doc_cu: ``[n_docs + 1]`` document start offsets in the packed sequence.
        cp_degree: number of CP ranks ``c``.
        strategy: the sharding in effect, ``"per_sequence"``, ``"per_document"`` or ``"hybrid"``.
        requested: the strategy that was asked for (``"adaptive"`` resolves to a fixed one).
        seg_doc: ``[S]`` document of each segment.
        seg_start: ``[S]`` first position of the segment inside its document.
        seg_len: ``[S]`` tokens of the segment (0 for chunks of documents shorter than ``2c``).
        seg_slot: ``[S]`` chunk slot ``0 .. 2c-1`` of the segment (a hybrid whole document sits in
            its rank's tail slot).
        slot_order: ``[S]`` segment ids sorted by (slot, gathered before whole, document).
        slot_offsets: ``[2c + 1]`` range of ``slot_order`` holding each slot.
        slot_tokens: ``[2c]`` tokens per slot.
        local_lens: ``[c]`` tokens per rank (head slot + tail slot).
        seg_local_offset: ``[S]`` offset of each segment inside its rank's local layout.
        doc_gathered: ``[n_docs]`` bool, whether the document's K/V go through the CP op's
            all-gather: every document under per-sequence and per-document sharding, the split
            ones under hybrid (a whole document attends to its own rank's keys only).
        gather_lens: ``[c]`` local tokens of each rank whose K/V are gathered (a prefix of its local
            layout; equal to ``local_lens`` unless hybrid keeps documents whole).
        max_len: hybrid's whole-document threshold in tokens (0 for the other strategies).
        estimated_seconds: ``{strategy: estimated max-rank latency}`` when adaptive selection ran,
            else empty.
    """

    doc_lens: np.ndarray
    doc_cu: np.ndarray
    cp_degree: int
    strategy: str
    requested: str
    seg_doc: np.ndarray
    seg_start: np.ndarray
    seg_len: np.ndarray
    seg_slot: np.ndarray
    slot_order: np.ndarray
    slot_offsets: np.ndarray
    slot_tokens: np.ndarray
    local_lens: np.ndarray
    seg_local_offset: np.ndarray
    doc_gathered: np.ndarray
    gather_lens: np.ndarray
    max_len: int = 0
    estimated_seconds: dict[str, float] = field(default_factory=dict)

    # ----------------------------------------------------------------------------------- basics
    @property
    def seq_len(self) -> int:
        """Tokens of the packed micro-batch."""
        return int(self.doc_cu[-1])

    @property
    def max_local_len(self) -> int:
        """Longest local length over the ranks."""
        return int(self.local_lens.max())

    @property
    def max_gather_len(self) -> int:
        """Rows per rank of the CP op's all-gather buffer: the most gathered tokens on one rank
        (0: nothing to gather, the op skips the collective)."""
        return int(self.gather_lens.max())

    @property
    def gathered_len(self) -> int:
        """Tokens whose K/V are gathered (the length of the key order of the two split halves)."""
        return int(self.gather_lens.sum())

    def slot_owner(self) -> np.ndarray:
        """``[2c]`` rank owning each slot."""
        slots = np.arange(2 * self.cp_degree)
        return np.minimum(slots, 2 * self.cp_degree - 1 - slots)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp_degree:
            raise ValueError(f"rank {rank} is outside the CP group [0, {self.cp_degree})")

    def _rank_segments(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Segment ids of the head slot and of the tail slot of ``rank``, each in local order."""
        self._check_rank(rank)
        off = self.slot_offsets
        tail = 2 * self.cp_degree - 1 - rank
        return (
            self.slot_order[off[rank] : off[rank + 1]],
            self.slot_order[off[tail] : off[tail + 1]],
        )

    # ---------------------------------------------------------------------------- index arrays
    def rank_indices(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``(token_indices, positions)`` of ``rank``, both ``[local_lens[rank]]``: indices into the
        packed sequence of the tokens it keeps (local layout order) and their per-document
        positions (RoPE positions, restarting at 0 for every document)."""
        segs = np.concatenate(self._rank_segments(rank))
        lens = self.seg_len[segs]
        local = _arange(int(self.local_lens[rank]))
        pos_shift = self.seg_start[segs] - self.seg_local_offset[segs]
        positions = np.repeat(pos_shift, lens)
        positions += local
        tokens = np.repeat(self.doc_cu[self.seg_doc[segs]], lens)
        tokens += positions
        return tokens, positions

    def token_indices(self, rank: int) -> np.ndarray:
        """``[local_lens[rank]]`` indices into the packed sequence of the tokens ``rank`` keeps."""
        return self.rank_indices(rank)[0]

    def positions(self, rank: int) -> np.ndarray:
        """``[local_lens[rank]]`` per-document positions (RoPE) of the tokens ``rank`` keeps."""
        return self.rank_indices(rank)[1]

    def _all_gathered(self) -> bool:
        return self.gathered_len == self.seq_len

    def _doc_key_start(self) -> np.ndarray:
        """``[n_docs]`` start of each gathered document in the gathered key order (the packed order
        with whole documents left out)."""
        if self._all_gathered():
            return self.doc_cu[:-1]
        gathered = np.where(self.doc_gathered, self.doc_lens, 0)
        return np.cumsum(gathered) - gathered

    def kv_order(self) -> np.ndarray:
        """``[gathered_len]``: row of the all-gather buffer (``c * max_gather_len`` rows, rank-major)
        holding each gathered token, in gathered key order (the packed order, whole documents left
        out; ``[T]`` without hybrid). Indexing the buffer with it puts the keys in that order."""
        if self._all_gathered():
            segs = slice(None)
        elif self.gathered_len == 0:
            return np.zeros(0, dtype=np.int64)
        else:
            segs = np.flatnonzero(self.doc_gathered[self.seg_doc])
        seg_slot, seg_doc = self.seg_slot[segs], self.seg_doc[segs]
        seg_start, seg_len = self.seg_start[segs], self.seg_len[segs]
        owner = self.slot_owner()[seg_slot]
        gathered = owner * self.max_gather_len + self.seg_local_offset[segs]
        key_start = self._doc_key_start()[seg_doc] + seg_start
        order = np.repeat(gathered - key_start, seg_len)
        order += _arange(self.gathered_len)
        return order

    def local_attention_spec(self, rank: int) -> LocalAttentionSpec:
        """cu_seqlens of ``rank``'s varlen calls (head half, tail half, whole documents)."""
        key_start = self._doc_key_start()
        total = self.gathered_len
        head, tail = self._rank_segments(rank)
        gathered = self.doc_gathered[self.seg_doc[tail]]
        n_tail_split = int(np.count_nonzero(gathered))  # whole documents follow the split ones
        whole = tail[n_tail_split:]
        halves = []
        for segs in (head, tail[:n_tail_split]):  # two halves, not a loop over documents
            segs = segs[self.seg_len[segs] > 0]
            q_len = self.seg_len[segs]
            prefix = self.seg_start[segs] + q_len  # keys a segment sees: its document's prefix
            k_start = key_start[self.seg_doc[segs]]
            gaps = np.append(k_start, total) - np.append(0, k_start + prefix)
            q_lens = np.zeros(2 * len(segs) + 1, dtype=np.int64)
            q_lens[1::2] = q_len
            k_lens = np.empty(2 * len(segs) + 1, dtype=np.int64)
            k_lens[0::2] = gaps
            k_lens[1::2] = prefix
            halves.append(
                (_cumsum0(q_lens), _cumsum0(k_lens), int(q_lens.max()), int(k_lens.max()))
            )
        (cq_h, ck_h, mq_h, mk_h), (cq_t, ck_t, mq_t, mk_t) = halves
        whole_lens = self.seg_len[whole]
        return LocalAttentionSpec(
            n_head_tokens=int(self.slot_tokens[rank]),
            n_gather_tokens=int(self.gather_lens[rank]),
            cu_seqlens_q=(cq_h, cq_t),
            cu_seqlens_k=(ck_h, ck_t),
            max_seqlen_q=(mq_h, mq_t),
            max_seqlen_k=(mk_h, mk_t),
            cu_seqlens_whole=_cumsum0(whole_lens),
            max_seqlen_whole=int(whole_lens.max()) if len(whole_lens) else 0,
        )

    # ------------------------------------------------------------------------------ statistics
    def rank_attention_pairs(self) -> np.ndarray:
        """``[c]`` causal (query, key) pairs each rank computes: proportional to attention FLOPs."""
        pairs = causal_pairs(self.seg_len, self.seg_start + self.seg_len)
        owner = self.slot_owner()[self.seg_slot]
        return np.bincount(owner, weights=pairs, minlength=self.cp_degree)

    def flops_imbalance(self) -> float:
        """max / mean of the per-rank attention FLOPs (1.0 is perfect balance)."""
        pairs = self.rank_attention_pairs()
        mean = pairs.mean()
        return float(pairs.max() / mean) if mean > 0 else 1.0

    def token_imbalance(self) -> float:
        """max / mean of the per-rank token counts (linear layers' work; 1.0 is perfect)."""
        return float(self.local_lens.max() / self.local_lens.mean())

    def small_chunks(self, tile: int = ATTENTION_TILE) -> int:
        """Number of non-empty chunks shorter than ``tile`` cut out of a document: segments that
        are a proper piece of their document (a document kept whole, or lying inside one slot,
        is not counted)."""
        lens = self.seg_len
        cut = (lens > 0) & (lens < tile) & (lens < self.doc_lens[self.seg_doc])
        return int(np.count_nonzero(cut))

    def kv_gather_bytes(self, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
        """Bytes of K and V each rank receives in the CP op's forward all-gather.

        The collective is padded to ``max_gather_len`` rows per rank, so every rank receives the
        same amount: ``(c - 1) * max_gather_len`` rows of K and V, each
        ``kv_heads * head_dim * dtype_bytes`` bytes. The backward's re-gather and its dK/dV
        reduce-scatter each move the same amount again. Per-sequence and per-document sharding
        gather the whole micro-batch; hybrid gathers the split documents only (0 when none).
        """
        row = 2 * int(kv_heads) * int(head_dim) * int(dtype_bytes)
        return (self.cp_degree - 1) * self.max_gather_len * row


_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """A read-only ``arange(n)`` view of a cached array.

    Why: building the index arrays needs ``arange(T)`` next to the output, and two fresh
    megabyte-sized allocations per call cost more in page faults (~1 ms at T = 128K) than the
    arithmetic itself; reusing one cached ramp keeps plan construction well under a millisecond.
    """
    global _ARANGE
    if _ARANGE.size < n:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.size), dtype=np.int64)
        _ARANGE.flags.writeable = False
    return _ARANGE[:n]


def _cumsum0(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


# ----------------------------------------------------------------------------------- building
@dataclass(frozen=True)
class ShardingDraft:
    """One fixed strategy's segments of a micro-batch, before the local layout is built.

    What a cost estimate needs (each segment's query length and the keys it sees), and what
    :meth:`plan` finishes without recomputing: adaptive selection drafts the candidate strategies
    and builds the layout of the winner only.

    Attributes:
        strategy: ``"per_sequence"``, ``"per_document"`` or ``"hybrid"``.
        doc_lens: validated int64 document lengths.
        doc_cu: ``[n_docs + 1]`` document start offsets.
        cp_degree: CP ranks ``c``.
        table: the strategy's raw segment table (per-document: the ``[n_docs, 2c]`` chunk sizes
            and starts; per-sequence: the segment arrays, slot-major; hybrid: the segment arrays,
            document-major, then ``doc_gathered``).
        max_len: hybrid's whole-document threshold (0 for the other strategies).
    """

    strategy: str
    doc_lens: np.ndarray
    doc_cu: np.ndarray
    cp_degree: int
    table: tuple[np.ndarray, ...] = field(repr=False)
    max_len: int = 0

    @property
    def q_len(self) -> np.ndarray:
        """Queries of every segment: ``[n_docs, 2c]`` (column = slot) per-document, else ``[S]``."""
        return self.table[0] if self.strategy == "per_document" else self.table[2]

    @property
    def kv_len(self) -> np.ndarray:
        """Keys every segment sees (its document's prefix up to its end); shaped as ``q_len``."""
        if self.strategy == "per_document":
            sizes, starts = self.table
            return starts + sizes
        return self.table[1] + self.table[2]

    @property
    def doc_gathered(self) -> np.ndarray:
        """``[n_docs]`` bool: documents whose K/V the CP op all-gathers (see ``CPPlan``)."""
        if self.strategy == "hybrid":
            return self.table[6]
        return np.ones(len(self.doc_lens), dtype=bool)

    def rank_totals(self, per_segment: np.ndarray) -> np.ndarray:
        """``[c]`` sums of a per-segment quantity (shaped as ``q_len``) over each rank's head and
        tail slot."""
        c = self.cp_degree
        if self.strategy == "per_document":
            slot = per_segment.sum(axis=0)  # [n_docs, 2c] -> per slot, no per-segment slot array
        else:
            slot = np.bincount(self.table[3], weights=per_segment, minlength=2 * c)
        return slot[:c] + slot[::-1][:c]

    def kv_gather_bytes(self, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
        """:meth:`CPPlan.kv_gather_bytes` of the plan this draft becomes, without building it
        (what a cost estimate of the gather needs)."""
        q_len = self.q_len
        if self.strategy == "hybrid":
            q_len = np.where(self.table[6][self.table[0]], q_len, 0)
        rows = int(self.rank_totals(q_len).max())
        return (self.cp_degree - 1) * rows * 2 * int(kv_heads) * int(head_dim) * int(dtype_bytes)

    def plan(self, requested: str | None = None) -> CPPlan:
        """The full plan; ``requested`` (default: the strategy itself) is recorded in it."""
        requested = self.strategy if requested is None else requested
        lens, cu, c = self.doc_lens, self.doc_cu, self.cp_degree
        if self.strategy == "per_document":
            return _finish(lens, cu, c, self.strategy, requested, *_per_document_table(*self.table))
        if self.strategy == "hybrid":
            *raw, gathered = self.table
            return _finish(
                lens, cu, c, self.strategy, requested, *raw,
                doc_gathered=gathered, max_len=self.max_len,
            )  # fmt: skip
        return _finish(lens, cu, c, self.strategy, requested, *self.table)


def draft_sharding(
    lens: np.ndarray, cp_degree: int, strategy: str, *, max_len: int = 0
) -> ShardingDraft:
    """The segments of ``strategy`` (``"per_sequence" | "per_document" | "hybrid"``) for lengths
    checked by :func:`validate_doc_lens`; ``draft_sharding(...).plan()`` is the plan.

    ``max_len`` is hybrid's whole-document threshold: documents of at most ``max_len`` tokens stay
    whole on one rank; 0 derives it per micro-batch (:func:`auto_hybrid_max_len`, never below
    :func:`default_hybrid_max_len` = ``2 * cp_degree * 128``). Ignored by the other strategies. Choosing among strategies is ``torchtitan_wlb.cp.adaptive.build_cp_plan``.
    """
    if strategy not in FIXED_STRATEGIES:
        raise ValueError(
            f"fixed CP strategy {strategy!r} is not one of {FIXED_STRATEGIES} (adaptive selection "
            "is torchtitan_wlb.cp.adaptive.build_cp_plan)"
        )
    doc_cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=doc_cu[1:])
    if strategy == "per_document":
        table = _per_document_chunks(lens, cp_degree)
    elif strategy == "hybrid":
        table, max_len = _hybrid(lens, cp_degree, _check_max_len(max_len))
        return ShardingDraft(strategy, lens, doc_cu, cp_degree, table, max_len)
    else:
        table = _per_sequence(lens, doc_cu, cp_degree)
    return ShardingDraft(strategy, lens, doc_cu, cp_degree, table)


def _check_max_len(max_len: Any) -> int:
    if isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < 0:
        raise ValueError(
            f"hybrid max_len must be an int >= 0 (0: 2 * cp_degree * {ATTENTION_TILE}); "
            f"got {max_len!r}"
        )
    return int(max_len)


def validate_doc_lens(doc_lens: Any, cp_degree: Any, seq_len: int | None = None) -> np.ndarray:
    """``doc_lens`` as int64 after checking it against ``cp_degree`` (and ``seq_len`` if given);
    a ``ValueError`` names the offending value."""
    lens = np.asarray(doc_lens)
    if lens.ndim != 1 or lens.size == 0 or not np.issubdtype(lens.dtype, np.integer):
        raise ValueError(
            f"doc_lens must be a non-empty 1-D integer array; got shape {lens.shape}, "
            f"dtype {lens.dtype}"
        )
    lens = lens.astype(np.int64, copy=False)
    if lens.min() < 1:
        bad = int(np.flatnonzero(lens < 1)[0])
        raise ValueError(f"doc_lens must all be >= 1; doc_lens[{bad}] = {int(lens[bad])}")
    total = int(lens.sum())
    if seq_len is not None and total != seq_len:
        raise ValueError(f"doc_lens sum to {total}, but the sequence has {seq_len} tokens")
    if isinstance(cp_degree, bool) or not isinstance(cp_degree, int | np.integer):
        raise ValueError(f"cp_degree must be an int; got {cp_degree!r}")
    if not 1 <= cp_degree <= total:
        raise ValueError(
            f"cp_degree must be in [1, {total}] (the sequence length, so that every rank holds a "
            f"token); got {cp_degree}"
        )
    return lens


def _per_document_chunks(lens: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """``[n_docs, 2c]`` chunk sizes and chunk starts (inside each document) of per-document
    sharding."""
    two_c = 2 * c
    base, rem = np.divmod(lens, two_c)
    # Remainder dealing with a counter carried across documents: document i starts where i-1 ended.
    first_slot = (np.cumsum(rem) - rem) % two_c
    slots = np.arange(two_c)
    # Slot j gets an extra token iff (j - first_slot) mod 2c < rem, i.e. j falls in the
    # (possibly wrapping) window [first_slot, first_slot + rem); comparisons avoid a modulo.
    end_slot = (first_slot + rem)[:, None]
    first = first_slot[:, None]
    extra = ((slots >= first) & (slots < end_slot)) | (slots + two_c < end_slot)
    sizes = extra.astype(np.int64)
    sizes += base[:, None]
    starts = np.cumsum(sizes, axis=1)
    starts -= sizes
    return sizes, starts


def _per_document_table(sizes: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, ...]:
    """Segment table of per-document sharding, document-major (= global order), plus its layout
    (slot tokens and local offsets, computed on the [n_docs, 2c] matrix)."""
    n, two_c = sizes.shape
    c = two_c // 2
    seg_doc = np.repeat(np.arange(n, dtype=np.int64), two_c)
    seg_slot = np.tile(np.arange(two_c, dtype=np.int64), n)
    slot_order = np.arange(n * two_c, dtype=np.int64).reshape(n, two_c).T.ravel()
    slot_offsets = np.arange(two_c + 1, dtype=np.int64) * n
    # Offset inside the slot = tokens of earlier documents in the same slot; a tail slot (j >= c)
    # follows its rank's head slot 2c-1-j in the local layout.
    local_offset = np.cumsum(sizes, axis=0)
    slot_tokens = local_offset[-1].copy()
    local_offset -= sizes
    local_offset[:, c:] += slot_tokens[:c][::-1]
    layout = (slot_tokens, local_offset.ravel())
    return seg_doc, starts.ravel(), sizes.ravel(), seg_slot, slot_order, slot_offsets, layout


def _per_sequence(lens: np.ndarray, doc_cu: np.ndarray, c: int) -> tuple[np.ndarray, ...]:
    """Segment table of per-sequence (head-tail) sharding, slot-major (= global order)."""
    two_c = 2 * c
    total = int(doc_cu[-1])
    base, rem = divmod(total, two_c)
    bounds = np.zeros(two_c + 1, dtype=np.int64)
    np.cumsum(base + (np.arange(two_c) < rem), out=bounds[1:])
    nonempty = bounds[1:] > bounds[:-1]
    first = np.searchsorted(doc_cu, bounds[:-1], side="right") - 1
    last = np.searchsorted(doc_cu, bounds[1:] - 1, side="right") - 1
    counts = np.where(nonempty, last - first + 1, 0)
    slot_offsets = np.zeros(two_c + 1, dtype=np.int64)
    np.cumsum(counts, out=slot_offsets[1:])
    n_seg = int(slot_offsets[-1])
    seg_slot = np.repeat(np.arange(two_c, dtype=np.int64), counts)
    seg_doc = np.repeat(first, counts) + np.arange(n_seg) - np.repeat(slot_offsets[:-1], counts)
    g_start = np.maximum(bounds[seg_slot], doc_cu[seg_doc])
    g_end = np.minimum(bounds[seg_slot + 1], doc_cu[seg_doc + 1])
    seg_start = g_start - doc_cu[seg_doc]
    slot_order = np.arange(n_seg, dtype=np.int64)
    return seg_doc, seg_start, g_end - g_start, seg_slot, slot_order, slot_offsets


GREEDY_ROUNDS = 4
"""Rounds of ``c`` whole documents (the longest ``8c``) that :func:`_deal_whole` deals greedily."""
REFINE_PASSES = 4
"""Upper bound on the refinement passes of :func:`_refine` (each vectorised over two ranks)."""
REFINE_TOLERANCE = 1e-3
"""Refinement stops once the busiest rank is within this fraction of the mean."""
HYBRID_TOLERANCE = (1.01, 1.05)
"""(attention work, tokens) max/mean that the automatic threshold's plan must stay within."""


def _refine(lens: np.ndarray, rank: np.ndarray, weight: np.ndarray, c: int) -> np.ndarray:
    """``rank`` (one whole-document assignment) after at most :data:`REFINE_PASSES` passes, each
    applying the single move or swap of documents between the ranks with the most and the least
    ``weight`` (tokens, or attention work) that lowers the larger of the two the most (for every
    document of the busier rank, the partner closest to half the gap is found by binary search).
    A pass never empties a rank. Returns ``rank`` itself when nothing moved."""
    original, rank, moved = rank, rank.copy(), False
    load = np.bincount(rank, weights=weight, minlength=c)
    tokens = np.bincount(rank, weights=lens, minlength=c)
    limit = load.sum() / c * (1.0 + REFINE_TOLERANCE)  # moves keep the total
    for _ in range(REFINE_PASSES):
        hi, lo = int(load.argmax()), int(load.argmin())
        gap = load[hi] - load[lo]
        if load[hi] <= limit:
            break
        on_hi = (rank == hi).nonzero()[0]
        on_lo = (rank == lo).nonzero()[0]
        # Partner -1 = a plain move (moves nothing back); others: swaps.
        partner = np.concatenate(([-1], on_lo[weight[on_lo].argsort(kind="stable")]))
        back = weight[partner]
        back[0] = 0.0
        j = back.searchsorted(weight[on_hi] - gap / 2)
        cand_a = np.concatenate([on_hi, on_hi])
        cand_j = np.concatenate([np.maximum(j - 1, 0), np.minimum(j, len(back) - 1)])
        delta = weight[cand_a] - back[cand_j]  # weight leaving hi for lo
        new_max = np.maximum(load[hi] - delta, load[lo] + delta)
        moved_tokens = lens[cand_a] - np.where(cand_j > 0, lens[partner[cand_j]], 0)
        valid = (delta > 0) & (new_max < load[hi]) & (tokens[hi] - moved_tokens > 0)
        if not valid.any():
            break
        best = int(np.where(valid, new_max, np.inf).argmin())
        a, b = int(cand_a[best]), int(partner[cand_j[best]])
        rank[a], moved = lo, True
        if b >= 0:
            rank[b] = hi
        load[hi] -= delta[best]
        load[lo] += delta[best]
        tokens[hi] -= moved_tokens[best]
        tokens[lo] += moved_tokens[best]
    return rank if moved else original


def _deal_whole(
    desc: np.ndarray, pairs: np.ndarray, first: np.ndarray, c: int
) -> tuple[np.ndarray, ...]:
    """``[K, n]`` CP rank of every document of ``desc`` (lengths, longest first; ``pairs`` their
    attention work) under ``K`` thresholds at once, threshold ``k`` keeping ``desc[first[k]:]``
    whole (rank ``-1``: split), and each rank's whole tokens and attention work ``[K, c]``.

    Balances whole tokens per rank, on which the gathered K/V depend (every rank gathers as many
    rows as the rank with the fewest whole tokens): for :data:`GREEDY_ROUNDS` rounds the next ``c``
    documents, longest first, go to the ranks in order of their tokens so far (the longest to the
    emptiest; the first two rounds are a serpentine); the shorter rest fills each rank's deficit
    below the mean, cut at cumulative lengths. Attention work is left to the split documents'
    chunk sizes (:func:`_balance`).
    """
    n, k, rounds = len(desc), len(first), GREEDY_ROUNDS
    rows = np.arange(k)[:, None]
    greedy = first[:, None] + np.arange(rounds * c)
    sizes = np.append(desc, np.zeros(rounds * c, dtype=desc.dtype))[greedy].reshape(k, rounds, c)
    ranks = np.empty((k, rounds, c), dtype=np.int64)
    ranks[:, 0], ranks[:, 1] = np.arange(c), np.arange(c)[::-1]
    load = sizes[:, 0] + sizes[:, 1, ::-1]
    for rnd in range(2, rounds):  # bounded, each round vectorised over the thresholds
        ranks[:, rnd] = np.argsort(load, axis=1, kind="stable")
        load[rows, ranks[:, rnd]] += sizes[:, rnd]
    rank = np.full((k, n + rounds * c), -1, dtype=np.int64)
    rank[rows, greedy] = ranks.reshape(k, -1)
    # The rest in serpentine order (rounds of c, every other one reversed, read position-major):
    # any run of it mixes long and short documents, so a run balances work along with tokens.
    serp = np.arange(-(-n // c) * c).reshape(-1, c)
    serp[1::2] = serp[1::2, ::-1]
    idx = greedy[:, -1:] + 1 + serp.T.ravel()
    valid = idx < n
    sizes = np.where(valid, desc[np.minimum(idx, n - 1)], 0)
    rest_total = sizes.sum(axis=1, keepdims=True)
    deficit = np.maximum((load.sum(axis=1, keepdims=True) + rest_total) / c - load, 0.0)
    bounds = np.cumsum(deficit, axis=1)
    bounds *= rest_total / np.maximum(bounds[:, -1:], 1e-9)
    offset = rows * (float(desc.sum()) + 1.0)  # one searchsorted for all thresholds
    mid = np.cumsum(sizes, axis=1) - sizes / 2 + offset
    at = np.nonzero(valid)[0]
    hit = np.searchsorted((bounds + offset).ravel(), mid[valid]) - at * c
    rank[at, idx[valid]] = np.minimum(hit, c - 1)
    rank = rank[:, :n]
    bins = np.where(rank >= 0, rank + rows * c, k * c).ravel()
    w, q = (np.bincount(bins, np.tile(x, k), k * c + 1)[:-1].reshape(k, c) for x in (desc, pairs))
    return rank, w, q


def _balance(
    w: np.ndarray, q: np.ndarray, s: np.ndarray, quad: np.ndarray, c: int
) -> tuple[np.ndarray, ...]:
    """The split documents' common chunk boundaries ``[K, 2c + 1]`` (fractions of a document) for
    ``K`` placements (``w``, ``q``: ``[K, c]`` whole tokens and work per rank; ``s``, ``quad``:
    ``[K, 1]`` split tokens and sum of squared split lengths), and, predicted before rounding to
    tokens, ``[K]`` max/mean of attention work, max/mean of tokens, most gathered rows on a rank.

    The chunks give every rank the tokens and the attention work its whole documents lack. With
    rank ``r``'s token share ``a_r`` and quadratic work share ``b_r`` (of ``d**2``), and ``A_r``,
    ``B_r`` their sums over the ranks before it, the end of the heads before rank ``r`` is::

        X_r = ((1 - 2 B_r) / (1 - A_r) - (1 - A_r)) / 2,   and its tail ends at X_r + 1 - A_r

    (heads fill ``[0, X_r]`` and tails ``[X_r + 1 - A_r, 1]``, whose quadratic work is
    ``(X_r**2 + 1 - (X_r + 1 - A_r)**2) / 2 = B_r``). Where a target is out of reach (a negative
    chunk), the boundaries go from the even cut (head = tail = ``a_r / 2``) towards the exact
    ones as far as every chunk stays non-negative.
    """
    a = np.maximum((w.sum(axis=1, keepdims=True) + s) / c - w, 0.0)
    a /= np.maximum(a.sum(axis=1, keepdims=True), 1e-12)
    b = ((q.sum(axis=1, keepdims=True) + (quad + s) / 2) / c - q - s * a / 2) / np.maximum(quad, 1)
    before = a.cumsum(axis=1) - a
    rest = np.maximum(1.0 - before, 1e-12)
    # Shift of rank r's head start from the even cut's; its tail end moves by the same amount.
    shift = ((1.0 - 2.0 * (b.cumsum(axis=1) - b)) / rest - rest - before) / 2.0
    step = np.abs(np.diff(shift, axis=1, append=shift[:, -1:]))  # head grows, tail shrinks
    reach = np.where(step > 0, a / (2 * step + 1e-300), 1.0).min(axis=1, keepdims=True)
    x = before / 2 + np.where(s > 0, np.minimum(reach, 1.0), 0.0) * shift
    y = x + rest
    cum = np.concatenate([x, x[:, -1:] + rest[:, -1:] / 2, y[:, ::-1]], axis=1)
    quad_share = np.diff((x * x - y * y) / 2, axis=1, append=0.0)  # (x**2 + 1 - y**2) / 2 = B
    gathered = s * a
    work = q + quad * quad_share + gathered / 2
    tokens = w + gathered
    return cum, _max_mean(work), _max_mean(tokens), gathered.max(axis=1)


def _max_mean(x: np.ndarray) -> np.ndarray:
    return x.max(axis=1) * x.shape[1] / x.sum(axis=1)


def _candidates(desc: np.ndarray, c: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(thresholds, first)``: hybrid's thresholds to evaluate and how many of the documents
    ``desc`` (longest first) each one splits. ``max_len > 0``: that one; 0: every distinct length
    from :func:`default_hybrid_max_len` up to ``T / c``, then the floor itself (the fallback).

    Where fewer than ``c`` documents stay whole and the split ones hold fewer than ``c`` tokens,
    the longest whole ones are split too until they do, so that every rank holds a token."""
    if max_len:
        thresholds = np.array([max_len])
    else:
        distinct = desc > np.append(desc[1:], 0)  # a threshold keeps all of its length whole
        floor = default_hybrid_max_len(c)
        keep = distinct & (desc > floor) & (desc * c <= desc.sum())
        thresholds = np.append(desc[keep], floor)
    first = np.searchsorted(-desc, -thresholds, side="left")  # documents above each threshold
    cum = np.cumsum(desc)
    split_tokens = np.where(first > 0, cum[first - 1], 0)
    few = (len(desc) - first < c) & (split_tokens < c) & (c > 1)
    first = np.where(few, np.searchsorted(cum, c) + 1, first)
    return thresholds, first


def _hybrid(lens: np.ndarray, c: int, max_len: int) -> tuple[tuple[np.ndarray, ...], int]:
    """Segment table of hybrid sharding (document-major = global order, then ``doc_gathered``)
    and the threshold used (``max_len``, or the automatic one for 0).

    Automatic threshold: every candidate of :func:`_candidates` is evaluated at once (one deal of
    its whole documents, :func:`_deal_whole`, and the closed-form chunk sizes of its split ones,
    :func:`_balance`); the one predicted within :data:`HYBRID_TOLERANCE` that gathers the fewest
    K/V rows wins (ties: the higher threshold). Why search rather than a rule: more documents
    whole means less K/V but a harder balance, and where that trade lands depends on the
    micro-batch's lengths. The winner's deal is then refined (:func:`_refine`, on tokens, or on
    attention work when nothing is split) if that balances better. With no whole document the
    chunks are exactly per-document sharding's.
    """
    two_c, n = 2 * c, len(lens)
    order = np.argsort(-lens, kind="stable")
    desc = lens[order]
    thresholds, first = _candidates(desc, c, max_len)
    pick = 0
    if c > 1 and first.min() < n:
        pairs = causal_pairs(desc, desc)
        dealt, w, q = _deal_whole(desc, pairs, first, c)
        d = np.append(0.0, desc.astype(np.float64))
        s, quad = np.cumsum(d)[first][:, None], np.cumsum(d * d)[first][:, None]
        stats = _balance(w, q, s, quad, c)
        pick = int(np.lexsort((-thresholds, stats[3], ~_balanced(stats)))[0])
    n_split = int(first[pick])
    split = np.zeros(n, dtype=bool)
    split[order[:n_split]] = True
    split_docs, whole_docs = np.flatnonzero(split), order[n_split:]
    split_lens, whole_lens = lens[split_docs], lens[whole_docs]
    whole_rank = np.zeros(len(whole_docs), dtype=np.int64)
    sizes = None
    if c > 1 and len(whole_docs):
        whole_rank, whole_pairs = dealt[pick, n_split:], pairs[n_split:]
        cum = stats[0][pick]
        refined = _refine(whole_lens, whole_rank, whole_lens if n_split else whole_pairs, c)
        if refined is not whole_rank:  # keep the refinement if it balances better
            w = np.bincount(refined, weights=whole_lens, minlength=c)[None]
            q = np.bincount(refined, weights=whole_pairs, minlength=c)[None]
            here = slice(pick, pick + 1)
            again = _balance(w, q, s[here], quad[here], c)
            rank_key = [
                (not _balanced(x)[i], x[3][i], x[1][i]) for x, i in ((again, 0), (stats, pick))
            ]
            if rank_key[0] <= rank_key[1]:
                whole_rank, cum = refined, again[0][0]
        if n_split:
            bounds = np.floor(split_lens[:, None] * cum + 0.5).astype(np.int64)
            sizes, starts = np.diff(bounds, axis=1), bounds[:, :-1]
            held = np.bincount(whole_rank, weights=whole_lens, minlength=c)
            if not np.all(held + _rank_sums(sizes.sum(axis=0), c) > 0):  # a rank left empty
                sizes = None
    if sizes is None:
        sizes, starts = _per_document_chunks(split_lens, c)
    # One segment per whole document, 2c per split document, in document order.
    per_doc = np.where(split, two_c, 1)
    seg_cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(per_doc, out=seg_cu[1:])
    n_seg = int(seg_cu[-1])
    seg_doc = np.repeat(np.arange(n, dtype=np.int64), per_doc)
    seg_slot = np.empty(n_seg, dtype=np.int64)
    seg_start = np.zeros(n_seg, dtype=np.int64)
    seg_len = np.empty(n_seg, dtype=np.int64)
    chunk = (seg_cu[split_docs][:, None] + np.arange(two_c)).ravel()
    seg_slot[chunk] = np.tile(np.arange(two_c, dtype=np.int64), len(split_docs))
    seg_start[chunk] = starts.ravel()
    seg_len[chunk] = sizes.ravel()
    first_seg = seg_cu[whole_docs]
    seg_slot[first_seg] = two_c - 1 - whole_rank  # a whole document sits in its rank's tail slot
    seg_len[first_seg] = whole_lens
    # Slot order: by slot, a slot's split chunks before its whole documents, then document order
    # (a stable sort on a small integer key).
    key = seg_slot * 2
    key[first_seg] += 1
    small = np.int16 if 4 * c < np.iinfo(np.int16).max else np.int32  # int16: a radix sort
    slot_order = np.argsort(key.astype(small), kind="stable")
    slot_offsets = np.zeros(two_c + 1, dtype=np.int64)
    np.cumsum(np.bincount(seg_slot, minlength=two_c), out=slot_offsets[1:])
    table = (seg_doc, seg_start, seg_len, seg_slot, slot_order, slot_offsets, split)
    return table, int(thresholds[pick])


def _balanced(stats: tuple[np.ndarray, ...]) -> np.ndarray:
    """Whether :func:`_balance`'s predicted work and token max/mean are within tolerance."""
    return (stats[1] <= HYBRID_TOLERANCE[0]) & (stats[2] <= HYBRID_TOLERANCE[1])


def auto_hybrid_max_len(lens: np.ndarray, cp_degree: int) -> int:
    """Hybrid's automatic whole-document threshold for one micro-batch (``max_len = 0``, see
    :func:`_hybrid`): never below :func:`default_hybrid_max_len`."""
    return _hybrid(np.asarray(lens, dtype=np.int64), int(cp_degree), 0)[1]


def _rank_sums(per_slot: np.ndarray, c: int) -> np.ndarray:
    """``[c]`` head slot + tail slot of a ``[2c]`` per-slot quantity."""
    return per_slot[:c] + per_slot[::-1][:c]


def _finish(
    lens: np.ndarray,
    doc_cu: np.ndarray,
    c: int,
    strategy: str,
    requested: str,
    seg_doc: np.ndarray,
    seg_start: np.ndarray,
    seg_len: np.ndarray,
    seg_slot: np.ndarray,
    slot_order: np.ndarray,
    slot_offsets: np.ndarray,
    layout: tuple[np.ndarray, np.ndarray] | None = None,
    *,
    doc_gathered: np.ndarray | None = None,
    max_len: int = 0,
) -> CPPlan:
    """Slot sizes, rank lengths and each segment's offset inside its rank's local layout.

    ``layout`` = (slot_tokens, seg_local_offset) when the caller computed them more cheaply
    (per-document sharding does, from its [n_docs, 2c] matrix). ``doc_gathered`` (hybrid) marks
    the documents whose K/V are gathered; ``None``: all of them."""
    two_c = 2 * c
    if layout is None:
        sorted_lens = seg_len[slot_order]
        cum = np.zeros(len(sorted_lens) + 1, dtype=np.int64)
        np.cumsum(sorted_lens, out=cum[1:])
        slot_tokens = cum[slot_offsets[1:]] - cum[slot_offsets[:-1]]
        # Head slots start a rank's layout; a tail slot follows its rank's head slot (2c-1-j).
        slot_base = np.where(np.arange(two_c) < c, 0, slot_tokens[::-1])
        sorted_slot = np.repeat(np.arange(two_c, dtype=np.int64), np.diff(slot_offsets))
        local_offset = np.empty(len(seg_len), dtype=np.int64)
        local_offset[slot_order] = (
            cum[:-1] - cum[slot_offsets[sorted_slot]] + slot_base[sorted_slot]
        )
    else:
        slot_tokens, local_offset = layout
    local_lens = slot_tokens[:c] + slot_tokens[::-1][:c]
    if doc_gathered is None:
        doc_gathered = np.ones(len(lens), dtype=bool)
        gather_lens = local_lens
    else:
        whole = ~doc_gathered[seg_doc]
        owner = np.minimum(seg_slot[whole], two_c - 1 - seg_slot[whole])
        whole_tokens = np.bincount(owner, weights=seg_len[whole], minlength=c)
        gather_lens = local_lens - whole_tokens.astype(np.int64)
    return CPPlan(
        doc_lens=lens,
        doc_cu=doc_cu,
        cp_degree=c,
        strategy=strategy,
        requested=requested,
        seg_doc=seg_doc,
        seg_start=seg_start,
        seg_len=seg_len,
        seg_slot=seg_slot,
        slot_order=slot_order,
        slot_offsets=slot_offsets,
        slot_tokens=slot_tokens,
        local_lens=local_lens,
        seg_local_offset=local_offset,
        doc_gathered=doc_gathered,
        gather_lens=gather_lens,
        max_len=max_len,
    )
