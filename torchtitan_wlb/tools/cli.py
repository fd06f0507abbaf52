"""What every tool's command line shares: one error style and one progress bar.

- :class:`ToolParser` is argparse's parser with one change: a bad command line (an unknown flag, a
  value out of range, an unreadable lengths file reported through ``parser.error``) is one line,
  ``<prog>: error: <message>``, on stderr and exit status 2 -- not argparse's usage block.
- :func:`progress` is tqdm's bar on stderr, shown only when stderr is a terminal, so piped or
  captured output (CI, ``--json`` consumers) stays clean.
"""

from __future__ import annotations

import argparse
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

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    """A one-line progress bar on stderr; silent when stderr is not a terminal."""
    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("disable", None)  # tqdm: off when the stream is not a TTY
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)
