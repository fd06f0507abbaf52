"""Every tool under torchtitan_wlb/tools has the same face: examples in ``--help`` that parse,
one-line errors with exit status 2, the same generator names."""

import importlib
import json
import pkgutil
import shlex

import numpy as np
import pytest

import torchtitan_wlb.tools as tools_pkg
from torchtitan_wlb.tools.cli import examples, json_text
from torchtitan_wlb.workloads import GENERATORS

# The package's modules that are no command: what the tools share.
LIBRARIES = ("__init__", "cli", "analysis", "cp_calls", "torch_balancers")
TOOLS = sorted(m.name for m in pkgutil.iter_modules(tools_pkg.__path__) if m.name not in LIBRARIES)


def _tool(name):
    return importlib.import_module(f"torchtitan_wlb.tools.{name}")


def test_every_tool_is_listed():
    assert set(TOOLS) >= {"pack_bench", "cp_bench", "e2e_bench", "dry_run", "cp_profile"}


@pytest.mark.parametrize("name", TOOLS)
def test_help_examples_parse(name):
    module = _tool(name)
    cmds = examples(module.__doc__)
    assert cmds, f"{name}: its docstring has no example command"
    parser = module.parser()
    assert "examples:" in parser.format_help()
    for cmd in cmds:
        words = shlex.split(cmd, comments=True)
        assert words[:3] == ["python", "-m", f"torchtitan_wlb.tools.{name}"], cmd
        args = words[3:]
        for stop in (">", "--"):  # shell redirection; dry_run's TorchTitan overrides
            if stop in args:
                args = args[: args.index(stop)]
        parser.parse_args(args)  # SystemExit here: an example that does not run as written


@pytest.mark.parametrize("name", TOOLS)
def test_bad_flag_is_one_line_and_exit_2(name, capsys):
    with pytest.raises(SystemExit) as exc:
        _tool(name).parser().parse_args(["--no-such-flag"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith(f"python -m torchtitan_wlb.tools.{name}")


@pytest.mark.parametrize("name", ["pack_bench", "cp_bench", "e2e_bench"])
def test_generator_choices_are_the_workloads_names_in_order(name):
    action = next(a for a in _tool(name).parser()._actions if a.dest == "generator")
    assert list(action.choices) == list(GENERATORS)


def test_value_errors_are_one_line(capsys):
    cp_bench = _tool("cp_bench")
    with pytest.raises(SystemExit) as exc:
        cp_bench.main(["--cp", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m torchtitan_wlb.tools.cp_bench: error: --cp = 0 must be >= 1"
    ]


def test_e2e_bench_checks_the_fit_flags_before_any_job_starts(capsys):
    with pytest.raises(SystemExit) as exc:
        _tool("e2e_bench").main(["--fit-window", "0"])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--fit-window 0" in line and "[wlb.online] window_steps = 0 is out of range" in line


def test_json_output_is_strict_json_with_null_for_figures_not_computed():
    out = {"a": float("nan"), "b": [1.5, float("inf"), {"c": np.float64("nan")}], "d": 2}
    text = json_text(out)
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [1.5, None, {"c": None}], "d": 2}
    assert json.loads(json_text((1.0, -float("inf")), indent=2)) == [1.0, None]
