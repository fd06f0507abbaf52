"""Every shell command in README.md and docs/*.md works as written.

A command is a line of a ```bash (or ```sh / ```shell) fenced block; a line ending in ``\\``
continues on the next. Its trailing comment says how it is checked:

- no marker: it runs as written, from the repository root, and must exit 0;
- a comment starting with ``slow``, ``gpu`` or ``data`` (it takes minutes, needs a GPU, or reads
  files that are not in the repository): it runs with ``--help`` appended, which checks that the
  program, its subcommand and the flags before it exist;
- a comment starting with ``cluster`` (SLURM): not run; the files it names must exist.

Usage examples that are not meant to be run as written (templates with placeholders, Python, JSON)
go in other fenced blocks. The commands run two at a time (one process each, two cores), started
ahead of the tests that check them. They run with ``WLB_PYTHON`` set to this interpreter, so
``run_train.sh`` and ``run_tests.sh`` never install anything, and with this checkout first on
``PYTHONPATH``; where the checkout has no ``.venv/`` (an environment brought with ``WLB_PYTHON``),
``.venv/bin/`` means this interpreter's directory, and its console scripts (``wlb-sim``) run this
checkout's entry points.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell"}
HELP_MARKERS = ("slow", "gpu", "data")
SKIP_MARKERS = ("cluster",)
COMMAND_LIMIT_S = 600


@dataclass(frozen=True)
class DocCommand:
    """One documented command: where it is, its text, and the first word of its comment."""

    doc: str
    line: int
    command: str
    marker: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _split_comment(line: str) -> tuple[str, str]:
    """(command, comment) of one logical line: the comment starts at the first unquoted ``#``
    that follows whitespace."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def doc_commands(path: Path) -> list[DocCommand]:
    """The commands of one Markdown file, in order."""
    out: list[DocCommand] = []
    in_shell = in_block = False
    pending, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), start=1):
        fence = re.match(r"^\s*```(\w*)", raw)
        if fence:
            in_block = not in_block
            in_shell = in_block and fence.group(1) in SHELL_BLOCKS
            continue
        if not in_shell:
            continue
        line = raw.strip()
        if not pending:
            if not line or line.startswith("#"):
                continue
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command, comment = _split_comment(pending + line)
        pending = ""
        marker = re.match(r"([a-z]+)(?=$|[\s:,;.])", comment)
        marker = marker.group(1) if marker else ""
        out.append(DocCommand(str(path.relative_to(ROOT)), start, command, marker))
    return out


COMMANDS = [c for doc in DOCS for c in doc_commands(doc)]


def _environment() -> dict[str, str]:
    env = dict(os.environ, WLB_PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


DRY_RUN = "-m torchtitan_wlb.tools.dry_run"
WORKERS = 2  # commands run two at a time: each is one process, CI has two cores


def _help_key(text: str) -> str:
    """Commands whose ``--help`` outcome cannot differ share one check: ``run_train.sh --help``
    prints its usage and the config's fields whatever the other arguments (~10 s each), and
    ``run_tests.sh ARGS --help`` is ``pytest ARGS --help``, which reads no test file (the files
    it names are checked to exist instead)."""
    words = shlex.split(text)
    if "./run_train.sh" in words:
        config = next((w for w in words if w.startswith("CONFIG_FILE=")), "")
        return f"./run_train.sh {config}"
    if words[:1] == ["./run_tests.sh"] and all(not w.startswith("-") for w in words[1:-1]):
        return "./run_tests.sh --help"
    return text


def _dry_run_configs(text: str) -> list[str] | None:
    """The configs of a ``dry_run`` command that names configs only (globs expanded as bash does),
    or None for any other command."""
    if DRY_RUN not in text:
        return None
    words = shlex.split(text.split(DRY_RUN, 1)[1])
    if not words or any(w.startswith("-") for w in words):
        return None
    out = []
    for w in words:
        out += sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(w)) or [w]
    return out


def _console_scripts() -> dict[str, str]:
    """This checkout's console scripts (``[project.scripts]``), as ``python -c`` commands: an
    environment brought with ``WLB_PYTHON`` may hold scripts installed from another checkout."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    out = {}
    for name, target in scripts.items():
        module, func = target.split(":")
        code = (
            f"import sys; from {module} import {func}; sys.argv[0] = {name!r}; sys.exit({func}())"
        )
        out[name] = f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    return out


def _as_run(cmd: DocCommand) -> str:
    text = cmd.command
    if not (ROOT / ".venv" / "bin").is_dir():
        for name, replacement in _console_scripts().items():
            text = re.sub(
                rf"(^|\s)\.venv/bin/{re.escape(name)}(?=\s|$)", rf"\g<1>{replacement}", text
            )
        text = re.sub(r"(^|\s)\.venv/bin/", rf"\g<1>{Path(sys.executable).parent}/", text)
    if cmd.marker in HELP_MARKERS:
        text += " --help"
    return text


def test_the_docs_have_commands():
    assert len(COMMANDS) >= 10
    kinds = {
        "run" if c.marker not in (*HELP_MARKERS, *SKIP_MARKERS) else c.marker for c in COMMANDS
    }
    assert {"run", "slow", "gpu", "cluster"} <= kinds, kinds


def _run(text: str) -> tuple[str, subprocess.CompletedProcess]:
    r = subprocess.run(
        ["bash", "-c", text],
        cwd=ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=COMMAND_LIMIT_S,
    )
    return text, r


class _Runner:
    """Runs the selected commands in their tests' order, ``WORKERS`` at a time and ahead of the
    tests that check them. A command whose outcome an earlier one already decides shares that
    one's result instead of running again: a ``--help`` check with the same :func:`_help_key`,
    and a ``dry_run`` of configs an earlier documented ``dry_run`` builds (it checks each config
    on its own, one OK or FAIL line each, exit 0 when all build; ~10 s of imports a run)."""

    def __init__(self, commands: list[DocCommand]):
        self.pool = ThreadPoolExecutor(WORKERS)
        self.runs: dict[str, list[Future]] = {}
        by_help_key: dict[str, Future] = {}
        by_config: dict[str, Future] = {}
        for cmd in commands:
            if cmd.marker in SKIP_MARKERS:
                continue
            text = _as_run(cmd)
            if cmd.marker in HELP_MARKERS:
                key = _help_key(text)
                if key not in by_help_key:
                    by_help_key[key] = self.pool.submit(_run, text)
                self.runs[cmd.id] = [by_help_key[key]]
                continue
            configs = _dry_run_configs(text) or []
            if configs and set(configs) <= by_config.keys():
                self.runs[cmd.id] = list(dict.fromkeys(by_config[c] for c in configs))
                continue
            run = self.pool.submit(_run, text)
            for config in configs:
                by_config.setdefault(config, run)
            self.runs[cmd.id] = [run]


@pytest.fixture(scope="module")
def runner(request):
    name = "test_documented_command_works_as_written"
    selected = [
        item.callspec.params["cmd"]
        for item in request.session.items
        if getattr(item, "originalname", None) == name and item.module is sys.modules[__name__]
    ]
    runner = _Runner(selected)
    yield runner
    runner.pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command_works_as_written(cmd: DocCommand, runner):
    if cmd.marker in SKIP_MARKERS:
        words = shlex.split(cmd.command)
        files = [w for w in words if "/" in w or w.endswith((".slurm", ".toml", ".sh"))]
        missing = [f for f in files if "=" not in f and not (ROOT / f).exists()]
        assert not missing, f"{cmd.id}: {cmd.command!r} names missing files {missing}"
        return
    words = shlex.split(cmd.command)
    if cmd.marker in HELP_MARKERS and words[:1] == ["./run_tests.sh"]:
        missing = [w for w in words[1:] if w.endswith(".py") and not (ROOT / w).is_file()]
        assert not missing, f"{cmd.id}: {cmd.command!r} names missing test files {missing}"
    for run in runner.runs[cmd.id]:
        text, r = run.result()
        assert r.returncode == 0, (
            f"{cmd.id}: `{text}` exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        )
