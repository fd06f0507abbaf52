"""Generate docs/configuration.md from the ``[wlb]`` dataclass, so the reference never drifts.

    python -m torchtitan_wlb.tools.config_doc > docs/configuration.md

Each field is documented once, by the docstring under it in :class:`torchtitan_wlb.config.WLB` or
its nested tables (``[wlb.online]``, ``[wlb.advanced]``); a test checks that the committed page
equals the generated one.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path

from torchtitan_wlb import config
from torchtitan_wlb.tools.cli import ToolParser

HEADER = Path(__file__).with_name("configuration_header.md")
"""The page's opening: what enables the section, and the TorchTitan fields it works with."""


def field_docs(table: type) -> dict[str, str]:
    """Docstring under each field of ``table``, read from the source (Python keeps none at run
    time)."""
    body = ast.parse(inspect.getsource(table)).body[0].body
    return {
        node.target.id: " ".join(nxt.value.value.split())
        for node, nxt in zip(body, body[1:], strict=False)
        if isinstance(node, ast.AnnAssign)
        and isinstance(nxt, ast.Expr)
        and isinstance(getattr(nxt.value, "value", None), str)
    }


def render() -> str:
    """The page: the header, then each table's settings (``[wlb]``'s own, ``[wlb.online]``,
    ``[wlb.advanced]``), each nested table introduced by the docstring of its ``[wlb]`` field."""
    lines = [HEADER.read_text()]
    intros = field_docs(config.WLB)
    nested = {f.type: f.name for f in dataclasses.fields(config.WLB) if f.type in config.TABLES}
    for table in config.TABLES:
        lines.append(f"## `[{table.TOML_TABLE}]`\n")
        if table in nested:
            lines.append(textwrap.fill(intros[nested[table]], width=100) + "\n")
        docs, default = field_docs(table), table()
        for f in config.settings(table):
            value = getattr(default, f.name)
            choices = config.choice_values(f.type)
            type_name = " | ".join(map(repr, choices)) or getattr(f.type, "__name__", str(f.type))
            lines.append(f"### `{f.name}` — `{type_name}`, default `{value!r}`\n")
            lines.append(textwrap.fill(docs.get(f.name, "(undocumented)"), width=100) + "\n")
    return "\n".join(lines)


def parser() -> ToolParser:
    """No options: ``--help`` and the one-line error for a stray argument."""
    return ToolParser.from_doc("torchtitan_wlb.tools.config_doc", __doc__)


def main(argv: list[str] | None = None) -> int:
    parser().parse_args(argv)
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
