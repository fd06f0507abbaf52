"""Config validation: the [wlb] section, start-up layout checks, and the CLI's clean errors."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from torchtitan.config import ConfigManager

from torchtitan_wlb.config import WLB, ConfigError
from torchtitan_wlb.validate import check_job_config

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


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"packing": "magic"}, r"packing = 'magic' is not accepted; use one of 'original'"),
        ({"cp_sharding": "ring"}, "cp_sharding = 'ring' is not accepted"),
        ({"mode": "fast"}, "mode = 'fast' is not accepted"),
        ({"max_delay_steps": 0}, "max_delay_steps = 0 is out of range; it must be > 0"),
        ({"max_doc_len": -1}, "max_doc_len = -1 is out of range"),
        ({"cp_hybrid_max_len": -5}, "cp_hybrid_max_len = -5 is out of range; it must be >= 0"),
        ({"cp_bandwidth_gbps": 0.0}, "cp_bandwidth_gbps = 0.0 is out of range; it must be > 0"),
        ({"queue_thresholds": [8, 4]}, "must be positive and strictly increasing"),
        ({"cost_model": "coefficients"}, "needs attn_coef > 0 and linear_coef > 0"),
        ({"cost_model": "profile"}, "needs cost_profile"),
        ({"fit_holdout_steps": 8}, "fit_holdout_steps = 8 must be >= 1 and less than"),
        ({"fit_apply_lag_steps": 0}, "fit_apply_lag_steps = 0 is out of range"),
        ({"fit_initial_attn_scale": 0.0}, "fit_initial_attn_scale = 0.0 is out of range"),
        ({"fit_initial_attn_scale": float("inf")}, "fit_initial_attn_scale = inf must be a finite"),
        ({"fit_initial_attn_scale": float("nan")}, "fit_initial_attn_scale = nan must be a finite"),
        ({"delay_target": float("nan")}, "delay_target = nan must be a finite number > 0"),
        ({"cp_bandwidth_gbps": float("inf")}, "cp_bandwidth_gbps = inf must be a finite number"),
        ({"loader": "hf"}, "loader = 'hf' is not accepted"),
    ],
)
def test_bad_wlb_values_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        WLB(**kwargs)


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
    with pytest.raises(ConfigError, match="cannot be traced by torch.compile"):
        check_job_config(
            _parse("--parallelism.context_parallel_degree", "2", "--compile.enable"), world_size=2
        )
    with pytest.raises(ConfigError, match="needs document boundaries"):
        check_job_config(
            _parse("--parallelism.context_parallel_degree", "2", "--wlb.loader", "torchtitan"),
            world_size=2,
        )


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
    packing, layout, data = _run_train(
        ["--wlb.packing", "magic"],
        ["--parallelism.tensor_parallel_degree", "2"],
        ["--training.dataset", "jsonl", "--training.dataset_path", "/nonexistent/x"],
    )
    r = packing
    assert r.returncode == 2
    assert "[wlb] packing = 'magic' is not accepted; use one of 'original'" in _flat(r)
    assert "Traceback" not in _flat(r)
    r = layout
    assert r.returncode == 2
    assert "configuration error: [parallelism] dp_replicate x cp x tp x pp = 2" in _flat(r)
    assert "Traceback" not in _flat(r)
    r = data
    assert r.returncode == 2
    assert "dataset_path = '/nonexistent/x' matches no jsonl file" in _flat(r)
    assert "Traceback" not in _flat(r)


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
    import dataclasses

    from torchtitan_wlb.attention import BACKENDS
    from torchtitan_wlb.config import MODE_PRESETS, choice_values
    from torchtitan_wlb.cp.adaptive import STRATEGIES
    from torchtitan_wlb.packing import PACKERS

    types = {f.name: f.type for f in dataclasses.fields(WLB)}
    assert choice_values(types["packing"]) == tuple(PACKERS)
    assert choice_values(types["cp_sharding"]) == tuple(STRATEGIES)
    assert choice_values(types["attention_backend"]) == tuple(BACKENDS)
    assert choice_values(types["mode"]) == ("", *MODE_PRESETS)
    for packing, cp_sharding in MODE_PRESETS.values():
        assert packing in PACKERS and cp_sharding in STRATEGIES
    assert choice_values(types["max_doc_len"]) == ()


def test_packing_config_from_job_maps_every_knob():
    """The loader's PackingConfig carries every [wlb] packing knob, and PackingConfig's defaults
    are the [wlb] defaults (the tools and the simulator rely on them)."""
    import dataclasses
    from types import SimpleNamespace

    from torchtitan_wlb.data.dataloader import WLB_KNOBS, packing_config_from_job
    from torchtitan_wlb.packing import PackingConfig

    defaults = {f.name: f.default for f in dataclasses.fields(PackingConfig)}
    for src, dst in WLB_KNOBS.items():
        assert getattr(WLB(), src) == defaults[dst], (src, dst)
    wlb = WLB(
        max_delay_steps=5,
        adaptive_max_delay_steps=9,
        delay_target=0.4,
        balance_target=1.02,
        release_slack=0.5,
        packing_window=3,
        solver_time_limit_s=2.0,
        micro_batch_max_len=100,
        queue_thresholds=[20, 40],
    )
    job = SimpleNamespace(wlb=wlb, training=SimpleNamespace(seq_len=80))
    cfg = packing_config_from_job(job, 4)
    assert (cfg.micro_batches, cfg.context_len, cfg.smax, cfg.queue_thresholds) == (
        4,
        80,
        100,
        (20, 40),
    )
    for src, dst in WLB_KNOBS.items():
        assert getattr(cfg, dst) == getattr(wlb, src)
    # The solver's limits: training's deterministic node limit and its time safety net.
    assert (cfg.solver_time_limit, cfg.solver_node_limit) == (2.0, wlb.solver_node_limit)
    # The fixed-length packers cap at the context length: S_max is not theirs to set.
    wlb_fixed = WLB(packing="fixed_greedy", micro_batch_max_len=100)
    fixed = packing_config_from_job(SimpleNamespace(wlb=wlb_fixed, training=job.training), 4)
    assert fixed.smax is None and fixed.queue_thresholds is None
