"""The checkpointed state both document streams share: a handful of counters."""

from __future__ import annotations

from torchdata.nodes import BaseNode

# Each an attribute of the node of the same name (``texts_done``: texts, or documents of the
# epoch's order, read so far; ``pieces_done``: items yielded).
STATE = ("epoch", "texts_done", "pieces_done", "next_doc_id", "truncated_tokens", "truncated_docs")


class CountedNode(BaseNode[dict]):
    """A document stream whose whole state is :data:`STATE`: a resumed stream restores the
    counters and finds its place from them (DocumentNode, IndexedDocumentNode)."""

    def _set_counters(self, state: dict | None) -> None:
        state = dict.fromkeys(STATE, 0) if state is None else state
        for key in STATE:
            setattr(self, key, int(state[key]))

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._set_counters(initial_state)

    def get_state(self) -> dict:
        return {key: getattr(self, key) for key in STATE}
