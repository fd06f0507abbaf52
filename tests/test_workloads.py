"""Workloads: the generator registry every tool shares, the length-file reader's errors, and the
loader's long-document policies."""

from __future__ import annotations

import json

import numpy as np
import pytest

from torchtitan_wlb.workloads import (
    GENERATORS,
    cut_stream,
    cycle_to,
    generate,
    load_lengths,
    long_documents,
    long_token_share,
    split_long,
)

# Sums and first lengths of 1,000 documents with seed 3, from the generators as they were written
# in the benchmarks before they moved here: the benchmarks' figures depend on these exact draws.
PINNED = {
    ("longtail", 131072): (6065112, [18830, 301, 4371, 1800]),
    ("pareto", 131072): (2471077, [566, 730, 1827, 3784]),
    ("bimodal", 131072): (5226733, [3093, 739, 2262, 1757]),
    ("longtail_scaled", 131072): (6726434, [25224, 254, 4978, 24379]),
    ("short", 131072): (129048, [213, 23, 48, 63]),
    ("longtail", 8192): (3810431, [8192, 301, 4371, 1800]),
    ("longtail_scaled", 8192): (420415, [1576, 16, 311, 1524]),
    ("short", 8192): (8335, [13, 2, 3, 4]),
}


@pytest.mark.parametrize("name, context_len", sorted(PINNED))
def test_generators_draw_the_pinned_documents(name, context_len):
    out = generate(name, 1000, context_len, seed=3)
    total, head = PINNED[name, context_len]
    assert out.dtype == np.int64 and out.shape == (1000,)
    assert int(out.sum()) == total and out[:4].tolist() == head
    assert out.min() >= 1 and out.max() <= context_len


def test_generator_registry():
    assert set(GENERATORS) == {"longtail", "longtail_scaled", "pareto", "bimodal", "short"}
    for name in GENERATORS:
        np.testing.assert_array_equal(generate(name, 50, 4096, 7), generate(name, 50, 4096, 7))
        assert not np.array_equal(generate(name, 50, 4096, 7), generate(name, 50, 4096, 8))
    with pytest.raises(ValueError, match="unknown generator 'zipf'; accepted: longtail, "):
        generate("zipf", 10, 4096)
    with pytest.raises(ValueError, match="num_docs = 0"):
        generate("longtail", 0, 4096)


def test_every_tool_accepts_every_generator():
    from torchtitan_wlb.sim.cli import build_parser as sim_parser
    from torchtitan_wlb.tools import cp_bench, e2e_bench, pack_bench

    for name in GENERATORS:
        assert pack_bench.parser().parse_args(["--generator", name]).generator == name
        assert cp_bench.parser().parse_args(["--generator", name]).generator == name
        assert e2e_bench.parser().parse_args(["--generator", name]).generator == name
        assert sim_parser().parse_args(["--generator", name]).generator == name


@pytest.mark.parametrize(
    "name, write",
    [
        ("a.json", lambda p: p.write_text("[5, 3.0, 7]")),
        ("a.txt", lambda p: p.write_text("5\n3\n\n7\n")),
        ("a.txt", lambda p: p.write_text("5 3\n7")),
        ("a.txt", lambda p: p.write_text(" [5, 3, 7]")),  # JSON whatever the suffix
        ("a.npy", lambda p: np.save(p, np.array([5, 3, 7], dtype=np.int32))),
    ],
)
def test_length_file_formats(tmp_path, name, write):
    path = tmp_path / name
    write(path)
    out = load_lengths(path)
    assert out.dtype == np.int64 and out.tolist() == [5, 3, 7]


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("missing.json", None, "no such file"),
        ("bad.json", "[1, 2", "invalid JSON"),
        ("bad.json", "oops", "invalid JSON"),
        ("obj.json", '{"a": 1}', "expected a JSON list"),
        ("empty.json", "[]", "no document lengths"),
        ("empty.txt", "", "no document lengths"),
        ("nested.json", "[[1, 2], [3, 4]]", "flat list"),
        ("ragged.json", "[1, [2, 3]]", "entry 1 = [2, 3]"),
        ("float.json", "[100, 2.5]", "entry 1 = 2.5"),
        ("bool.json", "[100, true]", "entry 1 = True"),
        ("str.json", '[100, "x"]', "entry 1 = 'x'"),
        ("zero.json", "[1, 0, 3]", "entry 1 = 0 is not a positive"),
        ("neg.txt", "4\n-3\n", "entry 1 = -3 is not a positive"),
        ("word.txt", "100\n12a\n", "line 2 = '12a'"),
        ("float.npy", np.array([1.0, 2.5]), "entry 1 = 2.5"),
        ("broken.npy", "not an array", "not a readable .npy"),
    ],
)
def test_bad_length_files_are_one_line_errors(tmp_path, name, content, needle):
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as exc:
        load_lengths(path)
    message = str(exc.value)
    assert needle in message and str(path) in message and "\n" not in message


def test_cp_bench_reports_a_bad_file_without_a_traceback(tmp_path, capsys):
    from torchtitan_wlb.tools import cp_bench

    path = tmp_path / "bad.json"
    path.write_text(json.dumps([100, "x"]))
    with pytest.raises(SystemExit) as exc:
        cp_bench.main(["--lengths", str(path), "--context-len", "1024", "--cp", "2"])
    err = capsys.readouterr().err
    assert exc.value.code != 0 and "entry 1 = 'x'" in err and "Traceback" not in err


def test_split_long_and_stream_policies():
    lens = np.array([5, 25, 10])
    np.testing.assert_array_equal(split_long(lens, 10), [5, 10, 10, 5, 10])
    assert split_long(lens, 25).tolist() == [5, 25, 10]
    np.testing.assert_array_equal(cut_stream(lens, 16), [5, 11, 14, 2, 8])
    with pytest.raises(ValueError, match="max_doc_len = 0"):
        split_long(lens, 0)
    out = cycle_to(lens, 100)
    assert out.sum() >= 100 and out[:-1].sum() < 100 and out[:3].tolist() == [5, 25, 10]


def test_long_documents_are_those_two_of_which_never_share_a_sequence():
    # Two documents of exactly half the context fit one sequence: they are not long.
    assert long_documents([4, 5, 8], 8).tolist() == [False, True, True]
    assert long_documents([4, 5], 9).tolist() == [False, True]  # 4 + 4 <= 9 < 5 + 5
    assert long_token_share([4, 5, 8, 3], 8) == pytest.approx(13 / 20)
