"""Bad input is caught once, before any rank starts: one line naming the value, exit status 2.

``python -m torchtitan_wlb.validate`` is the pre-flight check ``run_train.sh`` runs with the
arguments every rank will get. Each family of mistakes below is one parametrised test; every case
asserts a single line on stderr naming the value, and exit status 2. The checkpoint cases use a
checkpoint written with the loader's real state (no training needed); one case goes through
``run_train.sh`` to show that no rank starts.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_wlb.config import TABLES, settings
from torchtitan_wlb.validate import main, parse_job_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "word " * (3 + i % 40)}) + "\n" for i in range(40)))
    return path


def _args(tmp_path, data, *extra, config=DEBUG_CPU):
    return [
        "--job.config_file", str(config), "--model.flavor", "tiny",
        "--training.seq_len", "128", "--wlb.micro_batch_max_len", "160",
        "--training.global_batch_size", "4", "--training.dataset", "jsonl",
        "--training.dataset_path", str(data), "--job.dump_folder", str(tmp_path / "run"), *extra,
    ]  # fmt: skip


def _fails(capsys, args, *expected, ngpu="2"):
    """Exit status 2 and exactly one line on stderr containing every ``expected`` string."""
    os.environ["NGPU"] = ngpu
    try:
        assert main(args) == 2
    finally:
        del os.environ["NGPU"]
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for text in expected:
        assert text in err, err


def test_good_config_passes(tmp_path, data, capsys):
    os.environ["NGPU"] = "2"
    try:
        assert main(_args(tmp_path, data)) == 0
    finally:
        del os.environ["NGPU"]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "130",
          "--wlb.micro_batch_max_len", "0"], ["[training] seq_len = 130", "= 4"]),
        (["--checkpoint.interval", "0"], ["[checkpoint] interval = 0"]),
        (["--training.global_batch_size", "0"], ["[training] global_batch_size = 0"]),
        (["--training.seq_len", "-8"], ["[training] seq_len = -8"]),
        (["--training.steps", "0"], ["[training] steps = 0"]),
        (["--metrics.log_freq", "0"], ["[metrics] log_freq = 0"]),
        (["--checkpoint.keep_latest_k", "-1"], ["[checkpoint] keep_latest_k = -1"]),
        (["--training.global_batch_size", "3"], ["global_batch_size = 3", "data-parallel degree 2"]),
        (["--parallelism.tensor_parallel_degree", "4"], ["tp", "2 processes launched"]),
        (["--parallelism.data_parallel_shard_degree", "1"], ["2 were launched (NGPU"]),
        (["--wlb.queue_thresholds", "200"], ["[wlb] queue_thresholds = [200]", "max_doc_len = 128"]),
        (["--training.steps", "x"], ["--training.steps", "'x'", "INT"]),
        (["--wlb.nosuch", "1"], ["unrecognized options: --wlb.nosuch"]),
        (["--wlb.fit_window_steps", "3"], ["unrecognized options: --wlb.fit_window_steps",
                                           "did you mean --wlb.online.window_steps?"]),
    ],
)  # fmt: skip
def test_config_errors(tmp_path, data, capsys, extra, expected):
    _fails(capsys, _args(tmp_path, data, *extra), *expected)


# TorchTitan options that failed inside the ranks (an assert, a KeyError, a ValueError in a
# traceback): one line before any rank starts, naming the option, why, and what to set.
PROFILING = ["--profiling.enable_profiling"]


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([*PROFILING, "--profiling.profile_freq", "2"],
         ["[profiling] profile_freq = 2 is below profiler_warmup + profiler_active = 3 + 1",
          "profile_freq >= warmup + active", "--profiling.profile_freq 4"]),
        ([*PROFILING, "--profiling.profiler_active", "0"], ["profiler_active = 0", ">= 1"]),
        (["--profiling.enable_memory_snapshot", "--profiling.profile_freq", "0"],
         ["[profiling] profile_freq = 0 is out of range"]),
        (["--model.converters", "float8"],
         ["[model] converters = ['float8']: 'float8' is not a TorchTitan model converter",
          "quantize.linear.float8"]),
    ],
)  # fmt: skip
def test_torchtitan_option_errors(tmp_path, data, capsys, extra, expected):
    _fails(capsys, _args(tmp_path, data, *extra), *expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
@pytest.mark.parametrize("name", ["quantize.linear.float8", "quantize.linear.mx"])
def test_quantized_training_needs_cuda(tmp_path, data, capsys, name):
    extra = ["--model.converters", name, "--quantize.linear.float8.emulate"]
    _fails(capsys, _args(tmp_path, data, *extra), f"{name} needs CUDA", "this run is on CPU")


def test_profiling_within_torchtitans_schedule_passes(tmp_path, data, capsys):
    schedule = ["--profiling.profile_freq", "2", "--profiling.profiler_warmup", "1"]
    extra = [*PROFILING, "--profiling.enable_memory_snapshot", *schedule]
    os.environ["NGPU"] = "2"
    try:
        assert main(_args(tmp_path, data, *extra)) == 0
    finally:
        del os.environ["NGPU"]
    assert capsys.readouterr().err == ""


def test_more_processes_than_the_layout_allows(tmp_path, data, capsys):
    fixed = ["--parallelism.data_parallel_shard_degree", "2"]
    _fails(capsys, _args(tmp_path, data, *fixed), "= 2 processes, but 4 were launched", ngpu="4")


# One value of the wrong type and (where the field has a range) one out of range, per setting of
# [wlb] and its tables [wlb.online] and [wlb.advanced] (a name is in one table only).
WRONG_TYPE = {bool: '"yes"', int: '"12"', float: '"x"', str: "5", list: "5"}
OUT_OF_RANGE = {
    "mode": '"fast"', "packing": '"best"', "cp_sharding": '"rows"', "attention_backend": '"x"',
    "cp_hybrid_max_len": "-1",
    "long_doc_policy": '"drop"', "max_doc_len": "-1", "micro_batch_max_len": "-1",
    "queue_thresholds": "[64, 32]", "max_delay_steps": "0", "adaptive_max_delay_steps": "1",
    "delay_target": "0.0", "balance_target": "0.5", "release_slack": "-0.1", "read_ahead_steps": "0",
    "packing_window": "0", "solver_node_limit": "0", "solver_time_limit_s": "0", "cost_model": '"x"',
    "attn_coef": "-1.0", "linear_coef": "-1.0", "cost_profile": '"/no/such.json"',
    "cp_profile": '"/no/such.json"', "cp_bandwidth_gbps": "0.0", "text_field": '""', "shuffle_seed": "-2", "loader": '"mine"', "epochs": "-1",
    "warmup_steps": "-1", "window_steps": "1", "holdout_steps": "0",
    "interval_steps": "0", "apply_lag_steps": "0", "initial_attn_scale": "0.0",
    "peak_tflops": "-1.0",
}  # fmt: skip
NO_RANGE = {"reset_positions", "metrics_jsonl"}  # booleans: only the type can be wrong
EXTRA = {"cost_profile": 'cost_model = "profile"\n'}
SETTINGS = {f.name: (table.TOML_TABLE, f) for table in TABLES for f in settings(table)}


def _base_type(f):
    if f.name in OUT_OF_RANGE and OUT_OF_RANGE[f.name].startswith('"') and f.type is not str:
        return str  # the choice fields
    return {"list[int]": list}.get(str(f.type), f.type if isinstance(f.type, type) else str)


def test_every_wlb_field_has_cases():
    names = [f.name for table in TABLES for f in settings(table)]
    assert len(names) == len(SETTINGS) and set(names) == set(OUT_OF_RANGE) | NO_RANGE


def _toml(tmp_path, line, table="wlb"):
    """debug_cpu.toml with its [wlb] section replaced by ``line`` in the table ``table``."""
    with open(DEBUG_CPU) as f:
        text = f.read().split("\n[wlb]\n")[0]
    path = tmp_path / "bad.toml"
    path.write_text(text + f"[{table}]\n" + line + "\n")
    return path


@pytest.mark.parametrize("field", list(SETTINGS))
def test_wlb_field_of_the_wrong_type(tmp_path, data, capsys, field):
    table, f = SETTINGS[field]
    bad = WRONG_TYPE[_base_type(f)]
    config = _toml(tmp_path, EXTRA.get(field, "") + f"{field} = {bad}", table)
    _fails(capsys, _args(tmp_path, data, config=config), f"[{table}] {field} = ")


@pytest.mark.parametrize("field", sorted(OUT_OF_RANGE))
def test_wlb_field_out_of_range(tmp_path, data, capsys, field):
    table = SETTINGS[field][0]
    config = _toml(tmp_path, EXTRA.get(field, "") + f"{field} = {OUT_OF_RANGE[field]}", table)
    _fails(capsys, _args(tmp_path, data, config=config), f"[{table}] {field} = ")


@pytest.mark.parametrize("table", ["online", "advanced"])
def test_wlb_table_of_the_wrong_type(tmp_path, data, capsys, table):
    config = _toml(tmp_path, f"{table} = 5")
    _fails(
        capsys,
        _args(tmp_path, data, config=config),
        f"[wlb] {table} = 5 is int; it must be a table, [wlb.{table}]",
    )


@pytest.mark.parametrize(
    "table, line, expected",
    [
        ("wlb.advanced", "delay_targt = 0.2",
         ["[wlb.advanced] has no field 'delay_targt'", "did you mean 'delay_target'?"]),
        # A field of one table set in another is named with its table.
        ("wlb", "release_slack = 0.2",
         ["[wlb] has no field 'release_slack'", "did you mean 'release_slack' in [wlb.advanced]?"]),
        ("wlb", "fit_window_steps = 6",
         ["[wlb] has no field 'fit_window_steps'", "did you mean 'window_steps' in [wlb.online]?"]),
    ],
)  # fmt: skip
def test_unknown_wlb_key_in_toml(tmp_path, data, capsys, table, line, expected):
    config = _toml(tmp_path, line, table)
    _fails(capsys, _args(tmp_path, data, config=config), *expected)


@pytest.mark.parametrize(
    "content, extra, expected",
    [
        (None, [], ["dataset_path", "matches no jsonl file"]),
        ("", [], ["holds no document"]),
        ('{"text": "fine"}\n{oops\n', [], ["docs.jsonl:2: malformed JSON line"]),
        ('{"body": "no text field"}\n', [], ["docs.jsonl:1: expected a JSON object with field 'text'"]),
        ('{"text": ""}\n', [], ["docs.jsonl:1: empty document"]),
        (json.dumps({"text": "x" * 400}) + "\n", ["--wlb.long_doc_policy", "error"],
         ["document 0", "402 tokens > max_doc_len = 128"]),
    ],
)  # fmt: skip
def test_data_errors(tmp_path, capsys, content, extra, expected):
    data = tmp_path / "docs.jsonl"
    if content is not None:
        data.write_text(content)
    _fails(capsys, _args(tmp_path, data, *extra), *expected)


# ------------------------------------------------------------------------------ checkpoints


def _checkpoint(tmp_path, data, *args, step=4):
    """A checkpoint as TorchTitan writes it, holding this config's real data-loader state."""
    from torchtitan_wlb.data.dataloader import build_wlb_dataloader
    from torchtitan_wlb.data.tokenizer import build_wlb_tokenizer
    from torchtitan_wlb.models.llama3_wlb import cost_model_for_job

    cfg = parse_job_config(_args(tmp_path, data, *args))
    loader = build_wlb_dataloader(2, 0, build_wlb_tokenizer(cfg), cfg, cost_model_for_job(cfg))
    next(iter(loader))
    folder = tmp_path / "run" / "checkpoint" / f"step-{step}"
    state = {
        "model": {"w": torch.arange(4096, dtype=torch.float32)},
        "dataloader": loader.state_dict(),
        "train_state": {"step": step},
    }
    dcp.save(state, checkpoint_id=str(folder))
    return folder


@pytest.mark.parametrize(
    "changed, expected",
    [
        (["--wlb.mode", "fixed_4d"], "[wlb] packing was 'wlb' when checkpoint"),
        (["--training.global_batch_size", "8"],
         "[training] global_batch_size (micro-batches per step) was 4"),
        (["--wlb.micro_batch_max_len", "192"], "[wlb] micro_batch_max_len (S_max) was 160"),
        (["--wlb.queue_thresholds", "48", "96"], "[wlb] queue_thresholds was []"),
        (["--parallelism.data_parallel_shard_degree", "1",
          "--parallelism.data_parallel_replicate_degree", "1"], "DP degree was 2"),
        (["--training.seq_len", "96", "--wlb.micro_batch_max_len", "160"],
         "[training] seq_len was 128"),
        (["--model.flavor", "debugmodel"], "cost model"),
    ],
)  # fmt: skip
def test_resume_refuses_a_change_of_data_settings(tmp_path, data, capsys, changed, expected):
    _checkpoint(tmp_path, data)
    ngpu = "1" if "DP degree was 2" in expected else "2"
    _fails(capsys, _args(tmp_path, data, *changed), "resume refused: ", expected, ngpu=ngpu)


def test_resume_refuses_another_starting_model_of_the_online_fit(tmp_path, data, capsys):
    """The online fit's starting model decides the first steps' plans: a resume under another
    ``[wlb.online] initial_attn_scale`` is refused, naming it."""
    online = ["--wlb.cost_model", "online"]
    _checkpoint(tmp_path, data, *online)
    changed = _args(tmp_path, data, *online, "--wlb.online.initial_attn_scale", "1.0")
    _fails(capsys, changed, "resume refused: ", "[wlb.online] initial_attn_scale was 1.5")


def test_resume_refuses_another_dataset(tmp_path, data, capsys):
    _checkpoint(tmp_path, data)
    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text())
    _fails(capsys, _args(tmp_path, other), "[training] dataset_path was ", str(data), str(other))


def test_resume_with_the_same_settings_passes(tmp_path, data, capsys):
    _checkpoint(tmp_path, data)
    os.environ["NGPU"] = "2"
    try:
        assert main(_args(tmp_path, data)) == 0
    finally:
        del os.environ["NGPU"]


def _model_only(tmp_path, step):
    """The last step's checkpoint as TorchTitan writes it under last_save_model_only."""
    folder = tmp_path / "run" / "checkpoint" / f"step-{step}"
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(folder))
    return folder


def test_resume_passes_over_a_model_only_last_checkpoint(tmp_path, data, capsys):
    from torchtitan_wlb.resume import is_model_only, resume_folder

    full, last = _checkpoint(tmp_path, data, step=2), _model_only(tmp_path, 4)
    assert is_model_only(str(last)) and not is_model_only(str(full))
    more = _args(tmp_path, data, "--training.steps", "6")
    assert resume_folder(parse_job_config(more)) == (str(full), 2)
    done = _args(tmp_path, data, "--training.steps", "4")  # finished: nothing to do, nothing lost
    assert resume_folder(parse_job_config(done)) == (str(last), 4)
    os.environ["NGPU"] = "2"
    try:
        assert main(more) == 0 and main(done) == 0
    finally:
        del os.environ["NGPU"]
    assert capsys.readouterr().err == ""


def test_resume_from_a_model_only_checkpoint_is_refused(tmp_path, data, capsys):
    last = _model_only(tmp_path, 4)
    _fails(
        capsys,
        _args(tmp_path, data, "--training.steps", "6"),
        f"resuming: {last} holds only the model",
        "no full checkpoint to resume from",
        f"--checkpoint.initial_load_path {last}",
    )
    full = _checkpoint(tmp_path, data, step=2)
    asked = _args(tmp_path, data, "--training.steps", "6", "--checkpoint.load_step", "4")
    _fails(capsys, asked, "[checkpoint] load_step = 4", f"from the full checkpoint {full}")


@pytest.mark.parametrize("target", ["shard", "metadata", "garbage_metadata"])
def test_damaged_checkpoint_names_the_file(tmp_path, data, capsys, target):
    older = _checkpoint(tmp_path, data, step=2)
    folder = _checkpoint(tmp_path, data, step=4)
    if target == "shard":
        path = next(p for p in folder.iterdir() if p.suffix == ".distcp")
        path.write_bytes(path.read_bytes()[:100])
        expected = [f"{path} is truncated", f"move {folder} away to resume from {older}"]
    else:
        path = folder / ".metadata"
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) // 2] if target == "metadata" else b"\x80\x04garbage")
        expected = [f"{path} is truncated or corrupted"]
    _fails(capsys, _args(tmp_path, data), *expected)


def test_run_train_sh_stops_before_any_rank_starts(tmp_path, data):
    env = dict(os.environ, WLB_PYTHON=sys.executable, NGPU="2", WLB_ALLOW_OVERSUBSCRIBE="1")
    r = subprocess.run(
        ["./run_train.sh", *_args(tmp_path, data, "--wlb.packing", "best")[2:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: [wlb] packing = 'best' is not accepted; use one of 'original', 'fixed_greedy', "
        "'solver', 'wlb', 'wlb_paper'"
    ]
    assert "torch.distributed" not in r.stdout + r.stderr and not (tmp_path / "run").exists()
