"""The held-out set that ``[validation]`` evaluates: documents packed as training packs them.

The set is fixed by the config alone (source, token budget, ``seq_len``), never by the layout: the
same documents are packed, in source order, into the same sequences whatever the number of ranks,
and the sequences are then dealt to the data-parallel ranks. Each sequence is collated as training
collates a micro-batch (document-masked attention, positions restarting per document, no label
across a document boundary), so the mean loss over its tokens is the same on one rank or many.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchtitan_wlb.data.collate import BatchT, collate_micro_batch
from torchtitan_wlb.data.documents import DocumentNode
from torchtitan_wlb.data.indexed import IndexedCorpus
from torchtitan_wlb.data.sources import BUILTIN_HELDOUT_NAME, BUILTIN_NAME, TextSource

INDEXED = "indexed"
TORCHTITAN_DEFAULT = "c4_validation"
"""TorchTitan's default ``[validation] dataset``: a download the document loader does not read."""


@dataclass(frozen=True)
class HeldOutSequence:
    """One packed held-out sequence: its tokens and the lengths of the documents in it."""

    tokens: np.ndarray
    doc_lens: np.ndarray

    def batch(self) -> BatchT:
        """The sequence as a training micro-batch (``collate_micro_batch``'s tensors)."""
        return collate_micro_batch(self.tokens, self.doc_lens)


def validation_source(validation: Any, text_field: str) -> TextSource:
    """The source named by ``[validation] dataset`` / ``dataset_path`` (Hugging Face datasets are
    read from their ``validation`` split)."""
    kind = validation.dataset
    return TextSource(kind, validation.dataset_path or "", text_field, split="validation")


def token_budget(validation: Any) -> int | None:
    """Tokens in the held-out set: ``steps x local_batch_size x seq_len`` (None: the whole source
    when ``steps = -1``). A budget over the whole job, not per rank, so that it is the same set
    whatever the data-parallel degree."""
    if validation.steps == -1:
        return None
    return validation.steps * validation.local_batch_size * validation.seq_len


def read_heldout_documents(
    source: TextSource, tokenizer: Any, seq_len: int, budget: int | None
) -> list[np.ndarray]:
    """The first documents of ``source`` (tokenized as training tokenizes, texts longer than
    ``seq_len`` split into pieces) until ``budget`` tokens are reached or the source ends."""
    if source.kind == INDEXED:
        return _indexed_documents(IndexedCorpus(source.path), seq_len, budget)
    node = DocumentNode(source=source, tokenizer=tokenizer, max_doc_len=seq_len, epochs=1)
    node.reset()
    docs: list[np.ndarray] = []
    total = 0
    for item in node:
        if budget is not None and total >= budget:
            break
        docs.append(item["tokens"])
        total += item["tokens"].size
    return docs


def _indexed_documents(corpus: IndexedCorpus, seq_len: int, budget: int | None) -> list[np.ndarray]:
    """:func:`read_heldout_documents` of a Megatron corpus: its documents in index order, each cut
    into pieces of at most ``seq_len`` tokens (as the text sources are), read from the memory map."""
    docs: list[np.ndarray] = []
    total = 0
    for doc, length in enumerate(corpus.doc_lens.tolist()):
        for start in range(0, length, seq_len):
            if budget is not None and total >= budget:
                return docs
            piece = np.empty(min(seq_len, length - start), dtype=np.int64)
            corpus.read_into(doc, start, piece)
            docs.append(piece)
            total += piece.size
    return docs


def pack_sequences(docs: list[np.ndarray], seq_len: int) -> list[HeldOutSequence]:
    """Documents, in order, into sequences of at most ``seq_len`` tokens (next fit): one plan,
    computed identically by every rank."""
    out: list[HeldOutSequence] = []
    current: list[np.ndarray] = []
    used = 0
    for doc in docs:
        if current and used + doc.size > seq_len:
            out.append(_sequence(current))
            current, used = [], 0
        current.append(doc)
        used += doc.size
    if current:
        out.append(_sequence(current))
    return out


def _sequence(docs: list[np.ndarray]) -> HeldOutSequence:
    lens = np.array([d.size for d in docs], dtype=np.int64)
    return HeldOutSequence(np.concatenate(docs).astype(np.int64), lens)


def deal(sequences: list[HeldOutSequence], rank: int, world: int) -> list[HeldOutSequence]:
    """Rank ``rank``'s share of ``world`` data-parallel ranks: sequences ``rank``, ``rank +
    world``, ... (every sequence on exactly one rank)."""
    return sequences[rank::world]


def training_reads_heldout(training_dataset: str, training_path: str, source: TextSource) -> bool:
    """Whether training reads the held-out documents too: the same local files, or the built-in
    held-out split as the training set."""
    if training_dataset == BUILTIN_HELDOUT_NAME:
        return True
    if source.kind == INDEXED:  # the same corpus: the same prefix
        same = os.path.realpath(training_path) == os.path.realpath(source.path)
        return training_dataset == INDEXED and same
    if source.kind in (BUILTIN_NAME, BUILTIN_HELDOUT_NAME, "hf"):
        return source.kind == BUILTIN_NAME and training_dataset == BUILTIN_NAME
    if training_dataset != source.kind or not training_path:
        return False
    return bool(set(source.files()) & set(TextSource(training_dataset, training_path).files()))
