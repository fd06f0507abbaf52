"""What every tool's command line shares: one error style, examples in ``--help``, one progress bar.

- :class:`ToolParser` is argparse's parser with two changes: a bad command line (an unknown flag, a
  value out of range, an unreadable lengths file reported through ``parser.error``) is one line,
  ``<prog>: error: <message>``, on stderr and exit status 2 -- not argparse's usage block; and
  :meth:`ToolParser.from_doc` takes the description and the ``--help`` examples from the tool's
  module docstring, whose indented ``python -m ...`` lines are the examples (a test parses each
  one with the tool's parser, so they stay runnable).
- :func:`progress` is tqdm's bar on stderr, shown only when stderr is a terminal, so piped or
  captured output (CI, ``--json`` consumers) stays clean.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from tqdm import tqdm


class ToolParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line and exit status 2; examples in ``--help`` keep
    their line breaks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    @classmethod
    def from_doc(cls, module: str, doc: str, **kwargs: Any) -> ToolParser:
        """The parser of ``python -m <module>``: first docstring line as description, the
        docstring's example lines as the ``--help`` epilog."""
        lines = examples(doc)
        return cls(
            prog=f"python -m {module}",
            description=doc.strip().splitlines()[0],
            epilog="examples:\n" + "\n".join(f"  {line}" for line in lines) if lines else None,
            **kwargs,
        )

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def examples(doc: str) -> list[str]:
    """The example commands of a tool's docstring: its indented lines starting ``python -m``,
    with backslash-continued lines joined (a trailing ``# comment`` kept)."""
    out: list[str] = []
    pending = ""
    for raw in doc.splitlines():
        line = raw.strip()
        if pending:
            pending += " " + line
        elif raw.startswith("    python -m "):
            pending = line
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        out.append(re.sub(r"\s+", " ", pending))
        pending = ""
    return out


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    """A one-line progress bar on stderr; silent when stderr is not a terminal."""
    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("disable", None)  # tqdm: off when the stream is not a TTY
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)
