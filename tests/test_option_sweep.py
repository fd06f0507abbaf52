"""Every option of TorchTitan's JobConfig trains under torchtitan-wlb, or is refused in one line
before any rank starts, or is known to have no effect here: the table in tests/option_table.py.

A field TorchTitan adds (or drops) fails ``test_every_torchtitan_option_is_in_the_table`` by
name. The refusals are checked in-process through ``torchtitan_wlb.validate`` (no rank starts);
the options that work are trained in two short multi-process runs that set them all, or are
pointed at the test that already trains them.
"""

import copy
import dataclasses
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import typing

import pytest
import torch
from option_table import (
    BEGIN,
    COMMON,
    DOC,
    END,
    RUNS,
    TABLE,
    doc_table,
    render_markdown,
)

from torchtitan_wlb.config import TABLES, ConfigError, settings
from torchtitan_wlb.validate import check_job_config, main, parse_job_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "tests", "fork_launch.py")
REFUSED = sorted(name for name, row in TABLE.items() if row.refuse)


def _fields(cls: type, prefix: str = "") -> list[str]:
    """Every leaf field of the dataclass ``cls``, dotted (``training.dataloader.num_workers``)."""
    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        kind = hints.get(f.name, f.type)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            names += _fields(kind, f"{prefix}{f.name}.")
        else:
            names.append(prefix + f.name)
    return names


@pytest.fixture(scope="module")
def job_config():
    """The sweep runs' config, parsed as the ranks parse it (TorchTitan's JobConfig with [wlb])."""
    return parse_job_config([*COMMON, "--job.dump_folder", "/tmp/wlb_option_sweep"])


def test_every_torchtitan_option_is_in_the_table(job_config):
    from torchtitan.config import JobConfig

    torchtitan = _fields(JobConfig)
    missing = [name for name in torchtitan if name not in TABLE]
    assert not missing, f"TorchTitan options the sweep does not cover: {missing}"
    stale = sorted(set(TABLE) - set(torchtitan))
    assert not stale, f"options in the table that TorchTitan's JobConfig no longer has: {stale}"
    assert list(TABLE) == torchtitan, "keep the table in TorchTitan's order (the doc follows it)"
    # The project's JobConfig adds only its [wlb] section, whose fields have their own checks
    # (tests/test_bad_input.py, docs/configuration.md).
    extended = _fields(type(job_config))
    ours = {f"wlb.{f.name}" for f in settings(TABLES[0])}
    ours |= {f"wlb.{t.TOML_TABLE.split('.')[1]}.{f.name}" for t in TABLES[1:] for f in settings(t)}
    assert sorted(set(extended) - set(torchtitan)) == sorted(ours)


def _flags(args: list[str]) -> set[str]:
    """The fields a command line sets: ``--a.b`` and ``--a.no-b`` both set ``a.b``."""
    fields = set()
    for arg in args:
        if arg.startswith("--"):
            section, _, name = arg[2:].replace("-", "_").rpartition(".")
            fields.add(f"{section}.{name.removeprefix('no_')}")
    return fields


def _check_reference(name: str, check: str) -> None:
    """A ``run:``, ``test:`` or ``toml`` check of the table names something that sets ``name``."""
    kind, _, what = check.partition(":")
    if kind == "run":
        assert name in _flags([*COMMON, *RUNS[what][1], "--job.dump_folder"]), (
            f"{name}: run {what!r} does not set it"
        )
    elif kind == "test":
        ref, _, needle = what.partition(" ")
        path, _, function = ref.partition("::")
        with open(os.path.join(ROOT, path)) as f:
            source = f.read()
        assert not function or f"def {function}(" in source, f"{name}: no test {ref}"
        needle = needle or name.rpartition(".")[2]
        assert needle in source, f"{name}: {path} does not mention {needle!r}"
    else:
        assert kind == "toml", check
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        with open(os.path.join(ROOT, "train_configs", "debug_cpu.toml"), "rb") as f:
            toml = tomllib.load(f)
        section, _, key = name.rpartition(".")
        assert key in toml.get(section, {}), f"{name}: not set by train_configs/debug_cpu.toml"


def test_every_row_is_checked():
    for name, row in TABLE.items():
        assert row.status in ("works", "differs", "refused", "inert"), name
        if row.status == "works":
            assert row.checks, f"{name}: works, but nothing trains it"
        if row.status == "refused":
            assert row.refuse and row.expect, f"{name}: refused, but no refusal is checked"
        if row.status in ("refused", "inert", "differs"):
            assert row.note, f"{name}: {row.status} needs the reason in its note"
        if row.status == "inert":
            assert row.accept, f"{name}: no effect, but validate's acceptance is not checked"
        assert row.checks or row.refuse or row.accept, f"{name}: nothing checks it"
        for check in row.checks:
            _check_reference(name, check)


def _with(job_config, overrides: dict):
    """A copy of ``job_config`` with ``overrides`` (``section.field: value``) set."""
    config = copy.deepcopy(job_config)
    for path, value in overrides.items():
        *tables, leaf = path.split(".")
        target = config
        for table in tables:
            target = getattr(target, table)
        assert hasattr(target, leaf), path
        setattr(target, leaf, value)
    return config


@pytest.mark.parametrize("name", REFUSED)
def test_refused_in_one_line_before_ranks_start(job_config, name):
    row = TABLE[name]
    if row.needs_missing and importlib.util.find_spec(row.needs_missing):
        pytest.skip(f"{row.needs_missing} is installed")
    if row.cpu_only and torch.cuda.is_available():
        pytest.skip("a CPU refusal")
    with pytest.raises(ConfigError) as e:
        check_job_config(_with(job_config, row.refuse), world_size=2)
    message = str(e.value)
    assert "\n" not in message, message
    section, _, leaf = name.rpartition(".")
    assert f"[{section}] {leaf}" in message, message  # it names the option
    for text in row.expect:
        assert text in message, message


def test_options_without_effect_are_accepted(job_config):
    overrides = {}
    for row in TABLE.values():
        overrides.update(row.accept or {})
    assert check_job_config(_with(job_config, overrides), world_size=2)["dp_shard"] == 2


def test_a_refusal_reaches_the_command_line_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("NGPU", "2")
    flags = ["--compile.enable", "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]  # fmt: skip
    assert main([*COMMON, "--job.dump_folder", "/tmp/wlb_option_sweep", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: [parallelism] pipeline_parallel_schedule = 'ZBVZeroBubble'"), err


def test_getting_started_lists_every_option_as_the_table_does():
    with open(DOC) as f:
        text = f.read()
    assert BEGIN in text and END in text, "docs/getting_started.md lost the options table"
    assert doc_table(text) == render_markdown(), "run: python tests/option_table.py --write"


def _sweep(name: str, dump, **dumps) -> str:
    nproc, args = RUNS[name]
    args = [arg.format(**dumps) for arg in args]
    cmd = [sys.executable, LAUNCH, f"--nproc_per_node={nproc}", *COMMON, *args]
    cmd += ["--job.dump_folder", str(dump)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout + r.stderr


@pytest.mark.slow
def test_options_train(tmp_path):
    """The two sweep runs train, and the options they set show in their output."""
    a = tmp_path / "fsdp_tp"
    log = _sweep("fsdp_tp", a)
    assert "done: trained 3 steps" in log and "Running with configs" in log
    assert json.loads((a / "config.json").read_text())["job"]["description"] == "option sweep"
    assert "step:  2/3" in log and "step:  1/3" in log  # log_freq 2: steps 1 and 2 (and 3, last)
    assert "grad_norm:  0.0000" in log  # the optimizer stepped in the backward, unclipped
    (runs,) = os.listdir(a / "tb_sweep")
    assert sorted(os.listdir(a / "tb_sweep" / runs)) == [f"rank_{r}" for r in range(4)]
    assert sorted(os.listdir(a / "ckpt")) == ["step-2", "step-3"]  # step 1 saved, then purged
    assert f"{a / 'ckpt' / 'step-1'}" in log
    for rank in range(4):
        trace = a / "traces" / "iteration_3" / f"rank{rank}_trace.json"
        assert json.loads(trace.read_text())["traceEvents"]
        snapshot = a / "memory" / "iteration_3" / f"rank{rank}_memory_snapshot.pickle"
        summary = pickle.loads(snapshot.read_bytes())
        assert summary["device"] == "cpu" and summary["bytes"]["VmHWM"] > 0
    from torch.distributed.checkpoint import FileSystemReader

    last = FileSystemReader(str(a / "ckpt" / "step-3")).read_metadata().state_dict_metadata
    assert last and all(k.startswith(("tok_", "layers.", "norm", "output")) for k in last)
    assert {meta.properties.dtype for meta in last.values()} == {torch.bfloat16}

    b = tmp_path / "pp"
    log = _sweep("pp", b, fsdp_tp=a)
    assert f"Loading the checkpoint from {a / 'ckpt' / 'step-2'}" in log
    assert "Using pipeline schedule 1F1B with 4 microbatches and 2 stages" in log
    # 2 layers per stage, the first with none less, the last with 2 less: the layers all go first
    assert "stage_idx 0 with modules ['tok_embeddings', 'layers.0', 'layers.1']" in log
    assert "stage_idx 1 with modules ['norm', 'output']" in log
    assert "step:  3/3" in log and "step:  1/3" not in log  # it resumed at step 3
    assert not (b / "checkpoint").exists()  # load_only
