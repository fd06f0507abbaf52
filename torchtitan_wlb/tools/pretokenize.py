"""Tokenize a text dataset once into a Megatron indexed corpus (PREFIX.bin + PREFIX.idx).

    python -m torchtitan_wlb.tools.pretokenize outputs/corpus/builtin --dataset wlb_builtin --json
    python -m torchtitan_wlb.tools.pretokenize data/web --dataset jsonl --dataset-path data/web.jsonl \\
        --hf-assets-path assets/tokenizer --workers 8

Train from it with ``[training] dataset = "indexed"`` and ``dataset_path = PREFIX``. The tokens are
stored in the smallest dtype that holds the vocabulary; ``PREFIX.tokenizer.json`` records the
tokenizer, and a run with another is refused. The files are written under a temporary name and
renamed at the end, the index last: an interrupted run leaves no corpus that reads as whole.
docs/data.md gives the options and the throughput.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import struct
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

from torchtitan_wlb.data.sources import BUILTIN_NAME, DataError, TextSource
from torchtitan_wlb.tools.cli import ToolParser, json_text, progress, require_at_least

# The reader and the tokenizer import torchdata and TorchTitan (seconds): imported where used, so
# that --help and a bad argument answer at once.

CHUNK_TEXTS = 64
"""Texts per task handed to a worker: large enough to amortise the transfer, small enough that
the progress bar moves."""

_tokenizer: Any = None  # each worker's, built once by ``_init_worker``


def _init_worker(hf_assets_path: str) -> None:
    global _tokenizer
    from torchtitan_wlb.data.tokenizer import build_wlb_tokenizer

    job = SimpleNamespace(model=SimpleNamespace(hf_assets_path=hf_assets_path))
    _tokenizer = build_wlb_tokenizer(job)


def _encode(task: tuple[int, list[str], int, str]) -> tuple[list[np.ndarray], int]:
    """A chunk of texts (first text number, texts, max_doc_len, policy) -> int64 token arrays,
    and the chunk's text bytes (the progress bar's unit)."""
    first, texts, max_len, policy = task
    out = []
    for i, text in enumerate(texts):
        ids = np.asarray(_tokenizer.encode(text, add_bos=True, add_eos=True), np.int64)
        if max_len and ids.size > max_len:
            if policy == "error":
                raise DataError(
                    f"document {first + i} has {ids.size} tokens > --max-doc-len {max_len} "
                    "(use --long-doc-policy split or truncate)"
                )
            if policy == "truncate":
                ids = ids[:max_len]
        out.append(ids)
    return out, sum(len(t.encode("utf-8")) for t in texts)


def _tasks(source: TextSource, args: Any) -> Iterator[tuple[int, list[str], int, str]]:
    texts = (text for _, text in source.open_texts())
    for n in itertools.count(0, CHUNK_TEXTS):
        chunk = list(itertools.islice(texts, CHUNK_TEXTS))
        if not chunk:
            return
        yield n, chunk, args.max_doc_len, args.long_doc_policy


def _source_bytes(source: TextSource) -> int | None:
    """The text size the progress bar counts towards (None: unknown, a Hugging Face stream)."""
    if source.kind == BUILTIN_NAME:
        return sum(len(t.encode("utf-8")) for _, t in source.open_texts())
    if source.kind == "hf":
        return None
    return sum(os.path.getsize(f) for f in source.files())


def write_index(path: str, dtype: np.dtype, seq_lens: np.ndarray) -> None:
    """A Megatron ``.idx`` of one sequence per document, for tokens written back to back."""
    from torchtitan_wlb.data.indexed import MAGIC, VERSION, code_of

    lens = np.asarray(seq_lens, np.int32)
    pointers = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)[:-1]]) * dtype.itemsize
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, code_of(dtype), lens.size, lens.size + 1))
        f.write(lens.tobytes())
        f.write(pointers.astype(np.int64).tobytes())
        f.write(np.arange(lens.size + 1, dtype=np.int64).tobytes())


def pretokenize(args: Any) -> dict[str, Any]:
    """Write the corpus; return the figures of the JSON line. A failed or interrupted run
    removes its temporary files and leaves no ``PREFIX.idx``."""
    from torchtitan_wlb.data.indexed import RECORD_SUFFIX

    tmp = f"{args.prefix}.tmp-{os.getpid()}"
    try:
        return _write(args, tmp)
    finally:
        for suffix in (".bin", ".idx", RECORD_SUFFIX):
            if os.path.exists(tmp + suffix):
                os.remove(tmp + suffix)


def _write(args: Any, tmp: str) -> dict[str, Any]:
    """Write the corpus through the temporary prefix ``tmp``; return the JSON line's figures."""
    from torchtitan_wlb.data.indexed import RECORD_SUFFIX, smallest_dtype
    from torchtitan_wlb.data.tokenizer import tokenizer_record

    source = TextSource(args.dataset, args.dataset_path, args.text_field)
    _init_worker(args.hf_assets_path)
    vocab = _tokenizer.get_vocab_size()
    dtype = smallest_dtype(vocab)
    os.makedirs(os.path.dirname(os.path.abspath(args.prefix)), exist_ok=True)
    lens: list[int] = []
    max_token, tokens = -1, 0
    start = time.perf_counter()
    ctx = multiprocessing.get_context("fork")
    with (
        open(tmp + ".bin", "wb") as out,
        ctx.Pool(args.workers, _init_worker, (args.hf_assets_path,)) as pool,
        progress(total=_source_bytes(source), unit="B", unit_scale=True, desc="pretokenize") as bar,
    ):
        for arrays, nbytes in pool.imap(_encode, _tasks(source, args)):
            for ids in arrays:
                out.write(ids.astype(dtype).tobytes())
                lens.append(ids.size)
                max_token = max(max_token, int(ids.max()))
                tokens += ids.size
            elapsed = time.perf_counter() - start
            bar.set_postfix_str(f"{tokens / max(elapsed, 1e-9):,.0f} tokens/s", refresh=False)
            bar.update(nbytes)
    if not lens:
        raise DataError(f"{args.dataset} source {args.dataset_path!r} holds no document")
    seconds = time.perf_counter() - start
    write_index(tmp + ".idx", dtype, np.asarray(lens))
    record = {
        **tokenizer_record(args.hf_assets_path),
        "vocab_size": vocab,
        "max_token": max_token,
        "documents": len(lens),
        "tokens": tokens,
        "source": {"dataset": args.dataset, "dataset_path": args.dataset_path},
        "max_doc_len": args.max_doc_len,
        "long_doc_policy": args.long_doc_policy,
    }
    with open(tmp + RECORD_SUFFIX, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    if os.path.exists(args.prefix + ".idx"):  # an older corpus: unreadable from here on
        os.remove(args.prefix + ".idx")
    for suffix in (RECORD_SUFFIX, ".bin", ".idx"):  # the index last: then the corpus is whole
        os.replace(tmp + suffix, args.prefix + suffix)
    return {
        "prefix": args.prefix,
        "documents": len(lens),
        "tokens": tokens,
        "dtype": dtype.name,
        "workers": args.workers,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "tokens_per_s_per_worker": round(tokens / seconds / args.workers, 1),
    }


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.pretokenize", __doc__)
    p.add_argument("prefix", help="output PREFIX: writes PREFIX.bin, PREFIX.idx and "
                   "PREFIX.tokenizer.json")  # fmt: skip
    p.add_argument("--dataset", required=True,
                   choices=["jsonl", "parquet", "text", "hf", BUILTIN_NAME])  # fmt: skip
    p.add_argument("--dataset-path", default="", help="as [training] dataset_path")
    p.add_argument("--text-field", default="text", help="as [wlb.advanced] text_field")
    p.add_argument("--hf-assets-path", default="",
                   help="as [model] hf_assets_path (a tokenizer.json directory); "
                   "empty: the built-in byte tokenizer")  # fmt: skip
    p.add_argument("--max-doc-len", type=int, default=0,
                   help="with --long-doc-policy truncate or error: the longest document kept "
                   "whole; 0: no limit (training cuts long documents as [wlb] long_doc_policy "
                   "says)")  # fmt: skip
    p.add_argument("--long-doc-policy", default="split", choices=["split", "truncate", "error"],
                   help="split: store whole documents (training splits them)")  # fmt: skip
    p.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                   help="tokenizing processes (default: the CPU count, at most 8)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    require_at_least(p, args, ["workers"])
    if args.max_doc_len < 0:
        p.error(f"--max-doc-len = {args.max_doc_len} must be >= 0")
    try:
        result = pretokenize(args)
    except (DataError, ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(json_text(result) if args.json else
          f"wrote {result['prefix']}.bin/.idx: {result['documents']:,} documents, "
          f"{result['tokens']:,} {result['dtype']} tokens, {result['tokens_per_s']:,.0f} tokens/s "
          f"({result['workers']} workers)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
