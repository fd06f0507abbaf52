"""Config validation: the [wlb] section, start-up layout checks, and the CLI's clean errors."""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from torchtitan.config import ConfigManager

from torchtitan_wlb.config import WLB, Advanced, ConfigError, OnlineCostModel
from torchtitan_wlb.data.sources import DataError
from torchtitan_wlb.validate import check_job_config, parse_job_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")


def _parse(*overrides):
    return ConfigManager().parse_args(["--job.config_file", DEBUG_CPU, *overrides])


def test_defaults_and_mode_presets():
    assert WLB().packing == "wlb"
    assert (WLB(mode="plain_4d").packing, WLB(mode="plain_4d").cp_sharding) == (
        "original",
        "per_sequence",
    )
    assert WLB(mode="fixed_4d").packing == "fixed_greedy"
    cfg = _parse("--wlb.packing", "fixed_greedy", "--wlb.mode", "")
    assert cfg.wlb.packing == "fixed_greedy"


def _other_than(name, value):
    """An accepted value of the preset field ``name`` other than ``value``."""
    from torchtitan_wlb.config import TABLES, choice_values, settings

    types = {f.name: f.type for f in settings(TABLES[0])}
    return next(v for v in choice_values(types[name]) if v != value)


def _toml_with(tmp_path, **wlb):
    """debug_cpu.toml (``mode = "wlb"``) with its ``[wlb]`` keys replaced by ``wlb``."""
    with open(DEBUG_CPU) as f:
        text = f.read()
    lines = "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in wlb.items())
    toml = tmp_path / "preset.toml"
    toml.write_text(re.sub(r'\nmode = "wlb".*\n', "\n" + lines, text))
    return str(toml)


@pytest.mark.parametrize("mode", ["", "plain_4d", "fixed_4d", "wlb"])
@pytest.mark.parametrize("name", ["packing", "cp_sharding"])
def test_a_preset_field_set_by_the_user_wins_over_the_mode(tmp_path, mode, name):
    """Every field a mode presets, set to another value than the mode's, in the TOML, on the
    command line or both ways mixed, is the run's value; the other field is the mode's."""
    from torchtitan_wlb.config import MODE_PRESETS, NO_MODE, PRESET_FIELDS

    preset = dict(zip(PRESET_FIELDS, MODE_PRESETS.get(mode, NO_MODE), strict=True))
    value = _other_than(name, preset[name])
    want = {**preset, name: value}

    def check(wlb):
        assert (wlb.mode, wlb.packing, wlb.cp_sharding) == (mode, *want.values())
        assert wlb.preset_overrides() == ({name: preset[name]} if mode else {})

    check(WLB(mode=mode, **{name: value}))
    check(_parse("--wlb.mode", mode, f"--wlb.{name}", value).wlb)
    check(_parse(f"--wlb.{name}", value, "--wlb.mode", mode).wlb)
    toml_both = _toml_with(tmp_path, mode=mode, **{name: value})
    check(ConfigManager().parse_args(["--job.config_file", toml_both]).wlb)
    toml_field = _toml_with(tmp_path, **{name: value})
    check(ConfigManager().parse_args(["--job.config_file", toml_field, "--wlb.mode", mode]).wlb)
    toml_mode = _toml_with(tmp_path, mode=mode)
    check(ConfigManager().parse_args(["--job.config_file", toml_mode, f"--wlb.{name}", value]).wlb)


@pytest.mark.parametrize("mode", ["", "plain_4d", "fixed_4d", "wlb"])
def test_a_mode_on_the_command_line_replaces_the_toml_modes_preset(tmp_path, mode):
    """What the TOML's mode chose is no setting of the user's: another mode replaces it."""
    from torchtitan_wlb.config import MODE_PRESETS, NO_MODE

    for toml_mode in MODE_PRESETS:
        toml = _toml_with(tmp_path, mode=toml_mode)
        wlb = ConfigManager().parse_args(["--job.config_file", toml, "--wlb.mode", mode]).wlb
        assert (wlb.packing, wlb.cp_sharding) == MODE_PRESETS.get(mode, NO_MODE), toml_mode
        assert wlb.preset_overrides() == {}
    # "" is "the mode's": set explicitly, it keeps the preset
    wlb = _parse("--wlb.mode", mode, "--wlb.packing", "", "--wlb.cp_sharding", "")
    assert (wlb.wlb.packing, wlb.wlb.cp_sharding) == MODE_PRESETS.get(mode, NO_MODE)


def _wlb(online=None, advanced=None, **top):
    """``WLB(**top)`` with ``[wlb.online]`` and ``[wlb.advanced]`` set from dicts, as from TOML."""
    return WLB(**top, online=OnlineCostModel(**online or {}), advanced=Advanced(**advanced or {}))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"packing": "magic"}, "[wlb] packing = 'magic' is not accepted; use one of 'original'"),
        ({"cp_sharding": "ring"}, "[wlb] cp_sharding = 'ring' is not accepted"),
        ({"mode": "fast"}, "[wlb] mode = 'fast' is not accepted"),
        ({"max_delay_steps": 0}, "[wlb] max_delay_steps = 0 is out of range; it must be > 0"),
        ({"advanced": {"max_doc_len": -1}}, "[wlb.advanced] max_doc_len = -1 is out of range"),
        ({"advanced": {"cp_hybrid_max_len": -5}},
         "[wlb.advanced] cp_hybrid_max_len = -5 is out of range; it must be >= 0"),
        ({"advanced": {"cp_bandwidth_gbps": 0.0}},
         "[wlb.advanced] cp_bandwidth_gbps = 0.0 is out of range; it must be > 0"),
        ({"queue_thresholds": [8, 4]}, "must be positive and strictly increasing"),
        ({"cost_model": "coefficients"}, "needs attn_coef > 0 and linear_coef > 0"),
        ({"cost_model": "profile"}, "needs cost_profile"),
        ({"online": {"holdout_steps": 8}},
         "[wlb.online] holdout_steps = 8 must be >= 1 and less than"),
        ({"online": {"apply_lag_steps": 0}}, "[wlb.online] apply_lag_steps = 0 is out of range"),
        ({"online": {"initial_attn_scale": 0.0}},
         "[wlb.online] initial_attn_scale = 0.0 is out of range"),
        ({"online": {"initial_attn_scale": float("inf")}},
         "[wlb.online] initial_attn_scale = inf must be a finite"),
        ({"online": {"initial_attn_scale": float("nan")}},
         "[wlb.online] initial_attn_scale = nan must be a finite"),
        ({"advanced": {"delay_target": float("nan")}},
         "[wlb.advanced] delay_target = nan must be a finite number > 0"),
        ({"advanced": {"cp_bandwidth_gbps": float("inf")}},
         "[wlb.advanced] cp_bandwidth_gbps = inf must be a finite number"),
        ({"advanced": {"loader": "hf"}}, "[wlb.advanced] loader = 'hf' is not accepted"),
        ({"max_delay_steps": 40},
         "[wlb.advanced] adaptive_max_delay_steps = 32 must be >= [wlb] max_delay_steps = 40"),
    ],
)  # fmt: skip
def test_bad_wlb_values_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        _wlb(**kwargs)


def test_nested_tables_must_be_tables():
    with pytest.raises(ConfigError, match=re.escape("[wlb] online = 5 is int; it must be a table")):
        WLB(online=5)
    with pytest.raises(ConfigError, match=re.escape("it must be a table, [wlb.advanced]")):
        WLB(advanced=OnlineCostModel())


def test_unknown_wlb_field_is_rejected(tmp_path):
    bad = tmp_path / "bad.toml"
    with open(DEBUG_CPU) as f:
        bad.write_text(f.read() + "\nbogus_knob = 3\n")
    with pytest.raises(ValueError, match="bogus_knob"):
        ConfigManager().parse_args(["--job.config_file", str(bad)])


def test_layout_checks():
    cfg = _parse()
    assert check_job_config(cfg, world_size=2)["dp_shard"] == 2
    with pytest.raises(ConfigError, match="= 4 processes, but 2 were launched"):
        check_job_config(_parse("--parallelism.data_parallel_shard_degree", "4"), world_size=2)
    with pytest.raises(ConfigError, match="does not divide the 3 processes"):
        check_job_config(_parse("--parallelism.tensor_parallel_degree", "2"), world_size=3)
    with pytest.raises(ConfigError, match="local_batch_size = 8"):
        check_job_config(_parse("--training.local_batch_size", "8"), world_size=2)
    with pytest.raises(ConfigError, match="micro_batch_max_len = 1000 is below"):
        check_job_config(_parse("--wlb.micro_batch_max_len", "1000"), world_size=2)
    with pytest.raises(ConfigError, match="global_batch_size = 3 micro-batches"):
        check_job_config(_parse("--training.global_batch_size", "3"), world_size=2)
    with pytest.raises(ConfigError, match="1F1B needs at least pipeline_parallel_degree=2"):
        check_job_config(
            _parse(
                "--parallelism.pipeline_parallel_degree", "2", "--training.global_batch_size", "2"
            ),
            world_size=4,
        )
    hybrid_tp_args = (
        "--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
        "--parallelism.data_parallel_shard_degree", "1", "--wlb.mode=", "--wlb.cp_sharding",
        "hybrid",
    )  # fmt: skip
    hybrid_tp = _parse(*hybrid_tp_args)
    with pytest.raises(ConfigError, match='cp_sharding = "hybrid" with .*tensor_parallel_degree'):
        check_job_config(hybrid_tp, world_size=4)
    # adaptive is accepted with TP: it leaves hybrid out of its candidates (test_cp_adaptive.py)
    adaptive_tp = _parse(*[a if a != "hybrid" else "adaptive" for a in hybrid_tp_args])
    assert check_job_config(adaptive_tp, world_size=4)["tp"] == 2
    # a compiled model with CP is accepted: the CP op is traceable (tests/test_compile.py)
    compiled_cp = _parse("--parallelism.context_parallel_degree", "2", "--compile.enable")
    assert check_job_config(compiled_cp, world_size=2)["cp"] == 2
    # and with TP (tests/test_e2e_4d.py trains TP = 2 x PP = 2 compiled)
    compiled_tp = _parse("--parallelism.tensor_parallel_degree", "2", "--compile.enable")
    assert check_job_config(compiled_tp, world_size=2)["tp"] == 2
    # zero-bubble stages cannot be compiled, but the loss alone can
    zbv = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
           "ZBVZeroBubble", "--compile.enable"]  # fmt: skip
    with pytest.raises(ConfigError, match="zero-bubble schedules do not run compiled stages"):
        check_job_config(_parse(*zbv), world_size=2)
    loss_only = _parse(*zbv, "--compile.components", "loss")
    assert check_job_config(loss_only, world_size=2)["pp"] == 2
    # TorchTitan's loader: its own datasets only, and no CP (no document boundaries)
    own_loader = ["--wlb.advanced.loader", "torchtitan"]
    with pytest.raises(ConfigError, match="not \\[training\\] dataset = 'wlb_builtin'"):
        check_job_config(_parse(*own_loader), world_size=1)
    own_loader += ["--training.dataset", "c4_test"]
    assert check_job_config(_parse(*own_loader), world_size=1)["cp"] == 1
    with pytest.raises(ConfigError, match="needs document boundaries"):
        cp2 = _parse(*own_loader, "--parallelism.context_parallel_degree", "2")
        check_job_config(cp2, world_size=2)


def _run_train(*arg_lists):
    """``python -m torchtitan_wlb.train`` once per argument list, two processes at a time (each
    spends its seconds importing TorchTitan on one core)."""

    def run(args):
        return subprocess.run(
            [sys.executable, "-m", "torchtitan_wlb.train", "--job.config_file", DEBUG_CPU, *args],
            cwd=ROOT,
            env=dict(os.environ, WORLD_SIZE="1"),
            capture_output=True,
            text=True,
            timeout=120,
        )

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, arg_lists))


def _flat(r):
    """Output with TorchTitan's / tyro's box drawing and line wrapping removed."""
    text = (r.stdout + r.stderr).replace("│", " ")
    return " ".join(text.split())


def test_cli_reports_bad_input_without_traceback():
    (r,) = _run_train(["--wlb.packing", "magic"])
    assert r.returncode == 2
    assert "[wlb] packing = 'magic' is not accepted; use one of 'original'" in _flat(r)
    assert "Traceback" not in _flat(r)
    # The entry point reports whatever the check raises the same way: the layout and the data.
    with pytest.raises(ConfigError, match=re.escape("dp_replicate x cp x tp x pp = 2")):
        check_job_config(_parse("--parallelism.tensor_parallel_degree", "2"), world_size=1)
    bad_path = _parse("--training.dataset", "jsonl", "--training.dataset_path", "/nonexistent/x")
    with pytest.raises(DataError, match=re.escape("dataset_path = '/nonexistent/x' matches no")):
        check_job_config(bad_path, world_size=1)


def test_configuration_reference_is_up_to_date():
    """docs/configuration.md is generated from the dataclass; regenerate it when fields change."""
    from torchtitan_wlb.tools.config_doc import render

    with open(os.path.join(ROOT, "docs", "configuration.md")) as f:
        committed = f.read()
    assert committed == render(), (
        "docs/configuration.md is stale: python -m torchtitan_wlb.tools.config_doc > "
        "docs/configuration.md"
    )


def test_choice_fields_are_literals_of_the_registries():
    """The [wlb] choice fields are typed Literal with exactly the registries' names, so the
    config, the packers, the CP planner and the attention backends cannot drift apart."""
    from torchtitan_wlb.attention import BACKENDS
    from torchtitan_wlb.config import MODE_PRESETS, TABLES, choice_values, settings
    from torchtitan_wlb.cp.adaptive import STRATEGIES
    from torchtitan_wlb.packing import PACKERS

    types = {f.name: f.type for table in TABLES for f in settings(table)}
    assert choice_values(types["packing"]) == tuple(PACKERS)
    assert choice_values(types["cp_sharding"]) == tuple(STRATEGIES)
    assert choice_values(types["attention_backend"]) == tuple(BACKENDS)
    assert choice_values(types["mode"]) == ("", *MODE_PRESETS)
    for packing, cp_sharding in MODE_PRESETS.values():
        assert packing in PACKERS and cp_sharding in STRATEGIES
    assert choice_values(types["max_doc_len"]) == ()


def test_packing_config_from_job_maps_every_knob():
    """The loader's PackingConfig carries every [wlb] packing knob by the same name, and
    PackingConfig's defaults are the [wlb] defaults (the tools and the simulator rely on them)."""
    import dataclasses
    from types import SimpleNamespace

    from torchtitan_wlb.data.dataloader import PACKING_KNOBS, packing_config_from_job
    from torchtitan_wlb.packing import PackingConfig

    defaults = {f.name: f.default for f in dataclasses.fields(PackingConfig)}
    assert WLB().max_delay_steps == defaults["max_delay_steps"]
    # All but the solver's node limit, which training sets and the one-process tools leave off.
    assert defaults["solver_node_limit"] is None
    for name in {*PACKING_KNOBS, "solver_time_limit_s"} - {"solver_node_limit"}:
        assert getattr(Advanced(), name) == defaults[name], name
    knobs = dict(
        adaptive_max_delay_steps=9,
        delay_target=0.4,
        balance_target=1.02,
        release_slack=0.5,
        read_ahead_steps=3,
        packing_window=3,
        solver_node_limit=50,
        solver_time_limit_s=2.0,
    )
    assert set(knobs) == {*PACKING_KNOBS, "solver_time_limit_s"}
    wlb = _wlb(
        max_delay_steps=5, micro_batch_max_len=100, queue_thresholds=[20, 40], advanced=knobs
    )
    job = SimpleNamespace(wlb=wlb, training=SimpleNamespace(seq_len=80))
    cfg = packing_config_from_job(job, 4)
    assert (cfg.micro_batches, cfg.context_len, cfg.smax, cfg.queue_thresholds) == (
        4,
        80,
        100,
        (20, 40),
    )
    assert cfg.max_delay_steps == 5
    for name, value in knobs.items():
        assert getattr(cfg, name) == value, name
    # The fixed-length packers cap at the context length: S_max is not theirs to set.
    wlb_fixed = WLB(packing="fixed_greedy", micro_batch_max_len=100)
    fixed = packing_config_from_job(SimpleNamespace(wlb=wlb_fixed, training=job.training), 4)
    assert fixed.smax is None and fixed.queue_thresholds is None


def test_nested_tables_from_toml_and_the_command_line(tmp_path):
    """TorchTitan's ConfigManager reads the [wlb.online] and [wlb.advanced] TOML tables into the
    nested dataclasses, checked, and ``--wlb.online.<field>`` / ``--wlb.advanced.<field>``
    override them; the online fit's schedule takes [wlb.online] by the same names."""
    toml = tmp_path / "nested.toml"
    with open(DEBUG_CPU) as f:  # debug_cpu.toml ends in its [wlb.advanced] table
        text = f.read() + "release_slack = 0.5\nmetrics_jsonl = true\n"
    toml.write_text(text + "\n[wlb.online]\nwindow_steps = 6\ninitial_attn_scale = 2\n")
    wlb = ConfigManager().parse_args(["--job.config_file", str(toml)]).wlb
    assert isinstance(wlb.online, OnlineCostModel) and isinstance(wlb.advanced, Advanced)
    assert (wlb.mode, wlb.max_delay_steps) == ("wlb", 12)
    advanced = wlb.advanced
    assert (advanced.attention_backend, advanced.release_slack, advanced.metrics_jsonl) == (
        "auto",
        0.5,
        True,
    )
    assert (wlb.online.window_steps, wlb.online.holdout_steps) == (6, 2)
    assert wlb.online.initial_attn_scale == 2.0 and type(wlb.online.initial_attn_scale) is float
    cli = ["--wlb.advanced.release_slack", "0.125", "--wlb.advanced.no-metrics_jsonl"]
    cli += ["--wlb.online.window_steps", "4", "--wlb.online.holdout_steps", "3"]
    wlb = ConfigManager().parse_args(["--job.config_file", str(toml), *cli]).wlb
    assert (wlb.advanced.release_slack, wlb.advanced.metrics_jsonl) == (0.125, False)
    assert wlb.advanced.attention_backend == "auto"  # the TOML's, kept
    assert (wlb.online.window_steps, wlb.online.holdout_steps) == (4, 3)
    assert wlb.online.initial_attn_scale == 2.0
    fit = wlb.online_fit_config()
    assert (fit.warmup_steps, fit.window_steps, fit.holdout_steps) == (2, 4, 3)
    assert (fit.interval_steps, fit.apply_lag_steps) == (4, 2)
    # A bad value from the command line is named by its table, as from TOML.
    bad = ["--job.config_file", str(toml), "--wlb.online.holdout_steps", "6"]
    with pytest.raises(ConfigError, match=re.escape("[wlb.online] holdout_steps = 6 must be")):
        parse_job_config(bad)


def test_the_wlb_table_stays_small():
    """`[wlb]` holds what a run chooses; tuning knobs go to `[wlb.advanced]` or `[wlb.online]`."""
    from dataclasses import fields

    top = [f.name for f in fields(WLB)]
    assert len(top) <= 16, top
    assert {"online", "advanced"} <= set(top)
    nested = {f.name for t in (Advanced, OnlineCostModel) for f in fields(t)}
    assert not nested & set(top), "a knob with two names"
