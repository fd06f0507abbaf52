"""Context-parallel sharding plans for one packed micro-batch (pure NumPy, no torch).

With CP degree ``c`` a micro-batch is cut into ``2c`` chunk *slots*; rank ``r`` keeps slot ``r``
(head) and slot ``2c - 1 - r`` (tail), pairing a cheap slot with an expensive one under causal
attention. A *segment* is the part of one document inside one slot. Strategies, padding and the
local layout: docs/context_parallel.md. Construction is vectorised: no Python loop over documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

FIXED_STRATEGIES = ("per_sequence", "per_document", "hybrid")

ATTENTION_TILE = 128
"""Query/key tile of the varlen attention kernels (flash-attn's 128-row blocks): a chunk shorter than
this runs a mostly padded tile."""


def default_hybrid_max_len(cp_degree: int) -> int:
    """Hybrid's floor for the whole-document threshold: ``2 * cp_degree * ATTENTION_TILE``, the
    length below which a per-document chunk (``d // 2c``) would be shorter than one tile."""
    return 2 * int(cp_degree) * ATTENTION_TILE


def causal_pairs(q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
    """(query, key) pairs a bottom-right causal segment computes: ``q*kv - q*(q-1)/2`` for q <= kv."""
    q = np.asarray(q_len, dtype=np.float64)
    kv = np.asarray(kv_len, dtype=np.float64)
    return q * kv - q * (q - 1.0) / 2.0


@dataclass(frozen=True)
class LocalAttentionSpec:
    """One rank's varlen calls: head and tail halves against the gathered keys (zero-query "gap"
    segments keep key segments contiguous), hybrid's whole documents against themselves.

    Each half sees only its key window, the gathered rows from its first segment's keys to its last
    one's: a kernel handed every gathered row would write zero dK/dV for all the rows no query of
    the half attends to and launch its backward over the longest key segment, a gap of up to the
    whole sequence (per-sequence sharding's halves each attend to about 1/2c of the keys)."""

    n_head_tokens: int  # local tokens of the head half (the tail half follows them)
    n_gather_tokens: int  # local tokens whose K/V are all-gathered (whole documents follow)
    cu_seqlens_q: tuple[np.ndarray, np.ndarray]  # (head, tail) int32, from each half's start
    cu_seqlens_k: tuple[np.ndarray, np.ndarray]  # (head, tail) int32, from each key window's start
    max_seqlen_q: tuple[int, int]  # longest query segment
    max_seqlen_k: tuple[int, int]  # longest key segment (gaps included)
    cu_seqlens_whole: np.ndarray  # int32 whole-document boundaries ([0] when the rank has none)
    max_seqlen_whole: int  # longest whole document (0 when none)
    # (head, tail) [start, end) gathered rows each half attends to ((0, 0): a half with no queries)
    key_window: tuple[tuple[int, int], tuple[int, int]]


@dataclass(frozen=True)
class CPPlan:
    """How one packed micro-batch is split over ``cp_degree`` ranks: a segment table listing every
    (document, slot) piece in global token order, and each rank's local layout. int64 arrays."""

    doc_lens: np.ndarray  # [n_docs] document lengths of the micro-batch
    doc_cu: np.ndarray  # [n_docs + 1] document start offsets in the packed sequence
    cp_degree: int  # CP ranks c
    strategy: str  # the sharding in effect: "per_sequence", "per_document" or "hybrid"
    requested: str  # the strategy asked for ("adaptive" resolves to a fixed one)
    seg_doc: np.ndarray  # [S] document of each segment
    seg_start: np.ndarray  # [S] first position of the segment inside its document
    seg_len: np.ndarray  # [S] tokens of the segment (0: a chunk of a document shorter than 2c)
    seg_slot: np.ndarray  # [S] slot 0 .. 2c-1 (a hybrid whole document: its rank's tail slot)
    slot_order: np.ndarray  # [S] segment ids by (slot, gathered before whole, document)
    slot_offsets: np.ndarray  # [2c + 1] range of slot_order holding each slot
    slot_tokens: np.ndarray  # [2c] tokens per slot
    local_lens: np.ndarray  # [c] tokens per rank (head slot + tail slot)
    seg_local_offset: np.ndarray  # [S] offset of each segment in its rank's local layout
    doc_gathered: np.ndarray  # [n_docs] bool: K/V all-gathered (not one of hybrid's whole ones)
    gather_lens: np.ndarray  # [c] local tokens of each rank whose K/V are gathered (a prefix)
    max_len: int = 0  # hybrid's whole-document threshold in tokens (0 for the other strategies)
    # {strategy: predicted max-rank latency} if adaptive selection ran
    estimated_seconds: dict[str, float] = field(default_factory=dict)

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
        """Rows per rank of the CP op's all-gather buffer (0: the op skips the collective)."""
        return int(self.gather_lens.max())

    @property
    def gathered_len(self) -> int:
        """Tokens whose K/V are gathered (the length of the key order of the two split halves)."""
        return int(self.gather_lens.sum())

    def slot_owner(self) -> np.ndarray:
        """``[2c]`` rank owning each slot."""
        slots = np.arange(2 * self.cp_degree)
        return np.minimum(slots, 2 * self.cp_degree - 1 - slots)

    def _rank_segments(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Segment ids of the head slot and of the tail slot of ``rank``, each in local order."""
        if not 0 <= rank < self.cp_degree:
            raise ValueError(f"rank {rank} is outside the CP group [0, {self.cp_degree})")
        off = self.slot_offsets
        tail = 2 * self.cp_degree - 1 - rank
        return (
            self.slot_order[off[rank] : off[rank + 1]],
            self.slot_order[off[tail] : off[tail + 1]],
        )

    def rank_indices(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``(token_indices, positions)`` of ``rank``: packed-sequence indices of the tokens it keeps,
        in local layout order, and their per-document (RoPE) positions."""
        segs = np.concatenate(self._rank_segments(rank))
        lens = self.seg_len[segs]
        positions = np.repeat(self.seg_start[segs] - self.seg_local_offset[segs], lens)
        positions += _arange(int(self.local_lens[rank]))
        tokens = np.repeat(self.doc_cu[self.seg_doc[segs]], lens)
        tokens += positions
        return tokens, positions

    def token_indices(self, rank: int) -> np.ndarray:
        return self.rank_indices(rank)[0]

    def positions(self, rank: int) -> np.ndarray:
        return self.rank_indices(rank)[1]

    @cached_property
    def _doc_key_start(self) -> np.ndarray:
        """``[n_docs]`` start of each gathered document in the gathered key order (cached)."""
        if self.gathered_len == self.seq_len:
            return self.doc_cu[:-1]
        gathered = np.where(self.doc_gathered, self.doc_lens, 0)
        return np.cumsum(gathered) - gathered

    def kv_order(self) -> np.ndarray:
        """``[gathered_len]`` all-gather buffer row (rank-major) of each gathered token, in gathered
        key order (the packed order, whole documents left out): indexing the buffer orders keys."""
        if self.gathered_len == self.seq_len:
            segs = slice(None)
        elif self.gathered_len == 0:
            return np.zeros(0, dtype=np.int64)
        else:
            segs = self.doc_gathered[self.seg_doc].nonzero()[0]
        seg_slot, seg_doc = self.seg_slot[segs], self.seg_doc[segs]
        seg_start, seg_len = self.seg_start[segs], self.seg_len[segs]
        owner = np.minimum(seg_slot, 2 * self.cp_degree - 1 - seg_slot)
        gathered = owner * self.max_gather_len + self.seg_local_offset[segs]
        key_start = self._doc_key_start[seg_doc] + seg_start
        order = np.repeat(gathered - key_start, seg_len)
        order += _arange(self.gathered_len)
        return order

    def local_attention_spec(self, rank: int) -> LocalAttentionSpec:
        """cu_seqlens of ``rank``'s varlen calls (head half, tail half, whole documents)."""
        head, tail = self._rank_segments(rank)
        n_tail_split = int(np.count_nonzero(self.doc_gathered[self.seg_doc[tail]]))
        whole = tail[n_tail_split:]  # whole documents follow the split ones
        # Both halves at once (head entries first): queries at odd entries, key gaps before them.
        segs = np.concatenate((head, tail[:n_tail_split]))
        nonempty = self.seg_len[segs] > 0
        n_head = int(np.count_nonzero(nonempty[: len(head)]))
        segs = segs[nonempty]
        q_len = self.seg_len[segs]
        end = self.seg_start[segs] + q_len  # keys a segment sees: its document's prefix
        k_start = self._doc_key_start[self.seg_doc[segs]]
        m, cut = 2 * len(segs) + 2, 2 * n_head + 1
        pos = np.arange(1, m - 1, 2)
        pos[n_head:] += 1
        lens = np.zeros((2, m), dtype=np.int64)  # (query lengths, key lengths with gaps)
        lens[0, pos], lens[1, pos] = q_len, end
        lens[1, pos - 1] = k_start
        lens[1, cut - 1] = lens[1, m - 1] = self.gathered_len
        lens[1, pos + 1] -= end + k_start  # gaps: up to the next start, or to the end
        cum = np.zeros((2, m + 1), dtype=np.int32)
        lens.cumsum(axis=1, out=cum[:, 1:])
        (cq_h, ck_h), (cq_t, ck_t) = cum[:, : cut + 1], cum[:, cut:] - cum[:, cut : cut + 1]
        window = (_key_window(ck_h, n_head), _key_window(ck_t, len(segs) - n_head))
        # The leading and trailing gaps fall outside the window: zero-length entries.
        (a_h, b_h), (a_t, b_t) = window
        ck_h, ck_t = np.clip(ck_h - a_h, 0, b_h - a_h), np.clip(ck_t - a_t, 0, b_t - a_t)
        (mq_h, mq_t) = np.maximum.reduceat(lens[0], [0, cut]).tolist()
        (mk_h, mk_t) = (int(np.diff(ck).max()) for ck in (ck_h, ck_t))
        whole_lens = self.seg_len[whole]
        cu_whole = np.zeros(len(whole_lens) + 1, dtype=np.int32)
        whole_lens.cumsum(out=cu_whole[1:])
        return LocalAttentionSpec(
            int(self.slot_tokens[rank]),
            int(self.gather_lens[rank]),
            (cq_h, cq_t),
            (ck_h, ck_t),
            (mq_h, mq_t),
            (mk_h, mk_t),
            cu_whole,
            int(whole_lens.max(initial=0)),
            window,
        )

    def rank_totals(self, per_segment: np.ndarray) -> np.ndarray:
        """``[c]`` sums of a ``[S]`` per-segment quantity over each rank's segments."""
        owner = self.slot_owner()[self.seg_slot]
        return np.bincount(owner, weights=per_segment, minlength=self.cp_degree)

    def rank_attention_pairs(self) -> np.ndarray:
        """``[c]`` causal (query, key) pairs each rank computes: proportional to attention FLOPs."""
        return self.rank_totals(causal_pairs(self.seg_len, self.seg_start + self.seg_len))

    def flops_imbalance(self) -> float:
        """max / mean of the per-rank attention FLOPs (1.0 is perfect balance)."""
        pairs = self.rank_attention_pairs()
        mean = pairs.mean()
        return float(pairs.max() / mean) if mean > 0 else 1.0

    def token_imbalance(self) -> float:
        """max / mean of the per-rank token counts (linear layers' work; 1.0 is perfect)."""
        return float(self.local_lens.max() / self.local_lens.mean())

    def small_chunks(self, tile: int = ATTENTION_TILE) -> int:
        """Non-empty segments shorter than ``tile`` that are a proper piece of their document (a
        document kept whole, or lying inside one slot, does not count)."""
        lens = self.seg_len
        cut = (lens > 0) & (lens < tile) & (lens < self.doc_lens[self.seg_doc])
        return int(np.count_nonzero(cut))

    def kv_gather_bytes(self, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
        """K/V bytes each rank receives in the op's forward all-gather (``(c - 1) * max_gather_len``
        rows); the backward's re-gather and dK/dV reduce-scatter move as much again."""
        row = 2 * int(kv_heads) * int(head_dim) * int(dtype_bytes)
        return (self.cp_degree - 1) * self.max_gather_len * row


def _key_window(cu_k: np.ndarray, n_segments: int) -> tuple[int, int]:
    """A half's ``[start, end)`` gathered rows from its ``cu_k`` over all gathered rows (a leading
    gap, then query segments and the gaps between them, then a trailing gap): from its first
    segment's first key to its last segment's last; ``(0, 0)`` when the half has no segment."""
    if n_segments == 0:
        return (0, 0)
    return (int(cu_k[1]), int(cu_k[-2]))


_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """A read-only ``arange(n)`` view of a cached array: fresh megabyte-sized ramps per call cost
    more in page faults (~1 ms at T = 128K) than the index arithmetic itself."""
    global _ARANGE
    if _ARANGE.size < n:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.size), dtype=np.int64)
        _ARANGE.flags.writeable = False
    return _ARANGE[:n]


@dataclass(frozen=True)
class ShardingDraft:
    """One fixed strategy's segments without the local layout (what a cost estimate needs: adaptive
    selection lays out the winner only). ``table``: per-document, ``[n_docs, 2c]`` chunk sizes and
    starts; else :class:`CPPlan`'s segment arrays (hybrid: document-major, then doc_gathered)."""

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
        return self.table[1] + self.q_len  # starts (both layouts) + queries

    @property
    def doc_gathered(self) -> np.ndarray:
        """``[n_docs]`` bool: documents whose K/V the CP op all-gathers (see ``CPPlan``)."""
        if self.strategy == "hybrid":
            return self.table[6]
        return np.ones(len(self.doc_lens), dtype=bool)

    def rank_totals(self, per_segment: np.ndarray) -> np.ndarray:
        """``[c]`` sums of a per-segment quantity (shaped as ``q_len``) over each rank's slots."""
        c = self.cp_degree
        if self.strategy == "per_document":
            slot = per_segment.sum(axis=0)  # [n_docs, 2c] -> per slot, no per-segment slot array
        else:
            slot = np.bincount(self.table[3], weights=per_segment, minlength=2 * c)
        return slot[:c] + slot[::-1][:c]

    def kv_gather_bytes(self, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
        """:meth:`CPPlan.kv_gather_bytes` of the plan this draft becomes, without building it."""
        q_len = self.q_len
        if self.strategy == "hybrid":
            q_len = np.where(self.table[6][self.table[0]], q_len, 0)
        rows = int(self.rank_totals(q_len).max())
        return (self.cp_degree - 1) * rows * 2 * int(kv_heads) * int(head_dim) * int(dtype_bytes)

    def plan(self, requested: str | None = None) -> CPPlan:
        """The full plan; ``requested`` (default: the strategy itself) is recorded in it."""
        c, two_c = self.cp_degree, 2 * self.cp_degree
        if self.strategy == "per_document":
            # Document-major table; the layout comes cheaply from the [n_docs, 2c] matrix: offset
            # inside a slot = tokens of earlier documents in it, a tail slot (j >= c) follows its
            # rank's head slot 2c-1-j.
            sizes, starts = self.table
            n = len(sizes)
            slot_order = np.arange(n * two_c, dtype=np.int64).reshape(n, two_c).T.ravel()
            slot_offsets = np.arange(two_c + 1, dtype=np.int64) * n
            seg_slot = np.tile(np.arange(two_c, dtype=np.int64), n)
            segs = (np.repeat(np.arange(n, dtype=np.int64), two_c), starts.ravel(), sizes.ravel())
            segs = (*segs, seg_slot, slot_order, slot_offsets)
            local_offset = np.cumsum(sizes, axis=0)
            slot_tokens = local_offset[-1].copy()
            local_offset -= sizes
            local_offset[:, c:] += slot_tokens[:c][::-1]
            local_offset = local_offset.ravel()
        else:
            segs = self.table[:6]
            _, _, seg_len, _, slot_order, slot_offsets = segs
            cum = np.zeros(len(seg_len) + 1, dtype=np.int64)
            seg_len[slot_order].cumsum(out=cum[1:])
            slot_tokens = cum[slot_offsets[1:]] - cum[slot_offsets[:-1]]
            slot_base = np.concatenate((np.zeros(c, np.int64), slot_tokens[c - 1 :: -1]))  # tails
            sorted_slot = np.repeat(np.arange(two_c), slot_offsets[1:] - slot_offsets[:-1])
            local_offset = np.empty(len(seg_len), dtype=np.int64)
            local_offset[slot_order] = (
                cum[:-1] - cum[slot_offsets[sorted_slot]] + slot_base[sorted_slot]
            )
        local_lens = slot_tokens[:c] + slot_tokens[::-1][:c]
        gathered, gather_lens = self.doc_gathered, local_lens
        if self.strategy == "hybrid":
            seg_doc, _, seg_len, seg_slot = segs[:4]
            whole = ~gathered[seg_doc]
            owner = np.minimum(seg_slot[whole], two_c - 1 - seg_slot[whole])
            gather_lens = local_lens - np.bincount(owner, seg_len[whole], c).astype(np.int64)
        return CPPlan(
            self.doc_lens,
            self.doc_cu,
            c,
            self.strategy,
            requested or self.strategy,
            *segs,
            slot_tokens,
            local_lens,
            local_offset,
            gathered,
            gather_lens,
            self.max_len,
        )


def draft_sharding(
    lens: np.ndarray,
    cp_degree: int,
    strategy: str,
    *,
    max_len: int = 0,
    costs: tuple[float, float, float] | None = None,
) -> ShardingDraft:
    """The segments of a fixed ``strategy`` for lengths checked by :func:`validate_doc_lens`
    (``.plan()`` is the plan); ``max_len``: hybrid's threshold, 0 = chosen per micro-batch;
    ``costs``: the online fit's per-rank ``(a, b, g)`` (checked by the caller), by which hybrid
    evens out the ranks' measured costs instead of their tokens and work alone."""
    if strategy not in FIXED_STRATEGIES:
        raise ValueError(
            f"fixed CP strategy {strategy!r} is not one of {FIXED_STRATEGIES} (adaptive selection "
            "is torchtitan_wlb.cp.adaptive.build_cp_plan)"
        )
    bad = isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < 0
    if strategy == "hybrid" and bad:
        raise ValueError(
            f"hybrid max_len must be an int >= 0 (0: 2 * cp_degree * {ATTENTION_TILE}); "
            f"got {max_len!r}"
        )
    doc_cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=doc_cu[1:])
    if strategy == "hybrid":
        table, max_len = _hybrid(lens, cp_degree, int(max_len), costs)
    elif strategy == "per_document":
        table, max_len = _per_document_chunks(lens, cp_degree), 0
    else:
        table, max_len = _per_sequence(lens, doc_cu, cp_degree), 0
    return ShardingDraft(strategy, lens, doc_cu, cp_degree, table, max_len)


def validate_doc_lens(doc_lens: Any, cp_degree: Any, seq_len: int | None = None) -> np.ndarray:
    """``doc_lens`` as int64, checked against ``cp_degree`` (and ``seq_len`` if given)."""
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
    """``[n_docs, 2c]`` chunk sizes and starts (inside each document) of per-document sharding."""
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
    sizes = extra + base[:, None]
    return sizes, np.cumsum(sizes, axis=1) - sizes


def _per_sequence(lens: np.ndarray, doc_cu: np.ndarray, c: int) -> tuple[np.ndarray, ...]:
    """Segment table of per-sequence (head-tail) sharding, slot-major (= global order)."""
    two_c = 2 * c
    base, rem = divmod(int(doc_cu[-1]), two_c)
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


# The hybrid search's knobs (docs/context_parallel.md, "Hybrid sharding").
GREEDY_ROUNDS = 5  # rounds of c whole documents (the longest 5c) dealt greedily
REFINE_PASSES = 4  # upper bound on the refinement's passes
REFINE_TOLERANCE = 1e-3  # refinement stops once the busiest rank is this close to the mean
HYBRID_TOLERANCE = (1.01, 1.05)  # (attention work, tokens) max/mean the chosen plan must keep
SEARCH_CELLS = 4096  # thresholds x documents dealt at most (beyond: evenly spaced thresholds)


def _refine(lens: np.ndarray, rank: np.ndarray, weight: np.ndarray, c: int) -> np.ndarray:
    """``rank`` (one whole-document assignment) after at most :data:`REFINE_PASSES` moves or swaps
    between the ranks with the most and the least ``weight`` (for every document of the busier
    rank, the partner nearest half the gap, by binary search); never empties a rank. Returns
    ``rank`` itself when nothing moved."""
    original, rank, moved = rank, rank.copy(), False
    load = np.bincount(rank, weights=weight, minlength=c)
    limit = load.sum() / c * (1.0 + REFINE_TOLERANCE)  # moves keep the total
    load, tokens = load.tolist(), np.bincount(rank, weights=lens, minlength=c).tolist()
    ranks, by_weight = range(c), weight.argsort(kind="stable")  # Python floats: cheaper here
    partners = np.zeros((3, len(lens) + 1))  # (document, weight, tokens) by weight; 0: a move
    partners[:, 1:] = by_weight, weight[by_weight], lens[by_weight]
    for _ in range(REFINE_PASSES):
        hi, lo = max(ranks, key=load.__getitem__), min(ranks, key=load.__getitem__)
        load_hi, load_lo = load[hi], load[lo]
        if load_hi <= limit:
            break
        on_hi = (rank == hi).nonzero()[0]
        partner, back, back_lens = partners[:, np.concatenate(([True], rank[by_weight] == lo))]
        w_hi = weight[on_hi]
        j = back.searchsorted(w_hi - (load_hi - load_lo) / 2)
        cand_a = np.concatenate([on_hi, on_hi])
        cand_j = np.concatenate([j - 1, j]).clip(0, len(back) - 1)
        delta = np.concatenate([w_hi, w_hi]) - back[cand_j]  # weight leaving hi for lo
        new_max = np.maximum(load_hi - delta, load_lo + delta)
        moved_tokens = lens[cand_a] - back_lens[cand_j]
        valid = (delta > 0) & (new_max < load_hi) & (moved_tokens < tokens[hi])
        best = int(np.where(valid, new_max, np.inf).argmin())
        if not valid[best]:
            break
        rank[cand_a[best]], moved = lo, True
        if b := int(cand_j[best]):
            rank[int(partner[b])] = hi
        step, step_tokens = float(delta[best]), float(moved_tokens[best])
        load[hi], load[lo] = load_hi - step, load_lo + step
        tokens[hi], tokens[lo] = tokens[hi] - step_tokens, tokens[lo] + step_tokens
    return rank if moved else original


def _deal_whole(desc: np.ndarray, pairs: np.ndarray, first: np.ndarray, c: int) -> tuple:
    """Whole documents dealt to ranks under ``K`` thresholds at once: ``[K, n]`` rank of every
    document of ``desc`` (lengths, longest first; ``pairs``: their attention work), ``-1`` for the
    ``first[k]`` split ones, and ``[2, K, c]`` whole tokens and work per rank. Balances tokens;
    attention work is left to the split documents (:func:`_balance`)."""
    n, k, rounds = len(desc), len(first), GREEDY_ROUNDS
    rows, greedy = np.arange(k)[:, None], first[:, None] + np.arange(rounds * c)
    width = n + rounds * c  # flat (1-D) gathers and scatters: multi-axis ones cost ~10x more
    padded = np.zeros(2 * width)  # lengths, then work, zero past the last document
    padded[:n], padded[width : width + n] = desc, pairs
    per_round = greedy.reshape(k, rounds, c).transpose(1, 0, 2)[:, None]
    both = padded[per_round + np.array([0, width])[:, None, None]]  # [rounds, 2, K, c]
    ranks = np.empty((k, rounds, c), dtype=np.int64)
    ranks[:, 0], ranks[:, 1] = np.arange(c), np.arange(c)[::-1]
    wq = both[0] + both[1, :, :, ::-1]  # [2, K, c]: whole tokens and work per rank
    (w, q), flat, cell = wq, wq.reshape(-1), np.arange(0, 2 * k * c, c).reshape(2, k, 1)
    for rnd in range(2, rounds):  # bounded, each round vectorised over the thresholds
        ranks[:, rnd] = to = w.argsort(axis=1, kind="stable")
        flat[(cell + to).ravel()] += both[rnd].ravel()
    rank = np.full(k * width, -1, dtype=np.int64)
    rank[(rows * width + greedy).ravel()] = ranks.ravel()
    if n > greedy[:, -1].min() + 1:  # documents beyond the greedy rounds
        serp = np.arange(-(-n // c) * c).reshape(-1, c)
        serp[1::2] = serp[1::2, ::-1]
        idx = greedy[:, -1:] + 1 + serp.T.ravel()
        valid = idx < n
        sizes = np.where(valid, desc[np.minimum(idx, n - 1)], 0)
        rest_total = sizes.sum(axis=1, keepdims=True)
        deficit = np.maximum((w.sum(axis=1, keepdims=True) + rest_total) / c - w, 0.0)
        bounds = deficit.cumsum(axis=1)
        bounds *= rest_total / np.maximum(bounds[:, -1:], 1e-9)
        offset = rows * (float(desc.sum()) + 1.0)  # one searchsorted for all thresholds
        mid = sizes.cumsum(axis=1) - sizes / 2 + offset
        at, doc = valid.nonzero()[0], idx[valid]
        hit = (bounds + offset).ravel().searchsorted(mid[valid]) - at * c
        bins = at * c + np.minimum(hit, c - 1)
        rank[at * width + doc] = bins - at * c
        w += np.bincount(bins, desc[doc], k * c).reshape(k, c)
        q += np.bincount(bins, pairs[doc], k * c).reshape(k, c)
    return rank.reshape(k, width)[:, :n], wq


def _balance(
    wq: np.ndarray, s: np.ndarray, quad: np.ndarray, c: int, whole_token_weight: float = 1.0
) -> tuple:
    """Common chunk boundaries ``[K, 2c + 1]`` (fractions of a document) of the split documents
    that give each rank the tokens and attention work its whole ones lack, for ``K`` placements
    (``wq``: ``[2, K, c]`` whole tokens and work; ``s``, ``quad``: ``[K, 1]`` split tokens and
    sum of squared split lengths); and, predicted, ``[K]`` work and token max/mean, the most
    gathered rows on a rank and whether both balances are within :data:`HYBRID_TOLERANCE`. Closed
    form; an unreachable target is approached as far as no chunk turns negative. A whole (local)
    token counts ``whole_token_weight`` of a split (gathered) one: the fit's ``b / g``, so that
    equal token loads are equal measured costs."""
    (w, q), q_total = wq, wq[1].sum(axis=1, keepdims=True)
    w = w * whole_token_weight
    w_total = w.sum(axis=1, keepdims=True)
    a = np.maximum((w_total + s) / c - w, 0.0)
    a /= np.maximum(a.sum(axis=1, keepdims=True), 1e-12)
    b = ((q_total + (quad + s) / 2) / c - q - s * a / 2) / np.maximum(quad, 1)
    before = a.cumsum(axis=1) - a
    rest = np.maximum(1.0 - before, 1e-12)
    # Shift of rank r's head start from the even cut's; its tail end moves by the same amount.
    shift = ((1.0 - 2.0 * (b.cumsum(axis=1) - b)) / rest - rest - before) / 2.0
    step = np.abs(shift[:, 1:] - shift[:, :-1])  # rank r's head grows by it, its tail shrinks
    reach = np.where(step > 0, a[:, :-1] / (2 * step + 1e-300), 1.0).min(axis=1, keepdims=True)
    x = before / 2 + np.where(s > 0, np.minimum(reach, 1.0), 0.0) * shift
    y = x + rest
    cum = np.concatenate([x, x[:, -1:] + rest[:, -1:] / 2, y[:, ::-1]], axis=1)
    gathered = s * a
    cum_work = np.zeros((len(x), c + 1))  # quadratic work before each rank: (x**2 + 1 - y**2) / 2
    cum_work[:, :-1] = (x * x - y * y) / 2
    work_tokens = np.empty_like(wq)  # (attention work, tokens) per rank
    np.add(q, quad * (cum_work[:, 1:] - cum_work[:, :-1]), out=work_tokens[0])
    work_tokens[0] += gathered / 2
    np.add(w, gathered, out=work_tokens[1])
    imbalance = work_tokens.max(axis=2) * c / work_tokens.sum(axis=2)
    ok = (imbalance[0] <= HYBRID_TOLERANCE[0]) & (imbalance[1] <= HYBRID_TOLERANCE[1])
    return cum, imbalance[0], imbalance[1], gathered.max(axis=1), ok


def _candidates(desc: np.ndarray, cum: np.ndarray, c: int, max_len: int) -> tuple:
    """Hybrid's thresholds to evaluate (``max_len``; 0: every distinct length from the floor to
    ``T / c``, and the floor) and how many documents of ``desc`` (longest first; ``cum``: its
    cumulative sum from 0) each splits; the longest whole ones too while fewer than ``c`` are
    whole and fewer than ``c`` tokens split."""
    n = len(desc)
    if max_len:
        thresholds = np.array([max_len])
    else:
        keep = desc * c <= cum[-1]  # a threshold keeps all of its length whole: distinct ones
        keep[:-1] &= desc[:-1] > desc[1:]
        keep &= desc > (floor := default_hybrid_max_len(c))
        fit = desc[keep]
        m = min(len(fit) + 1, max(2, SEARCH_CELLS // n))  # evenly spaced, the highest and floor
        pick = (np.arange(m) * (len(fit) / max(m - 1, 1))).round().astype(np.int64)
        thresholds = np.concatenate((fit, [floor]))[pick]
    first = (-desc).searchsorted(-thresholds)  # documents above each threshold
    if c > 1:
        few = (n - first < c) & (cum[first] < c)
        first = np.where(few, cum[1:].searchsorted(c) + 1, first)
    return thresholds, first


def _whole_token_weight(costs: tuple[float, float, float] | None) -> float:
    """A whole (local) token's cost in split (gathered) tokens: the fit's ``b / g`` when it priced
    both, else 1 (tokens counted alike)."""
    if costs is None or not (costs[1] > 0 and costs[2] > 0):
        return 1.0
    return float(costs[1]) / float(costs[2])


def _whole_weight(
    desc: np.ndarray, pairs: np.ndarray, tokens: int, costs: tuple[float, float, float] | None
) -> np.ndarray:
    """What each whole document weighs when nothing is split: by the fit's per-rank model, ``b``
    per token and ``a * Σd² / Σpairs`` per attention pair (a rank's share of ``Σd²`` goes by its
    share of the pairs); without a fit (or a fit pricing neither), its share of the tokens plus
    its share of the attention work (no split chunk can even out either)."""
    if costs is not None and (costs[0] > 0 or costs[1] > 0):
        d = desc.astype(np.float64)
        return costs[1] * d + costs[0] * float(d @ d) / float(pairs.sum()) * pairs
    return desc / tokens + pairs / pairs.sum()


def _hybrid(
    lens: np.ndarray, c: int, max_len: int, costs: tuple[float, float, float] | None = None
) -> tuple[tuple[np.ndarray, ...], int]:
    """Segment table of hybrid sharding (document-major, then ``doc_gathered``) and its threshold
    (``max_len``, or if 0 the balanced candidate that gathers the fewest K/V rows). ``costs``: the
    fit's per-rank ``(a, b, g)`` (:func:`draft_sharding`)."""
    two_c, n = 2 * c, len(lens)
    order = (-lens).argsort(kind="stable")
    desc = lens[order]
    cum = np.zeros(n + 1, dtype=np.int64)
    desc.cumsum(out=cum[1:])
    thresholds, first = _candidates(desc, cum, c, max_len)
    pick = 0
    if c > 1 and first.min() < n:
        pairs = causal_pairs(desc, desc)
        dealt, wq = _deal_whole(desc, pairs, first, c)
        # The likeliest winner (the highest threshold whose whole documents fit the ranks' token
        # shares) is also evaluated with its deal refined, on tokens; if nothing is split, on
        # tokens and work together (their shares summed, or the fit's cost of both): no split
        # chunk can even out either, and refining on work alone left tokens, the linear layers'
        # work, 20-30 % apart.
        g = int((wq[0].max(axis=1) * c <= cum[-1]).argmax())
        f = int(first[g])
        part = dealt[g, f:]
        weight = _whole_weight(desc, pairs, cum[-1], costs) if f == 0 else desc[f:]
        row = _refine(desc[f:], part, weight, c) if f < n else part
        if row is not part:
            take = np.concatenate((np.arange(len(first)), [g]))
            thresholds, first, wq = thresholds[take], first[take], wq[:, take]
            wq[:, -1] = np.bincount(row, desc[f:], c), np.bincount(row, pairs[f:], c)
        squares = np.concatenate(([0], desc * desc)).cumsum()  # exact in int64 and float64
        s, quad = (x[first].astype(np.float64)[:, None] for x in (cum, squares))
        stats = _balance(wq, s, quad, c, _whole_token_weight(costs))
        pick = int(np.lexsort((-thresholds, np.where(stats[4], stats[3], stats[1]), ~stats[4]))[0])
    n_split = int(first[pick])
    split = np.zeros(n, dtype=bool)
    split[order[:n_split]] = True
    split_docs, whole_docs = split.nonzero()[0], order[n_split:]
    split_lens, whole_lens = lens[split_docs], lens[whole_docs]
    whole_rank, sizes = np.zeros(len(whole_docs), dtype=np.int64), None
    if c > 1 and len(whole_docs):
        whole_rank, cum = row if pick == len(dealt) else dealt[pick, n_split:], stats[0][pick]
        if n_split:
            bounds = np.floor(split_lens[:, None] * cum + 0.5).astype(np.int64)
            sizes, starts = bounds[:, 1:] - bounds[:, :-1], bounds[:, :-1]
            slot = sizes.sum(axis=0)
            held = np.bincount(whole_rank, weights=whole_lens, minlength=c)
            if not np.all(held + slot[:c] + slot[::-1][:c] > 0):  # a rank left empty
                sizes = None
    if sizes is None:
        sizes, starts = _per_document_chunks(split_lens, c)
    # One segment per whole document, 2c per split document, in document order.
    per_doc = np.where(split, two_c, 1)
    seg_cu = np.zeros(n + 1, dtype=np.int64)
    per_doc.cumsum(out=seg_cu[1:])
    n_seg = int(seg_cu[-1])
    seg_doc = np.repeat(np.arange(n, dtype=np.int64), per_doc)
    seg_slot, seg_start, seg_len = np.zeros((3, n_seg), dtype=np.int64)
    chunk = (seg_cu[split_docs][:, None] + np.arange(two_c)).ravel()
    seg_slot[chunk] = np.arange(len(chunk)) % two_c
    seg_start[chunk] = starts.ravel()
    seg_len[chunk] = sizes.ravel()
    first_seg = seg_cu[whole_docs]
    seg_slot[first_seg] = two_c - 1 - whole_rank  # a whole document sits in its rank's tail slot
    seg_len[first_seg] = whole_lens
    # Slot order: by slot, a slot's split chunks before its whole documents, then document order
    # (a stable sort on a small integer key: int16, a radix sort).
    key = seg_slot * 2
    key[first_seg] += 1
    slot_order = key.astype(np.int16 if 4 * c < 32767 else np.int32).argsort(kind="stable")
    slot_offsets = np.zeros(two_c + 1, dtype=np.int64)
    np.bincount(seg_slot, minlength=two_c).cumsum(out=slot_offsets[1:])
    table = (seg_doc, seg_start, seg_len, seg_slot, slot_order, slot_offsets, split)
    return table, int(thresholds[pick])


def auto_hybrid_max_len(lens: np.ndarray, cp_degree: int) -> int:
    """Hybrid's automatic threshold for one micro-batch, never below the default floor."""
    return _hybrid(np.asarray(lens, dtype=np.int64), int(cp_degree), 0)[1]
