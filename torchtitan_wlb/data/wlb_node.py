"""torchdata node that packs a document stream into per-step micro-batches with a packer.

Input: a ``BaseNode`` yielding ``{"doc_id": int, "tokens": np.ndarray[int64]}`` (the document
stream). Output: one item per optimizer step,

    {"micro_batches": [{"tokens", "doc_lens", "doc_ids"}, ...],  # this DP rank's N // dp
     "stats": {...}}                                              # the global plan's metrics

Every DP rank runs the same node on the same global stream and computes the same global plan
(packers are deterministic) and keeps its ``N // dp`` micro-batches: contiguous slices for the
``original`` baseline, workload-balanced dealing for the other packers (``_rank_micro_batches``).
No communication is needed, and a rank's checkpoint is enough to resume it.

Read-ahead: the node keeps up to one global batch (``N * context_len`` tokens) of documents read
from the source but not yet given to the packer, so that it sees the end of the data one step
before the last pull (see :mod:`~torchtitan_wlb.packing.driver`): the final pull then takes the
rest of the data with it, and the packer drains over at least a full step of documents.

Online cost model (``schedule``): with a :class:`~torchtitan_wlb.cost_fit.CostModelSchedule` the
packer's cost model is set, before every plan, to the one the schedule assigns to that step; the
schedule decides by step number, not by when this node's prefetch thread gets there, so every DP
rank and a resumed run pack each step with the same model. The coefficients travel with the plan's
statistics (``cost_attn_coef``, ``cost_linear_coef``).

Checkpointing (``state_dict`` / ``reset``): the packer's state lists the pending documents (ids,
lengths, arrival steps) and the node's state the read-ahead documents (ids, lengths), but neither
stores their *tokens*. The node stores, for every pull since the oldest held document was read,
the source's state before that pull and how many documents it read. ``reset(state)`` rewinds the
source to the oldest snapshot, replays the reads and keeps the held documents' tokens, then
restores the source's latest state. Why: a
queue can hold ``levels * N`` documents of up to ``S_max`` tokens (tens of MB per rank at 128K
context), replicated in every DP rank's checkpoint, while the snapshots are a few source states
(one per step the oldest pending document has waited, at most the longest wait + 2). The price
is re-reading that many steps of documents on restore, and the source must be deterministic under ``reset(state)`` (torchdata's
contract); the replayed documents are checked against the stored ids and lengths.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from torchtitan_wlb.cost_fit import CostModelSchedule
from torchtitan_wlb.packing import Packer
from torchtitan_wlb.packing.driver import next_plan
from torchtitan_wlb.packing.placement import dp_order

__all__ = ["WLBPackingNode"]


class WLBPackingNode(BaseNode[dict]):
    """Packs documents into ``N`` micro-batches per step and yields this DP rank's share."""

    SOURCE_KEY = "source"
    PACKER_KEY = "packer"

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
        if isinstance(dp_degree, bool) or not isinstance(dp_degree, int) or dp_degree < 1:
            raise ValueError(f"dp_degree must be an integer >= 1, got {dp_degree!r}")
        if n % dp_degree != 0:
            raise ValueError(
                f"micro_batches N={n} must be divisible by dp_degree={dp_degree} "
                "(each DP rank takes N // dp_degree micro-batches)"
            )
        if (
            isinstance(dp_rank, bool)
            or not isinstance(dp_rank, int)
            or not 0 <= dp_rank < dp_degree
        ):
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank!r}")
        self.source = source
        self.packer = packer
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.schedule = schedule
        self._per_rank = n // dp_degree
        self._initial_packer_state = packer.state_dict()
        self._tokens: dict[int, np.ndarray] = {}  # every held document: read-ahead + pending
        self._snapshots: list[tuple[int, dict[str, Any], int]] = []
        self._snapshot_ids: list[np.ndarray] = []  # the ids each snapshot's pull read
        self._ahead: deque[tuple[int, int]] = deque()  # (id, length) read, not given to the packer
        self._ahead_tokens = 0
        self._source_done = False
        self._exhausted = False

    # ------------------------------------------------------------------ BaseNode
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._tokens = {}
        self._snapshot_ids = []
        self._ahead = deque()
        self._ahead_tokens = 0
        if initial_state is None:
            self.source.reset(None)
            self.packer.load_state_dict(self._initial_packer_state)
            self._snapshots = []
            self._source_done = self._exhausted = False
            return
        self.packer.load_state_dict(initial_state[self.PACKER_KEY])
        self._exhausted = bool(initial_state["exhausted"])
        # States written before the read-ahead: the source ended exactly when the data did.
        self._source_done = bool(initial_state.get("source_done", self._exhausted))
        self._snapshots = [(int(s), st, int(k)) for s, st, k in initial_state["snapshots"]]
        ahead = [(int(i), int(n)) for i, n in initial_state.get("ahead", [])]
        self._ahead = deque(ahead)
        self._ahead_tokens = sum(n for _, n in ahead)
        pending = self.packer.pending()
        held = dict(zip(pending.ids.tolist(), pending.lens.tolist(), strict=True))
        held.update(ahead)
        self._replay(held)
        self.source.reset(initial_state[self.SOURCE_KEY])

    def get_state(self) -> dict[str, Any]:
        return {
            self.SOURCE_KEY: self.source.state_dict(),
            self.PACKER_KEY: self.packer.state_dict(),
            "snapshots": [[s, st, k] for s, st, k in self._snapshots],
            "ahead": [[i, n] for i, n in self._ahead],
            "source_done": self._source_done,
            "exhausted": self._exhausted,
        }

    def next(self) -> dict[str, Any]:
        if self.schedule is not None:  # plan i (0-based) is trained at step i + 1
            self.packer.cost_model = self.schedule.model_for_step(self.packer.steps_done + 1)
        plan = next_plan(self.packer, self)
        if plan is None:
            raise StopIteration
        micro_batches = []
        for j in self._rank_micro_batches(plan.doc_lens).tolist():
            doc_ids, doc_lens = plan.doc_ids[j], plan.doc_lens[j]
            parts = [self._tokens[i] for i in doc_ids.tolist()]
            tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            micro_batches.append({"tokens": tokens, "doc_lens": doc_lens, "doc_ids": doc_ids})
        tokens_of = self._tokens
        for i in np.concatenate(plan.doc_ids).tolist():
            del tokens_of[i]
        self._prune()
        stats = dict(plan.stats)
        stats["step"] = plan.step
        if self.schedule is not None:
            stats["cost_attn_coef"] = self.packer.cost_model.attn_coef
            stats["cost_linear_coef"] = self.packer.cost_model.linear_coef
        return {"micro_batches": micro_batches, "stats": stats}

    # ------------------------------------------------------------------ DocumentStream
    @property
    def exhausted(self) -> bool:
        """Whether the data has ended for the packer (it is flushed from then on)."""
        return self._exhausted

    def pull(self, budget: int, horizon: int) -> tuple[np.ndarray, np.ndarray]:
        """The next documents by the budget rule, read-ahead first, keeping their tokens.

        Then reads ahead until ``horizon`` tokens wait or the source ends; when the source ends
        with fewer than ``horizon`` tokens left, those join this pull and the data ends here. The
        source's state before the pull's reads is recorded so that a restore can replay them.
        """
        ids: list[int] = []
        lens: list[int] = []
        if budget <= 0 or self._exhausted:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        snapshot = self.source.state_dict()
        read: list[int] = []
        got = 0
        while got < budget and self._ahead:
            doc_id, n = self._ahead.popleft()
            ids.append(doc_id)
            lens.append(n)
            got += n
        self._ahead_tokens -= got
        while got < budget and not self._source_done:
            doc = self._read()
            if doc is not None:
                read.append(doc[0])
                ids.append(doc[0])
                lens.append(doc[1])
                got += doc[1]
        while self._ahead_tokens < horizon and not self._source_done:
            doc = self._read()
            if doc is not None:
                read.append(doc[0])
                self._ahead.append(doc)
                self._ahead_tokens += doc[1]
        if self._source_done and self._ahead_tokens < horizon:
            for doc_id, n in self._ahead:  # less than a step is left: it ends the data now
                ids.append(doc_id)
                lens.append(n)
            self._ahead.clear()
            self._ahead_tokens = 0
            self._exhausted = True
        if read:
            self._snapshots.append((self.packer.steps_done, snapshot, len(read)))
            self._snapshot_ids.append(np.asarray(read, np.int64))
        return np.asarray(ids, np.int64), np.asarray(lens, np.int64)

    def _read(self) -> tuple[int, int] | None:
        """One document from the source (its tokens kept), or None when the source has ended."""
        try:
            item = next(self.source)
        except StopIteration:
            self._source_done = True
            return None
        doc_id, tokens = self._check(item)
        self._tokens[doc_id] = tokens
        return doc_id, tokens.size

    # ------------------------------------------------------------------ helpers
    def _rank_micro_batches(self, doc_lens: list[np.ndarray]) -> np.ndarray:
        """The plan's micro-batches this DP rank trains, ``N // dp`` of them.

        ``original`` keeps TorchTitan's contiguous slices (it is the baseline); the other packers'
        plans are dealt to DP ranks by workload (:func:`~torchtitan_wlb.packing.placement.dp_order`)
        so that every rank's total is as even as the micro-batches allow.
        """
        sizes = np.fromiter(map(len, doc_lens), np.int64, len(doc_lens))
        costs = self.packer.cost_model.doc_cost(np.concatenate(doc_lens))
        loads = np.bincount(np.repeat(np.arange(sizes.size), sizes), costs, minlength=sizes.size)
        order = dp_order(loads, self.dp_degree, balanced=self.packer.name != "original")
        lo = self.dp_rank * self._per_rank
        return order[lo : lo + self._per_rank]

    def _check(self, item: Any) -> tuple[int, np.ndarray]:
        if not isinstance(item, dict) or "doc_id" not in item or "tokens" not in item:
            raise ValueError(
                "the document stream must yield dicts with 'doc_id' and 'tokens', got "
                f"{type(item).__name__}"
            )
        doc_id = int(item["doc_id"])
        tokens = item["tokens"]
        if not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size < 1 or tokens.dtype.kind not in "iu":
            raise ValueError(
                f"document {doc_id}: tokens must be a 1-D integer array of length >= 1, got "
                f"shape {tokens.shape} dtype {tokens.dtype}"
            )
        if tokens.size > self.packer.cap:
            raise ValueError(
                f"document {doc_id} has {tokens.size} tokens, more than the micro-batch cap "
                f"{self.packer.cap}; split long documents in the loader (max_doc_len)"
            )
        if doc_id in self._tokens:
            raise ValueError(f"document id {doc_id} appears twice among pending documents")
        return doc_id, tokens.astype(np.int64, copy=False)

    def _prune(self) -> None:
        """Drop the snapshots of pulls none of whose documents is still held."""
        if not self._tokens:
            self._snapshots, self._snapshot_ids = [], []
            return
        held = np.fromiter(self._tokens, np.int64, len(self._tokens))
        keep = len(self._snapshots)
        for i, read in enumerate(self._snapshot_ids):
            if np.isin(read, held).any():
                keep = i
                break
        del self._snapshots[:keep], self._snapshot_ids[:keep]

    def _replay(self, held: dict[int, int]) -> None:
        """Re-read the pulls since the oldest held document was read; keep the held documents."""
        if not held:
            return
        if not self._snapshots:
            raise ValueError("checkpoint holds documents but no source snapshots")
        self.source.reset(self._snapshots[0][1])
        for _, _, count in self._snapshots:
            read = np.empty(count, np.int64)
            for k in range(count):
                item = next(self.source)
                doc_id = int(item["doc_id"])
                read[k] = doc_id
                if doc_id in held:
                    tokens = np.asarray(item["tokens"]).astype(np.int64, copy=False)
                    if tokens.size != held[doc_id]:
                        raise RuntimeError(
                            f"replayed document {doc_id} has {tokens.size} tokens, checkpoint "
                            f"says {held[doc_id]}: the source is not deterministic"
                        )
                    self._tokens[doc_id] = tokens
            self._snapshot_ids.append(read)
        missing = set(held) - set(self._tokens)
        if missing:
            raise RuntimeError(
                f"{len(missing)} held documents (e.g. {min(missing)}) were not found when "
                "replaying the source: the source is not deterministic"
            )
