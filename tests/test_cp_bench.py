"""cp_bench's wlb packing, device flags and Figure 15 keys (CPU, small shapes; never on time)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.cp.adaptive import build_cp_plan
from torchtitan_wlb.models.catalogue import get_model
from torchtitan_wlb.tools import cp_bench

SMALL = ["--generator", "longtail_scaled", "--context-len", "2048", "--plan-repeats", "1"]
TINY_HEADS = ["--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--no-torch-balancers"]


def _run(capsys, args: list[str]) -> dict:
    assert cp_bench.main([*SMALL, *TINY_HEADS, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_wlb_measure_reports_consistent_figure15_keys(capsys):
    # N = 2 per step, 3 measured: two wlb steps are packed, the first 3 micro-batches measured
    args = ["--cp", "4", "--packer", "wlb", "--micro-batches", "2", "--measure"]
    result = _run(capsys, [*args, "--measure-micro-batches", "3", "--measure-repeats", "1"])
    config, fig = result["config"], result["figure15"]
    assert config["packer"] == "wlb" and config["packed_steps"] == 2
    assert config["micro_batches"] >= 3 and config["packer_model"] == "7B"
    assert (config["measure_device"], config["measure_dtype"]) == ("cpu", "float32")
    assert config["measure_backend"] == "cpu"
    assert fig["measured_micro_batches"] == 3 and fig["candidates"] == list(
        cp_bench.ADAPTIVE_CANDIDATES
    )
    steps = {name: np.array(ms) for name, ms in fig["step_ms"].items()}
    assert set(steps) == set(cp_bench.STRATEGY_NAMES) and all(len(v) == 3 for v in steps.values())
    # adaptive is never timed: its times are those of the fixed plan it chose
    chosen = np.array([steps[name][i] for i, name in enumerate(fig["chosen"])])
    np.testing.assert_array_equal(steps["adaptive"], chosen)
    for name, ms in steps.items():  # measured_max_ms is the mean slowest-rank time
        assert result[name]["measured_max_ms"] == pytest.approx(ms.mean())
        assert result[name]["measured_micro_batches"] == 3
        assert fig["total_ms"][name] == pytest.approx(ms.sum())
    total = fig["total_ms"]
    assert fig["oracle_ms"] <= min(total["per_sequence"], total["per_document"], total["adaptive"])
    assert fig["adaptive_vs_per_sequence"] == pytest.approx(
        1 - total["adaptive"] / total["per_sequence"]
    )
    assert fig["adaptive_vs_per_document"] == pytest.approx(
        1 - total["adaptive"] / total["per_document"]
    )
    assert 0.0 <= fig["adaptive_choice_agreement"] <= 1.0
    assert set(fig["measured_fastest"]) <= set(fig["candidates"])


def test_adaptive_candidates_flag_limits_the_choice(capsys):
    args = ["--cp", "2", "--micro-batches", "2", "--measure", "--measure-micro-batches", "1"]
    args += ["--measure-repeats", "1", "--adaptive-candidates", "per_sequence,per_document"]
    result = _run(capsys, args)
    assert result["adaptive"]["hybrid_share"] == 0.0
    assert result["config"]["packer"] == "original"  # the default packing is unchanged
    assert result["figure15"]["candidates"] == ["per_sequence", "per_document"]
    assert set(result["figure15"]["chosen"]) <= {"per_sequence", "per_document"}
    assert "call_breakdown" not in result  # only when asked for


def test_call_breakdown_covers_every_query_of_every_rank(capsys):
    """--call-breakdown: a row per call with queries; together a rank's calls hold its tokens, the
    halves' key windows at most the gathered keys, predictions the table's whole-rank figure."""
    args = ["--cp", "2", "--micro-batches", "2", "--measure", "--measure-micro-batches", "1"]
    result = _run(capsys, [*args, "--measure-repeats", "1", "--call-breakdown"])
    rows, summary = result["call_breakdown"]["calls"], result["call_breakdown"]["summary"]
    assert {r["strategy"] for r in rows} == {"per_sequence", "per_document", "hybrid"}
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 and r["q_tokens"] > 0 for r in rows)
    tokens = {sum(r["q_tokens"] for r in rows if r["strategy"] == s) for s in summary}
    assert len(tokens) == 1 and 0 < tokens.pop() <= 2048  # the one measured micro-batch
    for strategy in ("per_sequence", "per_document", "hybrid"):
        mine = [r for r in rows if r["strategy"] == strategy]
        assert all(r["key_rows"] <= 2048 and r["max_seqlen_k"] <= r["key_rows"] for r in mine)
        predicted = sum(r["predicted_ms"] for r in mine)
        parts = summary[strategy].values()
        assert sum(p["predicted_ms"] for p in parts) == pytest.approx(predicted)
        assert sum(p["calls"] for p in parts) == len(mine)
    assert {r["part"] for r in rows if r["strategy"] == "hybrid"} <= {"head", "tail", "whole"}


def test_no_figure15_without_measure(capsys):
    result = _run(capsys, ["--cp", "2", "--micro-batches", "2", "--packer", "wlb"])
    assert "figure15" not in result and "measured_max_ms" not in result["adaptive"]
    assert result["config"]["packed_steps"] == 1 and "measure_device" not in result["config"]


def test_figure15_arithmetic():
    step_ms = {
        "per_sequence": np.array([10.0, 10.0]),
        "per_document": np.array([8.0, 12.0]),
        "hybrid": np.array([9.0, 11.0]),
        "adaptive": np.array([8.0, 11.0]),  # chose per_document, then hybrid
    }
    chosen = ["per_document", "hybrid"]
    candidates = ("per_sequence", "per_document", "hybrid")
    fig = cp_bench.figure15(step_ms, chosen, [{"per_document"}, {"hybrid"}], candidates)
    assert fig["oracle_ms"] == 18.0 and fig["measured_fastest"] == ["per_document", "per_sequence"]
    assert fig["adaptive_choice_agreement"] == 0.5
    assert fig["adaptive_over_oracle"] == pytest.approx(19 / 18 - 1)
    assert fig["adaptive_vs_per_sequence"] == pytest.approx(1 - 19 / 20)
    assert fig["adaptive_vs_per_document"] == pytest.approx(1 - 19 / 20)
    # a choice between identical plans is not wrong, whichever measured faster
    same = [{"per_document"}, {"hybrid", "per_sequence"}]
    assert cp_bench.figure15(step_ms, chosen, same, candidates)["adaptive_choice_agreement"] == 1.0


def test_adaptive_plan_is_the_chosen_fixed_plan():
    lens = np.array([300, 2000, 40, 7000, 5, 1200, 900])
    adaptive = build_cp_plan(lens, 4, "adaptive")
    assert cp_bench.same_layout(adaptive, build_cp_plan(lens, 4, adaptive.strategy))
    per_seq, per_doc = (build_cp_plan(lens, 4, s) for s in ("per_sequence", "per_document"))
    assert not cp_bench.same_layout(per_seq, per_doc)


def test_wlb_micro_batches_are_whole_documents_under_smax():
    lens = np.array([100, 3000, 700, 50, 900, 1200, 400, 2500, 80, 600] * 20)
    cost_model = CostModel.from_model_dims(**get_model("7B").dims(), cp=2)
    mbs = cp_bench.pack_wlb_micro_batches(lens, 2048, 2, cost_model, steps=3)
    assert len(mbs) == 6 and all(int(m.sum()) <= int(1.25 * 2048) for m in mbs)
    split = cp_bench.split_long(lens, 2048)  # 3000 and 2500 are split first
    assert set(np.concatenate(mbs).tolist()) <= set(split.tolist())
    with pytest.raises(ValueError, match="cannot fill 3 steps of 2 micro-batches"):
        cp_bench.pack_wlb_micro_batches(lens[:10], 2048, 2, cost_model, steps=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_one_line(device, capsys):
    with pytest.raises(SystemExit) as exc:
        cp_bench.main(["--device", device, "--measure"])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"--device {device}:" in line and "no CUDA device" in line


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--device", "gpu"], "expected cpu, cuda or cuda:N, got 'gpu'"),
        (["--dtype", "int8"], "--dtype: invalid choice: 'int8'"),
        (["--packer", "fixed"], "--packer: invalid choice: 'fixed'"),
        (["--adaptive-candidates", "per_seq"], "subset of per_sequence,per_document,hybrid"),
        (["--model", "9B"], "unknown model preset '9B'"),
        (["--measure", "--measure-repeats", "0"], "--measure-repeats = 0 must be >= 1"),
        (["--call-breakdown"], "--call-breakdown times the measured micro-batches' calls"),
    ],
)
def test_bad_new_flags_are_one_line(flags, named, capsys):
    with pytest.raises(SystemExit) as exc:
        cp_bench.main(flags)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert named in line
