"""The document stream: texts -> tokenized documents, long ones split by a policy (docs/data.md).

Not sharded by rank: the packing plan is global. The state is a few counters (epoch, texts read,
pieces of the current text emitted); restoring re-reads the source from there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torchtitan.tools.logging import logger

from torchtitan_wlb.data.counted import CountedNode
from torchtitan_wlb.data.sources import DataError, TextSource


class DocumentNode(CountedNode):
    """Tokenized documents from a :class:`TextSource`, one item per piece of at most
    ``max_doc_len`` tokens (``doc_id`` counts pieces, ``parent_id`` the text), longer texts cut by
    ``policy`` (docs/data.md), over ``epochs`` passes (0: forever, TorchTitan's default)."""

    _LOG_AT = frozenset({1, 10, 100, 1_000})  # truncated documents logged, then every 10,000th

    def __init__(
        self,
        source: TextSource,
        tokenizer: Any,
        max_doc_len: int,
        policy: str = "split",
        epochs: int = 1,
    ) -> None:
        super().__init__()
        self.source = source
        self.tokenizer = tokenizer
        if max_doc_len < 2:
            raise ValueError(f"max_doc_len = {max_doc_len} must be >= 2 tokens")
        self.max_doc_len = max_doc_len
        self.policy = policy
        self.epochs = epochs
        self._it: Iterator[dict] | None = None
        self._set_counters(None)

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._it = self._generate()

    def _pieces(self, index: int, text: str) -> list[np.ndarray]:
        # int32: every vocabulary fits (numpy refuses an id that does not); half int64's bytes.
        tokens = np.asarray(self.tokenizer.encode(text, add_bos=True, add_eos=True), np.int32)
        if tokens.size <= self.max_doc_len:
            return [tokens]
        if self.policy == "error":
            raise DataError(
                f"document {index} of {self.source.kind} source {self.source.path or ''!r} has "
                f"{tokens.size} tokens > max_doc_len = {self.max_doc_len} "
                "(set [wlb] long_doc_policy = 'split' or 'truncate', or raise max_doc_len)"
            )
        if self.policy == "truncate":
            dropped = int(tokens.size - self.max_doc_len)
            self.truncated_tokens += dropped
            self.truncated_docs += 1
            if self.truncated_docs in self._LOG_AT or self.truncated_docs % 10_000 == 0:
                logger.warning(
                    f"long_doc_policy = 'truncate': document {index} cut to {self.max_doc_len} "
                    f"tokens, {dropped:,} dropped; {self.truncated_docs:,} documents and "
                    f"{self.truncated_tokens:,} tokens dropped so far"
                )
            return [tokens[: self.max_doc_len]]
        return np.array_split(tokens, np.arange(self.max_doc_len, tokens.size, self.max_doc_len))

    def _generate(self) -> Iterator[dict]:
        while self.epochs == 0 or self.epoch < self.epochs:
            for index, text in self.source.open_texts(self.texts_done):
                pieces = self._pieces(index, text)
                for p in range(self.pieces_done, len(pieces)):
                    self.pieces_done = p + 1
                    doc_id = self.next_doc_id
                    self.next_doc_id += 1
                    yield {
                        "doc_id": doc_id,
                        "tokens": pieces[p],
                        "parent_id": index,
                        "piece": p,
                        "epoch": self.epoch,
                    }
                self.texts_done = index + 1
                self.pieces_done = 0
            if self.texts_done == 0:
                raise DataError(
                    f"{self.source.kind} source {self.source.path or ''!r} holds no document"
                )
            self.epoch += 1
            self.texts_done = 0

    def next(self) -> dict:
        assert self._it is not None, "reset() must be called before next()"
        return next(self._it)

    def read_documents(self, min_tokens: int) -> tuple[list[int], list[np.ndarray]]:
        """The next documents' ids and tokens until they reach ``min_tokens`` or the data ends: a
        batched ``next``, which the packing node checks with array operations."""
        if self._it is None:
            self.reset(None)
        ids: list[int] = []
        tokens: list[np.ndarray] = []
        got = 0
        while got < min_tokens:
            item = next(self._it, None)
            if item is None:
                break
            ids.append(item["doc_id"])
            tokens.append(item["tokens"])
            got += item["tokens"].size
        return ids, tokens
