"""The document pipeline: sources, long-document policy, collation, resume, bad data."""

import json

import numpy as np
import pytest
import torch
from torchdata.nodes import IterableWrapper
from torchtitan.components.loss import IGNORE_INDEX

from torchtitan_wlb.data.collate import MicroBatchNode, collate_micro_batch, document_positions
from torchtitan_wlb.data.documents import DocumentNode
from torchtitan_wlb.data.sources import DataError, TextSource, build_builtin_corpus
from torchtitan_wlb.data.tokenizer import ByteTokenizer


def _drain(node):
    out = []
    while True:
        try:
            out.append(node.next())
        except StopIteration:
            return out


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "héllo"
    assert max(ids) < tok.get_vocab_size()


def test_document_positions_restart_per_document():
    np.testing.assert_array_equal(document_positions(np.array([3, 1, 2])), [0, 1, 2, 0, 0, 1])


def test_collate_keeps_boundaries():
    tokens = np.array([10, 11, 12, 20, 30, 31])
    inp, labels = collate_micro_batch(tokens, np.array([3, 1, 2]))
    assert inp["input"].tolist() == [[10, 11, 12, 20, 30, 31]]
    # next token within the document; the last token of each document predicts nothing
    assert labels.tolist() == [[11, 12, IGNORE_INDEX, IGNORE_INDEX, 31, IGNORE_INDEX]]
    assert inp["positions"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert inp["doc_lens"].dtype == torch.int32 and inp["doc_lens"].tolist() == [3, 1, 2]
    inp, _ = collate_micro_batch(tokens, np.array([3, 1, 2]), reset_positions=False)
    assert inp["positions"].tolist() == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("lens", [[2, 3], [7], [0, 5]])
def test_collate_rejects_inconsistent_lengths(lens):
    with pytest.raises(ValueError, match="document lengths"):
        collate_micro_batch(np.arange(6), np.array(lens))


@pytest.mark.parametrize("policy", ["split", "truncate"])
def test_long_document_policy(tmp_path, policy):
    texts = ["a" * 25, "bb", "c" * 9]  # 27, 4 and 11 tokens with BOS/EOS
    _write_jsonl(tmp_path / "d.jsonl", texts)
    node = DocumentNode(TextSource("jsonl", str(tmp_path / "d.jsonl")), ByteTokenizer(), 10, policy)
    node.reset()
    docs = _drain(node)
    assert all(len(d["tokens"]) <= 10 for d in docs)
    assert [d["doc_id"] for d in docs] == list(range(len(docs)))
    if policy == "split":
        # every token of every document reaches exactly one piece, in order
        assert [len(d["tokens"]) for d in docs] == [10, 10, 7, 4, 10, 1]
        for parent, text in enumerate(texts):
            pieces = [d for d in docs if d["parent_id"] == parent]
            assert [p["piece"] for p in pieces] == list(range(len(pieces)))
            joined = np.concatenate([p["tokens"] for p in pieces]).tolist()
            assert joined == ByteTokenizer().encode(text)
    else:
        assert [len(d["tokens"]) for d in docs] == [10, 4, 10]
        assert node.truncated_tokens == 17 + 1


def test_long_document_error_policy(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", ["x" * 50])
    node = DocumentNode(
        TextSource("jsonl", str(tmp_path / "d.jsonl")), ByteTokenizer(), 10, "error"
    )
    node.reset()
    with pytest.raises(DataError, match="52 tokens > max_doc_len = 10"):
        node.next()


def test_document_node_resumes_exactly(tmp_path):
    rng = np.random.default_rng(0)
    texts = ["".join("xyz"[i % 3] for i in range(int(n))) for n in rng.integers(1, 40, 30)]
    _write_jsonl(tmp_path / "d.jsonl", texts)
    src = TextSource("jsonl", str(tmp_path / "d.jsonl"))
    full = DocumentNode(src, ByteTokenizer(), 8, "split", epochs=2)
    full.reset()
    reference = _drain(full)
    for cut in (0, 1, 5, 17, len(reference) // 2, len(reference) - 1):
        node = DocumentNode(src, ByteTokenizer(), 8, "split", epochs=2)
        node.reset()
        for _ in range(cut):
            node.next()
        state = node.state_dict()
        resumed = DocumentNode(src, ByteTokenizer(), 8, "split", epochs=2)
        resumed.reset(state)
        rest = _drain(resumed)
        assert [d["doc_id"] for d in rest] == [d["doc_id"] for d in reference[cut:]]
        for a, b in zip(rest, reference[cut:], strict=True):
            np.testing.assert_array_equal(a["tokens"], b["tokens"])


def test_sources_read_jsonl_text_and_parquet(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "x.txt").write_text("first file")
    (tmp_path / "txt" / "y.txt").write_text("second file")
    assert [t for _, t in TextSource("jsonl", str(tmp_path)).open_texts()] == ["one", "two"]
    assert [t for _, t in TextSource("jsonl", str(tmp_path)).open_texts(1)] == ["two"]
    texts = [t for _, t in TextSource("text", str(tmp_path / "txt")).open_texts()]
    assert texts == ["first file", "second file"]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["p1", "p2", "p3"]}), tmp_path / "t.parquet")
    src = TextSource("parquet", str(tmp_path / "t.parquet"), text_field="body")
    assert [t for _, t in src.open_texts(1)] == ["p2", "p3"]


def test_bad_data_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON line"):
        list(TextSource("jsonl", str(bad)).open_texts())
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "ok"}\n{"text": ""}\n')
    with pytest.raises(DataError, match=r"empty\.jsonl:2: empty document"):
        list(TextSource("jsonl", str(empty)).open_texts())
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"nofield\.jsonl:1: expected a JSON object with field"):
        list(TextSource("jsonl", str(nofield)).open_texts())
    with pytest.raises(DataError, match="matches no jsonl file"):
        TextSource("jsonl", str(tmp_path / "missing"))
    with pytest.raises(DataError, match="needs \\[training\\] dataset_path"):
        TextSource("jsonl", "")
    with pytest.raises(DataError, match="'c4' is not accepted"):
        TextSource("c4", "x")


def test_builtin_corpus_is_real_long_tailed_text():
    docs = build_builtin_corpus()
    lens = np.array([len(d.encode()) for d in docs])
    assert len(docs) > 1000
    assert np.median(lens) < 400  # most documents short ...
    assert (lens > 8192).sum() >= 10  # ... a few long ones
    assert all(d.strip() for d in docs)
    assert sum("the" in d for d in docs) > len(docs) // 2  # English prose, not code


def _step_stream(n_steps, mbs_per_step, seed=0):
    rng = np.random.default_rng(seed)
    steps = []
    for s in range(n_steps):
        mbs = []
        for _ in range(mbs_per_step):
            lens = rng.integers(1, 6, rng.integers(1, 4))
            mbs.append({"tokens": rng.integers(0, 256, lens.sum()), "doc_lens": lens})
        steps.append({"micro_batches": mbs, "stats": {"imbalance": 1.0 + s}})
    return steps


def test_micro_batch_node_unrolls_steps_and_resumes_mid_step():
    steps = _step_stream(5, 3)
    node = MicroBatchNode(IterableWrapper(steps))
    node.reset()
    ref = _drain(node)
    assert len(ref) == 15
    assert ref[0][0]["wlb_stats"] == {"imbalance": 1.0}
    assert "wlb_stats" not in ref[1][0]
    for cut in range(16):
        node = MicroBatchNode(IterableWrapper(steps))
        node.reset()
        for _ in range(cut):
            node.next()
        resumed = MicroBatchNode(IterableWrapper(steps))
        resumed.reset(node.state_dict())
        rest = _drain(resumed)
        assert len(rest) == 15 - cut
        for (a, la), (b, lb) in zip(rest, ref[cut:], strict=True):
            assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)


def test_dataloader_restores_state_after_template_state_dict():
    """TorchTitan's checkpointer calls state_dict() before load_state_dict(); resume must hold."""
    from torchtitan_wlb.data.dataloader import WLBDataLoader

    steps = _step_stream(6, 2, seed=3)

    def make():
        return WLBDataLoader(MicroBatchNode(IterableWrapper(steps)), dp_rank=0, dp_world_size=1)

    ref = [inp["input"] for inp, _ in make()]
    loader = make()
    it = iter(loader)
    for _ in range(5):
        next(it)
    saved = loader.state_dict()
    resumed = make()
    resumed.state_dict()  # the checkpointer's template request
    resumed.load_state_dict(saved)
    rest = [inp["input"] for inp, _ in resumed]
    assert len(rest) == len(ref) - 5
    assert all(torch.equal(a, b) for a, b in zip(rest, ref[5:], strict=True))
    with pytest.raises(ValueError, match="DP degree 1, this run has 2"):
        WLBDataLoader(MicroBatchNode(IterableWrapper(steps)), 0, 2).load_state_dict(
            {**saved, "world_size": 1}
        )


def test_hf_source_reads_a_local_dataset_offline(tmp_path, monkeypatch):
    """`dataset = "hf"` with a local directory works without network (HF_DATASETS_OFFLINE)."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "ds").mkdir()
    _write_jsonl(tmp_path / "ds" / "train.jsonl", ["first doc", "second doc", "third"])
    texts = [t for _, t in TextSource("hf", str(tmp_path / "ds")).open_texts(1)]
    assert texts == ["second doc", "third"]


def test_truncate_policy_logs_the_dropped_tokens(tmp_path, caplog):
    _write_jsonl(tmp_path / "d.jsonl", ["x" * 50, "y" * 5, "z" * 30])
    node = DocumentNode(
        TextSource("jsonl", str(tmp_path / "d.jsonl")), ByteTokenizer(), 10, "truncate"
    )
    node.reset()
    with caplog.at_level("WARNING"):
        docs = _drain(node)
    assert [d["tokens"].size for d in docs] == [10, 7, 10]
    assert node.truncated_tokens == 42 + 22 and node.truncated_docs == 2
    logged = [r.getMessage() for r in caplog.records if "long_doc_policy" in r.getMessage()]
    assert logged == [
        "long_doc_policy = 'truncate': document 0 cut to 10 tokens, 42 dropped; 1 documents and "
        "42 tokens dropped so far"
    ]
