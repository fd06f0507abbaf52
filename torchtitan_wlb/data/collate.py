"""From packed micro-batches to the tensors TorchTitan's training step consumes (docs/data.md).

The state (the source's state before the step, micro-batches handed out) lets a checkpoint taken
between micro-batches of a step resume exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode
from torchtitan.components.loss import IGNORE_INDEX

BatchT = tuple[dict[str, Any], torch.Tensor]


def document_positions(doc_lens: np.ndarray) -> np.ndarray:
    """Per-document positions 0..d-1 for every document, vectorised (no loop over documents).

    One array and one in-place cumulative sum: +1 per token, and at each document's first token
    the step back to 0. Temporaries of the micro-batch's size (a repeated start per token, an
    arange) cost more than the arithmetic where the allocator returns freed pages between
    micro-batches: faulted in anew each time, they made collating a step up to 3-4x slower
    (docs/data.md; with a warm allocator the difference is ~5 %).
    """
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    doc_lens = doc_lens[doc_lens > 0]
    positions = np.ones(int(doc_lens.sum()), dtype=np.int64)
    if positions.size:
        positions[0] = 0
        positions[np.cumsum(doc_lens[:-1])] = 1 - doc_lens[:-1]
    return np.cumsum(positions, out=positions)


def collate_micro_batch(
    tokens: np.ndarray, doc_lens: np.ndarray, reset_positions: bool = True
) -> BatchT:
    """One packed micro-batch as ``({"input", "positions", "doc_lens"}, labels)``.

    A micro-batch without documents (a final step with fewer documents than micro-batches)
    becomes a one-token *filler* that trains nothing: gradient accumulation and the pipeline
    schedule need the step's fixed number of micro-batches on every rank.
    """
    tokens = np.asarray(tokens)
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    if doc_lens.size == 0 and tokens.size == 0:  # the filler: one document of one token 0
        tokens, doc_lens = np.zeros(1, np.int64), np.ones(1, np.int64)
    if doc_lens.size == 0 or int(doc_lens.sum()) != tokens.size or (doc_lens <= 0).any():
        raise ValueError(
            f"document lengths {doc_lens.tolist()[:8]}... (sum {int(doc_lens.sum())}) do not "
            f"describe a packed sequence of {tokens.size} tokens"
        )
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    # int32 from the packing node, int64 for the model; labels are the tokens shifted by one.
    tokens = tokens.astype(np.int64, copy=False)
    labels = np.empty_like(tokens)
    labels[:-1] = tokens[1:]
    labels[np.cumsum(doc_lens) - 1] = IGNORE_INDEX
    if reset_positions:
        positions = document_positions(doc_lens)
    else:
        positions = np.arange(tokens.size, dtype=np.int64)
    input_dict = {
        "input": torch.from_numpy(tokens).unsqueeze(0),
        "positions": torch.from_numpy(positions).unsqueeze(0),
        "doc_lens": torch.from_numpy(doc_lens.astype(np.int32)),
    }
    return input_dict, torch.from_numpy(labels).unsqueeze(0)


class MicroBatchNode(BaseNode[BatchT]):
    """Unrolls the packing node's per-step items into per-micro-batch tensors (``wlb_stats`` on a
    step's first); ``reset_positions`` restarts RoPE positions at every document."""

    def __init__(self, source: BaseNode, reset_positions: bool = True) -> None:
        super().__init__()
        self.source = source
        self.reset_positions = reset_positions
        self._step: dict | None = None
        self._index = 0
        self._source_state_before_step: dict | None = None

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._step = None
        self._index = 0
        if initial_state is None:
            self.source.reset(None)
            self._source_state_before_step = self.source.state_dict()
            return
        self.source.reset(initial_state["source"])
        self._source_state_before_step = initial_state["source"]
        if initial_state["index"] > 0:
            # Re-produce the step that was in progress, then skip what was already handed out.
            self._step = self.source.next()
            self._index = int(initial_state["index"])

    def next(self) -> BatchT:
        if self._step is None or self._index >= len(self._step["micro_batches"]):
            self._source_state_before_step = self.source.state_dict()
            self._step = self.source.next()
            self._index = 0
        mb = self._step["micro_batches"][self._index]
        input_dict, labels = collate_micro_batch(mb["tokens"], mb["doc_lens"], self.reset_positions)
        if "doc_ids" in mb:
            input_dict["doc_ids"] = torch.as_tensor(np.asarray(mb["doc_ids"], dtype=np.int64))
        if self._index == 0:
            input_dict["wlb_stats"] = dict(self._step.get("stats", {}))
        self._index += 1
        return input_dict, labels

    def get_state(self) -> dict:
        at_boundary = self._step is None or self._index >= len(self._step["micro_batches"])
        if at_boundary:
            return {"source": self.source.state_dict(), "index": 0}
        return {"source": self._source_state_before_step, "index": self._index}
