"""torchdata node that packs a document stream into per-step micro-batches with a packer.

Input: a ``BaseNode`` yielding ``{"doc_id": int, "tokens": np.ndarray[int64]}`` (the document
stream). Output: one item per optimizer step,

    {"micro_batches": [{"tokens", "doc_lens", "doc_ids"}, ...],  # this DP rank's N // dp
     "stats": {...}}                                              # the global plan's metrics

Every DP rank runs the same node on the same global stream and computes the same global plan
(packers are deterministic) and keeps its ``N // dp`` micro-batches: contiguous slices for the
``original`` baseline, workload-balanced dealing for the other packers (``_rank_micro_batches``).
No communication is needed, and a rank's checkpoint is enough to resume it.

Checkpointing (``state_dict`` / ``reset``): the packer's state lists the pending documents (ids,
lengths, arrival steps) but the node does not store their *tokens*. It stores, for every step
since the oldest pending document was pulled, the source's state before that step's intake and how
many documents were pulled. ``reset(state)`` rewinds the source to the oldest snapshot, replays the
pulls and keeps the pending documents' tokens, then restores the source's latest state. Why: a
queue can hold ``levels * N`` documents of up to ``S_max`` tokens (tens of MB per rank at 128K
context), replicated in every DP rank's checkpoint, while the snapshots are a few source states
(one per step the oldest pending document has waited, at most the longest wait + 2). The price
is re-reading that many steps of documents on restore, and the source must be deterministic under ``reset(state)`` (torchdata's
contract); the replayed documents are checked against the stored ids and lengths.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from torchtitan_wlb.packing import Packer
from torchtitan_wlb.packing.driver import next_plan, pull_until
from torchtitan_wlb.packing.placement import dp_order

__all__ = ["WLBPackingNode"]


class WLBPackingNode(BaseNode[dict]):
    """Packs documents into ``N`` micro-batches per step and yields this DP rank's share."""

    SOURCE_KEY = "source"
    PACKER_KEY = "packer"

    def __init__(
        self, source: BaseNode, packer: Packer, *, dp_rank: int = 0, dp_degree: int = 1
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
        self._per_rank = n // dp_degree
        self._initial_packer_state = packer.state_dict()
        self._tokens: dict[int, np.ndarray] = {}
        self._snapshots: list[tuple[int, dict[str, Any], int]] = []
        self._exhausted = False

    # ------------------------------------------------------------------ BaseNode
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._tokens = {}
        if initial_state is None:
            self.source.reset(None)
            self.packer.load_state_dict(self._initial_packer_state)
            self._snapshots = []
            self._exhausted = False
            return
        self.packer.load_state_dict(initial_state[self.PACKER_KEY])
        self._exhausted = bool(initial_state["exhausted"])
        self._snapshots = [(int(s), st, int(k)) for s, st, k in initial_state["snapshots"]]
        pending = self.packer.pending()
        if len(pending):
            self._replay(pending)
        self.source.reset(initial_state[self.SOURCE_KEY])

    def get_state(self) -> dict[str, Any]:
        return {
            self.SOURCE_KEY: self.source.state_dict(),
            self.PACKER_KEY: self.packer.state_dict(),
            "snapshots": [[s, st, k] for s, st, k in self._snapshots],
            "exhausted": self._exhausted,
        }

    def next(self) -> dict[str, Any]:
        plan = next_plan(self.packer, self)
        if plan is None:
            raise StopIteration
        micro_batches = []
        for j in self._rank_micro_batches(plan.doc_lens).tolist():
            doc_ids, doc_lens = plan.doc_ids[j], plan.doc_lens[j]
            parts = [self._tokens[i] for i in doc_ids.tolist()]
            tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            micro_batches.append({"tokens": tokens, "doc_lens": doc_lens, "doc_ids": doc_ids})
        for arr in plan.doc_ids:
            for i in arr.tolist():
                del self._tokens[i]
        self._prune()
        stats = dict(plan.stats)
        stats["step"] = plan.step
        return {"micro_batches": micro_batches, "stats": stats}

    # ------------------------------------------------------------------ DocumentStream
    @property
    def exhausted(self) -> bool:
        """Whether the source has ended (the packer is flushed from then on)."""
        return self._exhausted

    def pull(self, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """Pull documents from the source by the budget rule, keeping their tokens; record the
        source's state before the pull so that a restore can replay it."""
        ids: list[int] = []
        lens: list[int] = []
        if budget > 0 and not self._exhausted:
            snapshot = self.source.state_dict()

            def one() -> int | None:
                try:
                    item = next(self.source)
                except StopIteration:
                    return None
                doc_id, tokens = self._check(item)
                self._tokens[doc_id] = tokens
                ids.append(doc_id)
                lens.append(tokens.size)
                return tokens.size

            self._exhausted = pull_until(budget, one)
            self._snapshots.append((self.packer.steps_done, snapshot, len(ids)))
        return np.asarray(ids, np.int64), np.asarray(lens, np.int64)

    # ------------------------------------------------------------------ helpers
    def _rank_micro_batches(self, doc_lens: list[np.ndarray]) -> np.ndarray:
        """The plan's micro-batches this DP rank trains, ``N // dp`` of them.

        ``original`` keeps TorchTitan's contiguous slices (it is the baseline); the other packers'
        plans are dealt to DP ranks by workload (:func:`~torchtitan_wlb.packing.placement.dp_order`)
        so that every rank's total is as even as the micro-batches allow.
        """
        cost = self.packer.cost_model
        loads = np.array([float(cost.doc_cost(lens).sum()) for lens in doc_lens])
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
        tokens = np.asarray(item["tokens"])
        if tokens.ndim != 1 or tokens.size < 1 or not np.issubdtype(tokens.dtype, np.integer):
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
        """Drop snapshots older than the oldest pending document's intake step."""
        pending = self.packer.pending()
        if len(pending) == 0:
            self._snapshots = []
            return
        oldest = int(pending.pulled.min())
        self._snapshots = [s for s in self._snapshots if s[0] >= oldest]

    def _replay(self, pending) -> None:
        """Re-read the pulls since the oldest pending pull; keep the pending documents."""
        want = dict(zip(pending.ids.tolist(), pending.lens.tolist(), strict=True))
        if not self._snapshots:
            raise ValueError("checkpoint has pending documents but no source snapshots")
        self.source.reset(self._snapshots[0][1])
        for _, _, count in self._snapshots:
            for _ in range(count):
                item = next(self.source)
                doc_id = int(item["doc_id"])
                if doc_id in want:
                    tokens = np.asarray(item["tokens"]).astype(np.int64, copy=False)
                    if tokens.size != want[doc_id]:
                        raise RuntimeError(
                            f"replayed document {doc_id} has {tokens.size} tokens, checkpoint "
                            f"says {want[doc_id]}: the source is not deterministic"
                        )
                    self._tokens[doc_id] = tokens
        missing = set(want) - set(self._tokens)
        if missing:
            raise RuntimeError(
                f"{len(missing)} pending documents (e.g. {min(missing)}) were not found when "
                "replaying the source: the source is not deterministic"
            )
