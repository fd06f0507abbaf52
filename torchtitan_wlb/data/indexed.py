"""Pre-tokenized corpora in Megatron-LM's indexed format (``PREFIX.idx`` + ``PREFIX.bin``).

The packing plan is global, so every rank needs every document's length, but only the tokens of its
own micro-batches. The index gives the lengths without touching the tokens: :class:`IndexedCorpus`
memory-maps both files, and :class:`IndexedDocumentNode` hands the packing node lengths and the
places of the tokens, which the node reads only for the micro-batches its rank trains.

The ``.idx`` layout (little-endian), as Megatron's and NeMo's preprocessing tools write it: the magic
``MMIDIDX\\0\\0``, the version (u64, 1), the token dtype code (u8), the sequence count (u64), the
document-index count (u64, documents + 1), then the int32 sequence lengths, the int64 byte offsets
of the sequences in the ``.bin``, and the int64 document indices (document ``i`` is sequences
``doc_idx[i]`` to ``doc_idx[i + 1]``). A document may span several sequences; it is one document
here (one attention span), its sequences concatenated.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from torchtitan_wlb.data.counted import CountedNode
from torchtitan_wlb.data.sources import DataError

INDEXED = "indexed"
"""``[training] dataset`` of a Megatron indexed corpus (``dataset_path``: the prefix)."""

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}
"""Megatron's dtype codes of integer tokens (6 and 7, float64 and float32, hold no token ids)."""

RECORD_SUFFIX = ".tokenizer.json"
"""``PREFIX.tokenizer.json``: the tokenizer a corpus was made with (``tools.pretokenize``)."""


def code_of(dtype: Any) -> int:
    """Megatron's code of a token dtype."""
    dtype = np.dtype(dtype)
    for code, d in DTYPE_CODES.items():
        if d == dtype:
            return code
    raise ValueError(f"no Megatron dtype code for {dtype}")


def smallest_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned (else int32) dtype that holds ids ``0 .. vocab_size - 1``."""
    for dtype in (np.uint8, np.uint16):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    return np.dtype(np.int32)


def _fault(path: str, what: str) -> DataError:
    return DataError(f"{path}: {what} (a Megatron indexed corpus: PREFIX.idx + PREFIX.bin)")


class IndexedCorpus:
    """A Megatron indexed corpus, memory-mapped: per-document lengths and token places are read
    from the index; tokens only by :meth:`read_into`. Every inconsistency between the two files is
    a :class:`DataError` naming the file and the fault, found when the corpus is opened."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.idx_path, self.bin_path = f"{prefix}.idx", f"{prefix}.bin"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise _fault(path, "missing")
        self._read_index()
        self._check_bin()
        starts = self.doc_idx[:-1]
        seq_ends = self.pointers + self.seq_lens.astype(np.int64) * self.itemsize
        # Megatron's writers put a document's sequences back to back: one read per document.
        self.contiguous = bool(np.array_equal(self.pointers[1:], seq_ends[:-1]))
        if np.array_equal(self.doc_idx, np.arange(self.doc_idx.size)):
            self.doc_lens = self.seq_lens.astype(np.int64)
        else:
            cum = np.concatenate([[0], np.cumsum(self.seq_lens, dtype=np.int64)])
            self.doc_lens = cum[self.doc_idx[1:]] - cum[starts]
        first = np.minimum(starts, max(self.seq_lens.size - 1, 0))
        self.doc_offsets = (self.pointers[first] // self.itemsize) if self.pointers.size else starts
        # A plain view of the map: slicing a np.memmap builds a memmap object per slice.
        tokens = np.memmap(self.bin_path, self.dtype, mode="r") if self.bin_size else None
        self.tokens = None if tokens is None else tokens.view(np.ndarray)
        self.read_bytes = 0
        """Token bytes read so far (by :meth:`read_into`)."""

    def _read_index(self) -> None:
        path = self.idx_path
        size = os.path.getsize(path)
        if size < _HEADER.size:
            raise _fault(path, f"{size} bytes, shorter than the {_HEADER.size}-byte header")
        with open(path, "rb") as f:
            magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise _fault(path, f"bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise _fault(path, f"version {version}, only version {VERSION} is read")
        if code not in DTYPE_CODES:
            raise _fault(path, f"token dtype code {code}; integer codes are {sorted(DTYPE_CODES)}")
        self.dtype = DTYPE_CODES[code]
        self.itemsize = self.dtype.itemsize
        need = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if n_doc < 1 or size < need:
            raise _fault(
                path,
                f"{size} bytes for {n_seq} sequences and {n_doc} document indices "
                f"(needs {need}): truncated or not an index",
            )
        mm = np.memmap(path, np.uint8, mode="r")
        off = _HEADER.size
        self.seq_lens = mm[off : off + 4 * n_seq].view(np.int32)
        off += 4 * n_seq
        self.pointers = mm[off : off + 8 * n_seq].view(np.int64)
        off += 8 * n_seq
        self.doc_idx = np.asarray(mm[off : off + 8 * n_doc].view(np.int64))
        d = self.doc_idx
        if d[0] != 0 or d[-1] != n_seq or (d.size > 1 and bool((np.diff(d) < 0).any())):
            raise _fault(
                path,
                f"document indices must rise from 0 to the sequence count {n_seq}, "
                f"got {d[0]} .. {d[-1]}",
            )
        if n_seq and int(self.seq_lens.min()) < 0:
            raise _fault(path, "a negative sequence length")

    def _check_bin(self) -> None:
        self.bin_size = os.path.getsize(self.bin_path)
        if not self.seq_lens.size:
            return
        if int(self.pointers.min()) < 0 or bool((self.pointers % self.itemsize).any()):
            raise _fault(
                self.idx_path,
                f"a sequence pointer negative or not a multiple of "
                f"the {self.itemsize}-byte token size",
            )
        ends = self.pointers + self.seq_lens.astype(np.int64) * self.itemsize
        end = int(ends.max())
        if end > self.bin_size:
            i = int(np.argmax(ends > self.bin_size))
            raise _fault(
                self.bin_path,
                f"truncated: {self.bin_size} bytes, but {self.idx_path} puts sequence {i} at "
                f"bytes {int(self.pointers[i])}..{int(ends[i])} (pointers past the end)",
            )

    @property
    def num_docs(self) -> int:
        return int(self.doc_lens.size)

    def record(self) -> dict[str, Any] | None:
        """The tokenizer record written beside the corpus by ``tools.pretokenize``; None for a
        corpus made by other tools."""
        path = self.prefix + RECORD_SUFFIX
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def read_into(self, doc: int, start: int, out: np.ndarray) -> None:
        """Tokens ``start .. start + out.size`` of document ``doc`` into ``out`` (converted to its
        dtype); the only place tokens are read."""
        n = out.size
        self.read_bytes += n * self.itemsize
        if self.contiguous:
            lo = int(self.doc_offsets[doc]) + start
            out[:] = self.tokens[lo : lo + n]
            return
        got, pos = 0, 0  # sequences one by one, skipping ``start`` tokens
        for s in range(int(self.doc_idx[doc]), int(self.doc_idx[doc + 1])):
            length = int(self.seq_lens[s])
            lo, hi = max(start - pos, 0), min(length, start + n - pos)
            if hi > lo:
                base = int(self.pointers[s]) // self.itemsize
                out[got : got + hi - lo] = self.tokens[base + lo : base + hi]
                got += hi - lo
            pos += length

    def max_token(self, docs: int) -> int:
        """The largest token id in the first ``docs`` documents (a bounded check)."""
        if self.tokens is None or not docs:
            return -1
        last = min(docs, self.num_docs) - 1
        end = int(self.doc_offsets[last] + self.doc_lens[last]) if self.contiguous else None
        view = self.tokens[:end]
        return int(view.max()) if view.size else -1

    def min_token(self, docs: int) -> int:
        """The smallest token id in the first ``docs`` documents (signed dtypes)."""
        if self.tokens is None or not docs or self.dtype.kind == "u":
            return 0
        last = min(docs, self.num_docs) - 1
        end = int(self.doc_offsets[last] + self.doc_lens[last]) if self.contiguous else None
        view = self.tokens[:end]
        return int(view.min()) if view.size else 0


def _describe(record: dict[str, Any]) -> str:
    if record.get("tokenizer") == "bytes":
        return "the built-in byte tokenizer"
    return f"a Hugging Face tokenizer.json with SHA-256 {str(record.get('sha256'))[:12]}..."


def check_corpus_tokenizer(corpus: IndexedCorpus, record: dict[str, Any]) -> None:
    """Refuse a corpus made with another tokenizer than this run's (``record``: the run's
    :func:`~torchtitan_wlb.data.tokenizer.tokenizer_record`); one without a record (made by other
    tools) is accepted, its ids checked against the vocabulary as they are read."""
    saved = corpus.record()
    if saved is None:
        return
    keys = ("tokenizer", "sha256")
    if any(saved.get(k) != record.get(k) for k in keys):
        raise DataError(
            f"{corpus.prefix}{RECORD_SUFFIX}: the corpus was tokenized with {_describe(saved)}, "
            f"this run uses {_describe(record)} ([model] hf_assets_path); tokenize it again with "
            "python -m torchtitan_wlb.tools.pretokenize, or set the corpus's tokenizer"
        )


def epoch_order(num_docs: int, seed: int, epoch: int) -> np.ndarray | None:
    """The order documents are visited in ``epoch``: a permutation from ``(seed, epoch)``, the same
    on every rank and after a resume; None (the corpus order) when ``seed`` is -1."""
    if seed < 0:
        return None
    return np.random.default_rng([seed, epoch]).permutation(num_docs)


class IndexedDocumentNode(CountedNode):
    """The document stream of an :class:`IndexedCorpus`, cut by ``policy`` into pieces of at most
    ``max_doc_len`` tokens (as :class:`~torchtitan_wlb.data.documents.DocumentNode`), without
    reading tokens: items and :meth:`read_lengths` give each piece's id, length and place
    ``(document, first token)``; :meth:`fetch_tokens` reads the pieces a rank trains.
    ``vocab_size``: every id read is checked against it."""

    def __init__(
        self,
        corpus: IndexedCorpus,
        max_doc_len: int,
        policy: str = "split",
        epochs: int = 1,
        shuffle_seed: int = -1,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if max_doc_len < 2:
            raise ValueError(f"max_doc_len = {max_doc_len} must be >= 2 tokens")
        if not int((corpus.doc_lens > 0).sum()):
            raise DataError(f"{corpus.idx_path}: the corpus holds no non-empty document")
        self.corpus = corpus
        self.max_doc_len = max_doc_len
        self.policy = policy
        self.epochs = epochs
        self.shuffle_seed = shuffle_seed
        self.vocab_size = vocab_size
        self._order: np.ndarray | None = None
        self._order_epoch = -1
        self._set_counters(None)

    def _docs(self, lo: int, hi: int) -> np.ndarray:
        """The corpus numbers of positions ``lo .. hi`` of this epoch's order."""
        if self._order_epoch != self.epoch:
            self._order = epoch_order(self.corpus.num_docs, self.shuffle_seed, self.epoch)
            self._order_epoch = self.epoch
        if self._order is None:
            return np.arange(lo, hi, dtype=np.int64)
        return self._order[lo:hi]

    def _pieces(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per piece of ``docs`` (in order): its position in ``docs``, first token and length."""
        lens = self.corpus.doc_lens[docs]
        m = self.max_doc_len
        if self.policy == "error" and lens.size and int(lens.max()) > m:
            i = int(np.argmax(lens > m))
            raise DataError(
                f"document {int(docs[i])} of {self.corpus.prefix!r} has {int(lens[i])} tokens "
                f"> max_doc_len = {m} (set [wlb] long_doc_policy = 'split' or 'truncate', or "
                "raise max_doc_len)"
            )
        counts = -(-lens // m) if self.policy == "split" else (lens > 0).astype(np.int64)
        owner = np.repeat(np.arange(docs.size), counts)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        starts = (np.arange(owner.size) - first[owner]) * m
        return owner, starts, np.minimum(lens[owner] - starts, m)

    def read_lengths(
        self, min_tokens: int, max_items: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next pieces until their tokens reach ``min_tokens`` (or ``max_items`` pieces, or the
        data's end): ids, lengths, and places as rows ``(document, first token)``."""
        docs_out: list[np.ndarray] = []
        starts_out: list[np.ndarray] = []
        lens_out: list[np.ndarray] = []
        got, items = 0, 0
        n = self.corpus.num_docs
        mean = max(float(self.corpus.doc_lens.mean()), 1.0)
        while got < min_tokens and (max_items is None or items < max_items):
            if self.epochs and self.epoch >= self.epochs:
                break
            if self.texts_done >= n:
                self.epoch += 1
                self.texts_done = self.pieces_done = 0
                continue
            want = int(min(n - self.texts_done, max(16, (min_tokens - got) / mean * 1.2 + 1)))
            if max_items is not None:  # each non-empty document is at least one piece
                want = min(want, max(16, max_items - items))
            docs = self._docs(self.texts_done, self.texts_done + want)
            owner, pstart, plen = self._pieces(docs)
            skip = self.pieces_done  # pieces of the first document already read
            owner, pstart, plen = owner[skip:], pstart[skip:], plen[skip:]
            cum = np.cumsum(plen)
            k = int(np.searchsorted(cum, min_tokens - got)) + 1
            k = min(k, plen.size, max_items - items if max_items is not None else k)
            taken = docs[owner[:k]]
            docs_out.append(taken)
            starts_out.append(pstart[:k])
            lens_out.append(plen[:k])
            if self.policy == "truncate":
                cut = self.corpus.doc_lens[taken] - self.max_doc_len
                self.truncated_docs += int((cut > 0).sum())
                self.truncated_tokens += int(cut[cut > 0].sum())
            got += int(cum[k - 1]) if k else 0
            items += k
            if k == plen.size:  # every piece of the chunk: its documents are done
                self.texts_done += docs.size
                self.pieces_done = 0
            else:  # done up to the next piece, of the document at position owner[k]
                self.texts_done += int(owner[k])
                self.pieces_done = int(pstart[k]) // self.max_doc_len
        ids = np.arange(self.next_doc_id, self.next_doc_id + items, dtype=np.int64)
        self.next_doc_id += items
        if not items:
            return ids, np.zeros(0, np.int64), np.zeros((0, 2), np.int64)
        lens = np.concatenate(lens_out).astype(np.int64)
        where = np.stack([np.concatenate(docs_out), np.concatenate(starts_out)], axis=1)
        return ids, lens, where.astype(np.int64)

    def next(self) -> dict:
        ids, lens, where = self.read_lengths(1, max_items=1)
        if not ids.size:
            raise StopIteration
        return {"doc_id": int(ids[0]), "length": int(lens[0]), "where": where[0]}

    def fetch_tokens(self, where: list[tuple[int, int, int]], out: np.ndarray) -> None:
        """Read the pieces ``(document, first token, length)`` back to back into ``out``, checking
        their ids against the vocabulary."""
        pos = 0
        for doc, start, length in where:
            self.corpus.read_into(doc, start, out[pos : pos + length])
            pos += length
        if self.vocab_size is not None and pos:
            lo, hi = int(out[:pos].min()), int(out[:pos].max())
            if hi >= self.vocab_size or lo < 0:
                raise DataError(
                    f"{self.corpus.bin_path}: token id {hi if hi >= self.vocab_size else lo} is "
                    f"outside the tokenizer's vocabulary [0, {self.vocab_size})"
                )
