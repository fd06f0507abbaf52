"""tools.attention_bench on a CPU: one model, one set of weights and documents, three attentions.
Our document attention and TorchTitan's FlexAttention with its block-causal mask from EOS tokens
see the same documents (equal first losses); TorchTitan's causal SDPA does not mask them."""

import json

import numpy as np
import pytest

from torchtitan_wlb.tools import attention_bench as ab

TOOL = "python -m torchtitan_wlb.tools.attention_bench"


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    """The three variants, eager, tiny model, 256 tokens, 2 steps and a profiled one (flex:
    forward only on CPU)."""
    out = tmp_path_factory.mktemp("attention_bench") / "result.json"
    argv = ["--flavor", "tiny", "--context-len", "256", "--steps", "2", "--warmup", "1"]
    rc = ab.main([*argv, "--modes", "eager", "--profile", "--out", str(out)])
    return rc, json.loads(out.read_text())


def test_flex_sees_our_documents_and_sdpa_does_not(eager_run):
    rc, res = eager_run
    assert rc == 0
    assert res["config"]["documents_per_step"][0] > 10  # many documents: masking matters
    runs = {r["variant"]: r for r in res["runs"]}
    assert [r["mode"] for r in res["runs"]] == ["eager"] * 3
    ours, flex, sdpa = (runs[v]["losses"][0] for v in ("wlb", "flex", "sdpa"))
    assert flex == pytest.approx(ours, rel=1e-5, abs=0)  # same weights, documents, positions
    assert abs(sdpa - ours) > 100 * max(abs(flex - ours), 1e-7)  # attends across documents
    assert runs["wlb"]["trained"] and runs["sdpa"]["trained"]
    assert not runs["flex"]["trained"] and "no backward on CPU" in runs["flex"]["note"]
    assert runs["wlb"]["losses"][1] != ours  # the optimizer stepped
    assert runs["wlb"]["losses"] == pytest.approx(runs["sdpa"]["losses"], rel=0.05)


def test_result_schema(eager_run):
    _, res = eager_run
    run = res["runs"][0]
    assert len(run["step_s"]) == len(run["losses"]) == 2
    assert len(run["tokens_per_s_steps"]) == 1 and run["tokens_per_s"] > 0
    assert run["useful_tflops"] > 0 and run["useful_mfu"] is None  # no peak on a CPU
    assert run["peak_memory_gib"] is None and run["process_rss_peak_gib"] > 0
    sdpa = next(r for r in res["runs"] if r["variant"] == "sdpa")
    assert sdpa["computed_tflops"] > sdpa["useful_tflops"]  # full causal: more than needed
    # flex ran forward only: no ratio against a trained wlb
    assert res["comparison"]["eager"]["wlb_over_flex"] is None
    assert res["comparison"]["eager"]["wlb_over_sdpa"] > 0
    assert res["config"]["attention_backend"] == "cpu" and res["config"]["eos_id"] == 257
    ops = [op["op"] for op in run["profile"]]
    assert "aten::mm" in ops and all(op["self_ms"] > 0 for op in run["profile"])


def test_sequences_are_the_documents_in_order_cut_at_the_context():
    seqs = ab.pack_sequences(np.array([5, 300, 7, 20]), 256, 2)
    assert [s.tolist() for s in seqs] == [[5, 251], [49, 7, 20, 5, 175]]  # cycled to fill


def test_an_eos_closes_every_document_and_nowhere_else():
    batch = ab.make_micro_batch(np.array([3, 1, 4]), 264, 257, np.random.default_rng(0))
    assert np.flatnonzero(batch.inputs[0].numpy() == 257).tolist() == [2, 3, 7]
    assert batch.doc_positions[0].tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert batch.labels[0, :-1].tolist() == batch.inputs[0, 1:].tolist()


def test_runs_in_the_order_given_none_after_max_seconds(tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = ["--context-len", "64", "--steps", "2", "--runs", "sdpa:eager,wlb:compiled"]
    assert ab.main([*argv, "--max-seconds", "1e-9", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["variant"], r["mode"], r["skipped"]) for r in runs] == [
        ("sdpa", "eager", "--max-seconds 1e-09"),
        ("wlb", "compiled", "--max-seconds 1e-09"),
    ]
    assert "skipped: --max-seconds" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--variants", "wlb,ring"], "--variants"),
        (["--modes", "fast"], "--modes"),
        (["--warmup", "2", "--steps", "2"], "--warmup = 2"),
        (["--context-len", "0"], "--context-len = 0"),
        (["--lengths-context", "1024"], "--lengths-context = 1024"),
        (["--flavor", "huge"], "--flavor 'huge'"),
        (["--variants", "varlen"], "variant varlen"),
        (["--runs", "wlb:fast"], "--runs"),
        (["--runs", "wlb:eager,wlb:eager"], "--runs"),
        (["--runs", "wlb:eager", "--modes", "eager"], "--runs"),
        (["--max-seconds", "-1"], "--max-seconds = -1"),
        (["--attention-backend", "flash"], "--attention-backend"),
        (["--lengths", "no_such_file.json"], "no_such_file.json"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, names, capsys):
    with pytest.raises(SystemExit) as exc:
        ab.main(argv)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"{TOOL}: error:") and names in line
