"""Where document texts come from: the built-in corpus, local files, or Hugging Face datasets.

Sources restart at any text number, so a checkpoint keeps a count, not texts. Bad data fails
loudly with the file and line, never a silent skip.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import itertools
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

BUILTIN_NAME = "wlb_builtin"
BUILTIN_HELDOUT_NAME = "wlb_builtin_validation"
"""The built-in corpus's held-out split: ``[validation] dataset``, never read by training."""
HELDOUT_FRACTION = 20
"""The held-out split is the last ``1 / HELDOUT_FRACTION`` of the built-in corpus's texts (327 of
6,544 on Python 3.11): the order is already a seeded shuffle, so the tail is a fair sample."""


class DataError(ValueError):
    """Bad input data: names the file (and line or row) and what was expected."""


_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
_MIN_DOC_CHARS = 40
_CORPUS_VERSION = 1
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def build_builtin_corpus() -> list[str]:
    """Real English text with a long-tailed length mix, from the running Python installation
    (``pydoc_data`` topics and stdlib docstrings in a seeded order; docs/data.md): no download."""
    from pydoc_data.topics import topics

    import numpy as np

    docs = [topics[k] for k in sorted(topics)]
    for root, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            for node in ast.walk(tree):
                doc = ast.get_docstring(node) if isinstance(node, _DOC_NODES) else None
                if doc and len(doc) >= _MIN_DOC_CHARS:
                    docs.append(doc)
    order = np.random.default_rng(20250707).permutation(len(docs))
    return [docs[i] for i in order]


def builtin_split(heldout: bool) -> list[str]:
    """The built-in corpus's training texts, or (``heldout``) its held-out validation texts: two
    disjoint parts whose union is the corpus."""
    docs = builtin_corpus()
    cut = len(docs) - len(docs) // HELDOUT_FRACTION
    return docs[cut:] if heldout else docs[:cut]


def builtin_corpus() -> list[str]:
    """The built-in corpus, built once per Python version and cached under ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    ver = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    path = os.path.join(base, "torchtitan_wlb", f"builtin_corpus_v{_CORPUS_VERSION}_py{ver}.json")
    with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as f:
        return json.load(f)
    docs = build_builtin_corpus()
    with contextlib.suppress(OSError):  # a read-only home still trains; it rebuilds next time
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(docs, f)
        os.replace(tmp, path)  # atomic: concurrent ranks never read a half-written file
    return docs


@dataclass
class TextSource:
    """A restartable stream of document texts."""

    # "wlb_builtin", "wlb_builtin_validation", "jsonl", "parquet", "text", "hf" ("indexed": named,
    # not read here)
    kind: str
    path: str = ""  # file, directory or glob (local kinds); dataset name or local path ("hf")
    text_field: str = "text"  # the field holding the text (jsonl, parquet, hf)
    split: str = "train"  # the Hugging Face split read ("hf"; validation reads "validation")

    def __post_init__(self) -> None:
        if self.kind in (BUILTIN_NAME, BUILTIN_HELDOUT_NAME):
            return
        if self.kind not in ("jsonl", "parquet", "text", "hf", "indexed"):
            raise DataError(
                f"[training] dataset = {self.kind!r} is not accepted; use one of "
                f"'{BUILTIN_NAME}', 'jsonl', 'parquet', 'text', 'hf', 'indexed'"
            )
        if self.kind == "indexed":
            if not self.path:
                raise DataError(
                    "[training] dataset = 'indexed' needs [training] dataset_path = PREFIX "
                    "(of a Megatron corpus, PREFIX.idx + PREFIX.bin)"
                )
            return  # the files are checked when the corpus is opened
        if not self.path:
            raise DataError(
                f"[training] dataset = {self.kind!r} needs [training] dataset_path "
                "(a file, a directory or a glob; for 'hf' a dataset name or local path)"
            )
        if self.kind != "hf" and not self.files():
            raise DataError(
                f"[training] dataset_path = {self.path!r} matches no {self.kind} file "
                f"(looked for {self._pattern()})"
            )

    def _pattern(self) -> str:
        ext = {"jsonl": "*.jsonl", "parquet": "*.parquet", "text": "*.txt"}[self.kind]
        return os.path.join(self.path, "**", ext) if os.path.isdir(self.path) else self.path

    def files(self) -> list[str]:
        """The local files of this source, in sorted (deterministic) order."""
        if os.path.isfile(self.path):
            return [self.path]
        return sorted(f for f in glob.glob(self._pattern(), recursive=True) if os.path.isfile(f))

    def open_texts(self, start: int = 0) -> Iterator[tuple[int, str]]:
        """Yield ``(index, text)`` for every document from number ``start`` on."""
        texts = getattr(self, f"_read_{self.kind}")()
        yield from itertools.islice(enumerate(texts), start, None)

    def _read_wlb_builtin(self) -> Iterator[str]:
        return iter(builtin_split(heldout=False))

    def _read_wlb_builtin_validation(self) -> Iterator[str]:
        return iter(builtin_split(heldout=True))

    def _checked(self, text: object, where: str) -> str:
        if not isinstance(text, str):
            raise DataError(
                f"{where}: field {self.text_field!r} is {type(text).__name__}, expected a string"
            )
        if not text:
            raise DataError(f"{where}: empty document; remove it from the data")
        return text

    def _read_jsonl(self) -> Iterator[str]:
        for path in self.files():
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    where = f"{path}:{lineno}"
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{where}: malformed JSON line ({e.msg})") from None
                    if not isinstance(record, dict) or self.text_field not in record:
                        raise DataError(
                            f"{where}: expected a JSON object with field {self.text_field!r}"
                        )
                    yield self._checked(record[self.text_field], where)

    def _read_text(self) -> Iterator[str]:
        for path in self.files():
            with open(path, encoding="utf-8") as f:
                yield self._checked(f.read(), path)

    def _read_parquet(self) -> Iterator[str]:
        import pyarrow.parquet as pq

        for path in self.files():
            table = pq.ParquetFile(path)
            if self.text_field not in table.schema_arrow.names:
                raise DataError(
                    f"{path}: no column {self.text_field!r} (columns: {table.schema_arrow.names})"
                )
            row = 0
            for batch in table.iter_batches(columns=[self.text_field]):
                for text in batch.column(0).to_pylist():
                    yield self._checked(text, f"{path}: row {row}")
                    row += 1

    def _read_hf(self) -> Iterator[str]:
        from datasets import load_dataset

        ds = load_dataset(self.path, split=self.split, streaming=True)
        for row, record in enumerate(ds):
            if self.text_field not in record:
                raise DataError(
                    f"dataset {self.path!r} row {row}: no field {self.text_field!r} "
                    f"(fields: {sorted(record)})"
                )
            yield self._checked(record[self.text_field], f"dataset {self.path!r} row {row}")
