"""Document-length sources for the simulator and the analysis CLI.

A lengths file is a JSON list of token counts, a ``.npy`` array, or a text file with one integer per
line. Anything that is not a positive integer is rejected with the offending value and its position:
a simulator fed silently-rounded lengths would predict the wrong imbalance.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _check_integers(values: list | np.ndarray, source: str) -> np.ndarray:
    arr = np.asarray(values)
    if isinstance(values, list) and not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        arr = np.asarray(values, dtype=object)  # mixed or non-numeric: find the offending entry
    if isinstance(values, list) and any(isinstance(v, bool) for v in values):
        arr = np.asarray(values, dtype=object)  # JSON true/false are not token counts
    if arr.ndim != 1:
        raise ValueError(
            f"lengths file {source}: expected a flat list of integers, got shape {arr.shape}"
        )
    if arr.size == 0:
        raise ValueError(f"lengths file {source}: no document lengths")
    if arr.dtype == object:
        for i, v in enumerate(arr.tolist()):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(
                    f"lengths file {source}: entry {i} = {v!r} is not an integer token count"
                )
        arr = np.asarray(arr.tolist(), dtype=np.int64)
    elif not np.issubdtype(arr.dtype, np.integer):
        bad = np.flatnonzero(~np.isfinite(arr.astype(np.float64)) | (arr != np.round(arr)))
        if bad.size or not np.issubdtype(arr.dtype, np.floating):
            i = int(bad[0]) if bad.size else 0
            raise ValueError(
                f"lengths file {source}: entry {i} = {arr[i].item()!r} is not an integer token count"
            )
        arr = arr.astype(np.int64)
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"lengths file {source}: entry {i} = {int(arr[i])} is not a positive token count"
        )
    return arr


def load_lengths(path: str | Path) -> np.ndarray:
    """Read document lengths (int64, all >= 1) from JSON, .npy or one-integer-per-line text."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"lengths file {str(path)!r} does not exist")
    if p.suffix == ".npy":
        return _check_integers(np.load(p, allow_pickle=False), str(path))
    text = p.read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"lengths file {path}: invalid JSON ({exc.msg} at line {exc.lineno})"
            ) from None
        if not isinstance(values, list):
            raise ValueError(f"lengths file {path}: expected a JSON list of integers")
        return _check_integers(values, str(path))
    values: list = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        token = line.strip()
        if not token:
            continue
        try:
            values.append(int(token))
        except ValueError:
            raise ValueError(
                f"lengths file {path}: line {lineno} = {token!r} is not an integer token count"
            ) from None
    return _check_integers(values, str(path))


def split_long(lengths: np.ndarray, max_doc_len: int) -> np.ndarray:
    """Apply the loader's "split" policy: a document longer than ``max_doc_len`` becomes consecutive
    pieces of ``max_doc_len`` tokens, the last one shorter (vectorised, order preserved)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if max_doc_len < 1:
        raise ValueError(f"max_doc_len = {max_doc_len} must be >= 1")
    pieces = -(-lengths // max_doc_len)
    if (pieces == 1).all():
        return lengths
    out = np.full(int(pieces.sum()), max_doc_len, dtype=np.int64)
    last = np.cumsum(pieces) - 1
    out[last] = lengths - (pieces - 1) * max_doc_len
    return out


def cut_stream(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """TorchTitan's loader: concatenate the documents and cut the token stream every ``seq_len``.

    ``torchtitan.hf_datasets.text_datasets`` appends every document's tokens to one buffer and
    yields consecutive ``seq_len``-token windows, so a document that straddles a window boundary is
    cut there and its continuation opens the next sequence (with document masking, as a separate
    document). Returns the pieces in stream order: every ``seq_len`` consecutive tokens of them
    form exactly one sequence (vectorised: the cut points are the documents' ends together with the
    multiples of ``seq_len``).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if seq_len < 1:
        raise ValueError(f"seq_len = {seq_len} must be >= 1")
    ends = np.cumsum(lengths)
    if ends.size == 0:
        return lengths
    cuts = np.union1d(ends, np.arange(seq_len, int(ends[-1]), seq_len, dtype=np.int64))
    return np.diff(cuts, prepend=0)


def cycle_to(
    lengths: np.ndarray, n_tokens: int, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Enough documents for ``n_tokens`` tokens: the lengths in order, repeated (reshuffled with
    ``rng`` on each repeat when given) until the total reaches ``n_tokens``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    reps = max(1, -(-n_tokens // total))
    parts = [lengths]
    for _ in range(reps - 1):
        parts.append(rng.permutation(lengths) if rng is not None else lengths)
    out = np.concatenate(parts)
    cut = int(np.searchsorted(np.cumsum(out), n_tokens)) + 1
    return out[: min(cut, out.size)]
