"""The token arrays a packing node holds, by document id, in sorted parallel arrays.

A node holds ~2-3 steps of documents (read ahead, queued, carried) and every step adds and removes
~1,000 of them. A dict keyed by id costs a Python-level insert and pop per document; here a step is
a handful of NumPy calls over the held ids (docs/packing.md, "The data node's step").
"""

from __future__ import annotations

import numpy as np

_EMPTY_IDS = np.zeros(0, np.int64)
_EMPTY_OBJ = np.zeros(0, object)


class TokenStore:
    """Documents held by id: each one's token array and the serial number of the pull that read
    it. ``ids`` stays sorted, so lookups are one ``searchsorted``; a source whose ids grow (every
    source here) only ever appends."""

    def __init__(self) -> None:
        self.ids = _EMPTY_IDS
        """Held document ids, ascending (unique)."""
        self._tokens = _EMPTY_OBJ  # object array: the token array of ``ids[k]``
        self._pulls = _EMPTY_IDS  # the pull serial of ``ids[k]``

    def __len__(self) -> int:
        return int(self.ids.size)

    def put(self, ids: np.ndarray, arrays: list[np.ndarray], pull: int) -> None:
        """Hold the documents ``ids`` (int64) with their token ``arrays``, read by pull number
        ``pull``. An id given twice, or already held, is an error that names it."""
        if ids.size == 0:
            return
        tokens = np.fromiter(arrays, object, len(arrays))  # no shape inference over the arrays
        pulls = np.full(ids.size, pull, np.int64)
        increasing = ids.size == 1 or bool((ids[1:] > ids[:-1]).all())
        if increasing and (self.ids.size == 0 or ids[0] > self.ids[-1]):
            # The common case: new ids above every held one, in order: append.
            self.ids = np.concatenate([self.ids, ids])
            self._tokens = np.concatenate([self._tokens, tokens])
            self._pulls = np.concatenate([self._pulls, pulls])
            return
        all_ids = np.concatenate([self.ids, ids])
        order = np.argsort(all_ids, kind="stable")
        sorted_ids = all_ids[order]
        dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
        if dup.size:
            # Held ids are unique, so every repeated id is among the new ones: name the first.
            first = int(ids[np.isin(ids, sorted_ids[dup])][0])
            raise ValueError(f"document id {first} appears twice among pending documents")
        self.ids = sorted_ids
        self._tokens = np.concatenate([self._tokens, tokens])[order]
        self._pulls = np.concatenate([self._pulls, pulls])[order]

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remove the documents ``ids`` (unique, any order) and return their token arrays (an
        object array, in the order of ``ids``) and pull serials."""
        if ids.size == 0:
            return _EMPTY_OBJ, _EMPTY_IDS
        pos = np.searchsorted(self.ids, ids)
        found = pos < self.ids.size
        found[found] = self.ids[pos[found]] == ids[found]
        if not found.all():
            missing = int(ids[np.argmin(found)])
            raise RuntimeError(f"document {missing} was emitted but its tokens are not held")
        tokens, pulls = self._tokens[pos], self._pulls[pos]
        keep = np.ones(self.ids.size, bool)
        keep[pos] = False
        self.ids, self._tokens, self._pulls = self.ids[keep], self._tokens[keep], self._pulls[keep]
        return tokens, pulls
