"""What every tool's command line shares: one-line errors (exit status 2), ``--help`` examples
from the module docstring (a test parses each), range checks, a progress bar only on a terminal.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from tqdm import tqdm


class ToolParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line and exit status 2."""

    @classmethod
    def from_doc(cls, module: str, doc: str) -> ToolParser:
        """The parser of ``python -m <module>``, the docstring's examples as its epilog."""
        lines = examples(doc)
        return cls(
            prog=f"python -m {module}",
            description=doc.strip().splitlines()[0],
            epilog="examples:\n" + "\n".join(f"  {line}" for line in lines) if lines else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,  # examples keep their lines
        )

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def examples(doc: str) -> list[str]:
    """The example commands of a tool's docstring: its indented lines starting ``python -m``,
    with backslash-continued lines joined (a trailing ``# comment`` kept)."""
    joined = re.sub(r"[ \t]*\\[ \t]*\n[ \t]*", " ", doc)
    lines = [line for line in joined.splitlines() if line.startswith("    python -m ")]
    return [re.sub(r"\s+", " ", line.strip()) for line in lines]


def require_at_least(
    parser: argparse.ArgumentParser, args: argparse.Namespace, names: Iterable[str]
) -> None:
    """``parser.error`` naming the first flag of ``names`` (argparse dests) below 1."""
    for name in names:
        if (value := getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')} = {value} must be >= 1")


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    """A one-line progress bar on stderr; silent when stderr is not a terminal."""
    # disable=None: tqdm's "off when the stream is not a TTY"
    defaults = {"file": sys.stderr, "disable": None, "leave": False, "dynamic_ncols": True}
    return tqdm(iterable, **{**defaults, **kwargs})


def json_text(obj: Any, indent: int | None = None) -> str:
    """``obj`` as strict JSON: a figure that could not be computed (NaN, an infinity) is ``null``.
    ``json.dumps`` would write ``NaN``, which is not JSON and which ``jq`` and most parsers
    outside Python refuse."""
    return json.dumps(_finite_or_none(obj), indent=indent, allow_nan=False)


def _finite_or_none(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _finite_or_none(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(value) for value in obj]
    return obj
