"""Smoke runs of the packing benchmark CLI (not a benchmark: tiny inputs, no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from torchtitan_wlb.tools import pack_bench

REPO = Path(__file__).resolve().parents[1]
KEYS = {
    "packer",
    "micro_batches",
    "steps",
    "imbalance",
    "overhead_ms",
    "avg_delay_iters",
    "max_tokens_per_microbatch",
    "tokens_in",
    "tokens_out",
}


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.parametrize("packer", ["original", "fixed_greedy", "wlb", "wlb_paper", "solver"])
def test_generator_run(packer, capsys):
    args = ["--generator", "longtail", "--num-docs", "600", "--context-len", "8192"]
    args += ["--micro-batches", "2", "--packer", packer, "--steps", "4", "--json"]
    args += ["--solver-time-limit", "2", "--window", "2"]
    assert pack_bench.main(args) == 0
    out = last_json(capsys.readouterr().out)
    assert out.keys() >= KEYS
    assert out["packer"] == packer and out["micro_batches"] == 2 and out["steps"] == 4
    assert out["tokens_in"] == out["tokens_out"] > 0
    assert out["max_tokens_per_microbatch"] <= out["smax"]
    assert out["imbalance"] >= 1.0


@pytest.mark.parametrize("suffix", [".json", ".npy", ".txt"])
def test_lengths_file_formats_and_split(tmp_path, suffix, capsys):
    lens = np.array([5000, 300, 20000, 12, 7000] * 20)
    path = tmp_path / f"lens{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(lens.tolist()))
    elif suffix == ".npy":
        np.save(path, lens)
    else:
        path.write_text("\n".join(map(str, lens)))
    args = ["--lengths", str(path), "--context-len", "8192", "--micro-batches", "2"]
    args += ["--packer", "wlb", "--steps", "50", "--queues", "2048,4096", "--json"]
    assert pack_bench.main(args) == 0
    out = last_json(capsys.readouterr().out)
    assert out["docs_split"] == 20  # the 20000-token documents, split by the loader policy
    assert out["tokens_in"] == out["tokens_out"] == int(lens.sum())
    assert out["queues"] == [2048, 4096]


def test_solver_gap_and_module_entry_point():
    cmd = [sys.executable, "-m", "torchtitan_wlb.tools.pack_bench", "--generator", "bimodal"]
    cmd += ["--num-docs", "300", "--context-len", "4096", "--micro-batches", "2", "--steps", "3"]
    cmd += ["--solver-gap", "2", "--solver-time-limit", "2", "--json"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    out = last_json(res.stdout)
    assert out["gap_steps"] == 2
    assert out["gap_mean_wlb_over_bound"] >= 1.0 - 1e-9


def test_table2_mode(capsys):
    args = ["--generator", "longtail", "--num-docs", "800", "--context-len", "8192"]
    args += ["--micro-batches", "2", "--steps", "3", "--solver-steps", "1"]
    args += ["--solver-time-limit", "1", "--table2", "--json"]
    assert pack_bench.main(args) == 0
    rows = last_json(capsys.readouterr().out)["table2"]
    assert [r["packer"] for r in rows][:2] == ["original", "fixed_greedy"]
    assert len(rows) == len(pack_bench.PAPER_TABLE2)
    assert all(r["tokens_in"] == r["tokens_out"] for r in rows)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--generator", "longtail", "--micro-batches", "0"], "expected an integer >= 1"),
        (["--generator", "longtail", "--packer", "magic"], "invalid choice"),
        (["--generator", "longtail", "--queues", "5,x"], "comma-separated integers"),
        (["--generator", "longtail", "--queues", "9000,4000"], "strictly increasing"),
        (
            ["--generator", "longtail", "--context-len", "8192", "--smax", "100"],
            "below context_len",
        ),
        (["--lengths", "/nonexistent/file.json"], "no such file"),
        (["--generator", "longtail", "--attn-coef", "1"], "must be given together"),
        ([], "one of the arguments --lengths --generator is required"),
    ],
)
def test_bad_cli_input_is_one_clear_error(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        pack_bench.main(args + ["--steps", "1", "--num-docs", "10"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("content", ["[1, 0, 3]", "[1.5, 2]", '{"a": 1}', "oops"])
def test_bad_lengths_file(tmp_path, content, capsys):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        pack_bench.main(["--lengths", str(path), "--steps", "1"])
    assert exc.value.code != 0
    assert "--lengths" in capsys.readouterr().err


def test_tune_option(capsys):
    args = ["--generator", "longtail", "--num-docs", "1200", "--context-len", "8192"]
    args += ["--micro-batches", "2", "--packer", "wlb", "--steps", "10", "--tune", "0.5", "--json"]
    assert pack_bench.main(args) == 0
    out = last_json(capsys.readouterr().out)
    assert out["tuned_sample_delay"] <= 0.5
    assert out["tokens_in"] == out["tokens_out"]
    with pytest.raises(SystemExit):
        pack_bench.main(args[:-4] + ["--packer", "original", "--tune", "0.5"])


@pytest.mark.parametrize(
    "name, model",
    [
        ("550m", "550M"),
        ("7b", "7B"),
        ("8b", "llama3_8B"),
        ("30b", "30B"),
        ("70b", "70B"),
        ("LLAMA3_70b", "llama3_70B"),
    ],
)
def test_model_names_map_to_the_catalogue(name, model):
    from torchtitan_wlb.cost_model import CostModel
    from torchtitan_wlb.models.catalogue import get_model

    args = pack_bench.parser().parse_args(["--generator", "longtail", "--model", name, "--tp", "2"])
    assert args.model == model
    expected = CostModel.from_model_dims(**get_model(model).dims(), tp=2)
    assert pack_bench.build_cost_model(args) == expected
    with pytest.raises(SystemExit):
        pack_bench.parser().parse_args(["--generator", "longtail", "--model", "13b"])


@pytest.mark.parametrize("packer", ["original", "fixed_greedy", "wlb", "wlb_paper"])
def test_whole_pass_scores_every_step_and_the_drain(packer, capsys):
    args = ["--generator", "longtail", "--num-docs", "800", "--context-len", "8192"]
    args += ["--micro-batches", "4", "--packer", packer, "--window", "2", "--json"]
    assert pack_bench.main(args + ["--steps", "epoch", "--dp", "2"]) == 0
    out = last_json(capsys.readouterr().out)
    assert out["whole_pass"] is True and out["flush_steps"] == 0 and out["dp"] == 2
    assert out["docs_in"] == out["docs_out"] == 800  # every document, the drain included
    assert out["tokens_in"] == out["tokens_out"]
    assert out["drain_steps"] >= 1
    assert out["imbalance_time_weighted"] >= out["lower_bound_time_weighted"] >= 1.0
    assert out["imbalance_worst_step"] >= out["imbalance_p95"] >= 1.0
    assert out["overhead_ms_max"] >= out["overhead_ms_p95"] > 0
    assert out["plan_ms_p95"] >= 0 and out["plan_ms"] >= 0
    assert out["collate_ms"] > 0 and out["collate_ms_p95"] >= 0  # the training thread's share
    # A partial window is labelled as such and never reaches the end of the data.
    assert pack_bench.main(args + ["--steps", "3"]) == 0
    part = last_json(capsys.readouterr().out)
    assert part["whole_pass"] is False and part["steps"] == 3 and part["drain_steps"] == 0
    assert part["docs_in"] < 800 and part["tokens_in"] == part["tokens_out"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "many"], "a positive integer or 'epoch'"),
        (["--steps", "0"], "a positive integer or 'epoch'"),
        (["--micro-batches", "4", "--dp", "3"], "not divisible by --dp 3"),
    ],
)
def test_bad_steps_and_dp(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        pack_bench.main(["--generator", "longtail", "--num-docs", "10", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
