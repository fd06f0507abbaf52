"""Document-length workloads: generators, length files and the loader's long-document policies,
shared by every tool and the simulator (docs/benchmarks.md). Pure NumPy."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

DEFAULT_NUM_DOCS = 200_000
"""Documents a generator draws when a tool is not told otherwise."""


def _longtail(rng: np.random.Generator, num_docs: int, context_len: int) -> np.ndarray:
    body = rng.lognormal(mean=math.log(3000), sigma=0.9, size=num_docs)
    low = min(16384, max(1, context_len // 8))
    tail = np.exp(rng.uniform(math.log(low), math.log(context_len), size=num_docs))
    return np.where(rng.random(num_docs) < 0.03, tail, body)


def _longtail_scaled(rng: np.random.Generator, num_docs: int, context_len: int) -> np.ndarray:
    body = rng.lognormal(mean=np.log(max(context_len / 40, 2)), sigma=1.0, size=num_docs)
    tail = context_len / 8 * (1 + rng.pareto(1.2, size=num_docs))
    return np.where(rng.random(num_docs) < 0.03, tail, body)


def _bimodal(rng: np.random.Generator, num_docs: int, context_len: int) -> np.ndarray:
    short = rng.normal(2048, 512, size=num_docs)
    long = rng.uniform(0.6 * context_len, context_len, size=num_docs)
    return np.where(rng.random(num_docs) < 0.03, long, short)


GENERATORS: dict[str, Callable[[np.random.Generator, int, int], np.ndarray]] = {
    "longtail": _longtail,
    "longtail_scaled": _longtail_scaled,
    "pareto": lambda rng, n, context_len: 512 * (1 + rng.pareto(1.1, size=n)),
    "bimodal": _bimodal,
    "short": lambda rng, n, context_len: rng.integers(1, max(2, context_len // 500) + 1, size=n),
}
"""Synthetic length distributions by name (described in docs/benchmarks.md)."""


def generate(name: str, num_docs: int, context_len: int, seed: int = 0) -> np.ndarray:
    """``num_docs`` int64 lengths in ``[1, context_len]`` from ``name``, deterministic in ``seed``."""
    if name not in GENERATORS:
        raise ValueError(f"unknown generator {name!r}; accepted: {', '.join(GENERATORS)}")
    if num_docs < 1 or context_len < 1:
        raise ValueError(
            f"generator {name!r}: num_docs = {num_docs} and context_len = {context_len} must be >= 1"
        )
    out = GENERATORS[name](np.random.default_rng(seed), num_docs, context_len)
    return np.clip(np.rint(out), 1, context_len).astype(np.int64)


def _check_integers(values: list | np.ndarray, source: str) -> np.ndarray:
    """``values`` as int64 if every entry is a positive integer, else a ValueError naming the first
    offending entry (integral floats such as ``3.0`` pass; booleans do not)."""
    where = f"lengths file {source}"
    try:
        arr = np.asarray(values)
    except ValueError:  # a ragged list: the loop below names the entry that is not a number
        arr = np.asarray(values, dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"{where}: expected a flat list of integers, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{where}: no document lengths")
    if isinstance(values, list) or arr.dtype.kind not in "iu":  # a list may hide true / false
        for i, v in enumerate(values if isinstance(values, list) else arr.tolist()):
            whole = isinstance(v, float) and math.isfinite(v) and v.is_integer()
            if isinstance(v, bool) or not (isinstance(v, int) or whole):
                raise ValueError(f"{where}: entry {i} = {v!r} is not an integer token count")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: entry {i} = {int(arr[i])} is not a positive token count")
    return arr


def load_lengths(path: str | Path) -> np.ndarray:
    """Document lengths (int64, all >= 1) from a JSON list, ``.npy`` or whitespace-separated text;
    any problem is one ValueError naming the file and the entry (silent rounding would mislead)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"lengths file {str(path)!r}: no such file")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ValueError(f"lengths file {path}: not a readable .npy array ({exc})") from None
        return _check_integers(arr, str(path))
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"lengths file {path}: cannot read it as text ({exc})") from None
    if p.suffix == ".json" or text.lstrip().startswith("["):
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
        for token in line.split():
            try:
                values.append(int(token))
            except ValueError:
                raise ValueError(
                    f"lengths file {path}: line {lineno} = {token!r} is not an integer token count"
                ) from None
    return _check_integers(values, str(path))


def split_long(lengths: np.ndarray, max_doc_len: int) -> np.ndarray:
    """The loader's "split" policy: a document longer than ``max_doc_len`` becomes consecutive
    pieces of ``max_doc_len`` tokens, the last one shorter (vectorised, order preserved)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if max_doc_len < 1:
        raise ValueError(f"max_doc_len = {max_doc_len} must be >= 1")
    pieces = -(-lengths // max_doc_len)
    if (pieces == 1).all():
        return lengths
    out = np.full(int(pieces.sum()), max_doc_len, dtype=np.int64)
    out[np.cumsum(pieces) - 1] = lengths - (pieces - 1) * max_doc_len  # each last piece
    return out


def long_documents(lengths: np.ndarray, context_len: int) -> np.ndarray:
    """Which documents are long: more than half the context. Two of them never share a sequence,
    which is what makes them hard to pack; two of exactly half do fit one (so they are not long)."""
    return np.asarray(lengths) > context_len // 2


def long_token_share(lengths: np.ndarray, context_len: int) -> float:
    """The share of the tokens that are in long documents (:func:`long_documents`)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return float(lengths[long_documents(lengths, context_len)].sum() / lengths.sum())


def cut_stream(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """TorchTitan's loader: the documents concatenated and cut every ``seq_len`` tokens, as pieces
    in stream order (a document straddling a cut continues as another in the next sequence)."""
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
    reps = max(1, -(-n_tokens // int(lengths.sum())))
    again = [rng.permutation(lengths) if rng is not None else lengths for _ in range(reps - 1)]
    out = np.concatenate([lengths, *again])
    cut = int(np.searchsorted(np.cumsum(out), n_tokens)) + 1
    return out[: min(cut, out.size)]


def steps_arg(text: str) -> int | str:
    """argparse type of every tool's ``--steps``: a positive integer, or ``"epoch"`` (one pass)."""
    if text.strip().lower() == "epoch":
        return "epoch"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or 'epoch'")
    return value
