"""Megatron indexed corpora: files from megatron-core's own writer read back exactly, our writer's
files read by megatron-core's reader, and training from a corpus gives the micro-batches of the
same documents as jsonl text.

megatron-core imports for about ten seconds, so one process (tests/megatron_corpora.py), started
in the background when this module is collected, writes and reads every corpus these tests need;
its output is kept under the user's cache directory, keyed by its input and megatron-core's
version, and reused by later runs.
"""

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from torchtitan_wlb.data.indexed import IndexedCorpus, IndexedDocumentNode, epoch_order
from torchtitan_wlb.data.sources import DataError
from torchtitan_wlb.tools.pretokenize import write_index

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
WORDS = np.array(["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "é"])


def _texts(n=60, seed=0):
    """Documents with a long tail (the longest are cut into pieces at seq_len 128)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(min(rng.pareto(1.2) * 8 + 3, 90)))) for _ in range(n)]


def _corpora():
    """The megatron-core-written corpora: per name, (dtype, documents as lists of sequences)."""
    rng = np.random.default_rng(1)
    u16 = [[rng.integers(0, 264, int(rng.integers(1, 300)))] for _ in range(40)]
    # int32 ids above uint16's range; documents of 1-4 sequences, one of them empty
    i32 = [
        [rng.integers(0, 100_000, int(rng.integers(0 if k == 2 else 1, 90))) for k in range(n)]
        for n in rng.integers(1, 5, 30)
    ]
    return {"u16": ("uint16", u16), "i32": ("int32", i32)}


def _ours():
    """Documents our writer (``write_index``, as ``tools.pretokenize`` uses it) writes as uint16."""
    rng = np.random.default_rng(2)
    return [rng.integers(0, 65_536, int(rng.integers(1, 200))).astype(np.uint16) for _ in range(25)]


def _write_ours(prefix):
    docs = _ours()
    Path(f"{prefix}.bin").write_bytes(np.concatenate(docs).tobytes())
    write_index(f"{prefix}.idx", np.dtype(np.uint16), np.array([d.size for d in docs]))


def _start_megatron():
    """Start tests/megatron_corpora.py unless its output is cached: (process or None, its
    folder, the cache folder)."""
    spec = {}
    for name, (dtype, docs) in _corpora().items():
        seqs = [s for d in docs for s in d]
        spec[f"{name}.tokens"] = np.concatenate(seqs)
        spec[f"{name}.seq_lens"] = np.array([s.size for s in seqs])
        spec[f"{name}.doc_seqs"] = np.array([len(d) for d in docs])
        spec[f"{name}.dtype"] = np.array(dtype)
    build = tempfile.mkdtemp(prefix="megatron_corpora_")
    _write_ours(os.path.join(build, "ours"))
    try:
        key = hashlib.sha256(importlib.metadata.version("megatron-core").encode())
    except importlib.metadata.PackageNotFoundError:
        return None, build, None  # the fixture reports it
    for k in sorted(spec):
        key.update(k.encode() + spec[k].tobytes())
    for suffix in (".bin", ".idx"):
        key.update(Path(build, f"ours{suffix}").read_bytes())
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    cache = os.path.join(base, "torchtitan_wlb", "megatron_corpora", key.hexdigest()[:16])
    if os.path.isfile(os.path.join(cache, "read.npz")):
        return None, build, cache
    np.savez(os.path.join(build, "input.npz"), read=np.array([os.path.join(build, "ours")]), **spec)
    with open(os.path.join(build, "log.txt"), "w") as log:
        script = os.path.join(ROOT, "tests", "megatron_corpora.py")
        proc = subprocess.Popen([sys.executable, script, build], stdout=log, stderr=log)
    return proc, build, cache


_MEGATRON = _start_megatron()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The folder of the corpora of :func:`_corpora`, ``read.npz`` (our writer's ``ours``, as
    megatron-core reads it), ``docs.jsonl`` (:func:`_texts`) and ``ours``: that file by
    ``tools.pretokenize``."""
    from torchtitan_wlb.tools.pretokenize import main as pretokenize

    proc, build, cache = _MEGATRON
    assert cache is not None, "megatron-core is not installed: pip install -e '.[dev]'"
    if proc is not None:
        assert proc.wait() == 0, Path(build, "log.txt").read_text()[-3000:]
        read = dict(np.load(os.path.join(build, "read.npz")))
        ours = os.path.join(build, "ours")
        np.savez(os.path.join(build, "read.npz"), **{k.replace(ours, "ours"): v
                                                     for k, v in read.items()})  # fmt: skip
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        shutil.copytree(build, f"{cache}.{os.getpid()}", dirs_exist_ok=True)
        if not os.path.exists(cache):
            os.replace(f"{cache}.{os.getpid()}", cache)
    shutil.rmtree(build, ignore_errors=True)
    work = tmp_path_factory.mktemp("megatron")
    for name in [*_corpora(), "read"]:
        for suffix in (".bin", ".idx") if name != "read" else (".npz",):
            shutil.copy(os.path.join(cache, name + suffix), work / (name + suffix))
    with open(work / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in _texts())
    assert pretokenize([str(work / "ours"), "--dataset", "jsonl", "--dataset-path",
                        str(work / "docs.jsonl"), "--workers", "2"]) == 0  # fmt: skip
    return work


@pytest.mark.parametrize("name", ["u16", "i32"])
def test_megatron_written_corpus_reads_back_exactly(corpora, name):
    dtype, docs = _corpora()[name]
    corpus = IndexedCorpus(str(corpora / name))
    assert corpus.dtype == np.dtype(dtype) and corpus.num_docs == len(docs)
    whole = [np.concatenate(d) for d in docs]  # a document: its sequences back to back
    assert corpus.doc_lens.tolist() == [w.size for w in whole]
    for i, w in enumerate(whole):
        for start in (0, w.size // 3):
            out = np.empty(w.size - start, np.int32)
            corpus.read_into(i, start, out)
            np.testing.assert_array_equal(out, w[start:])
    # Documents cut into pieces of at most 64 tokens, in a seeded order, read one by one.
    node = IndexedDocumentNode(corpus, max_doc_len=64, shuffle_seed=5, vocab_size=100_000)
    node.reset()
    expect = [p for i in epoch_order(len(docs), 5, 0)
              for p in np.array_split(whole[i], np.arange(64, whole[i].size, 64)) if p.size]  # fmt: skip
    got = []
    for item in node:
        doc, start = item["where"].tolist()
        got.append(np.empty(item["length"], np.int32))
        node.fetch_tokens([(doc, start, item["length"])], got[-1])
    assert len(got) == len(expect)
    assert all(np.array_equal(a, b) for a, b in zip(got, expect, strict=True))
    strict = IndexedDocumentNode(corpus, max_doc_len=64, policy="error")
    strict.reset()
    first = next(i for i, w in enumerate(whole) if w.size > 64)  # in the corpus order
    with pytest.raises(DataError, match=f"document {first} .* > max_doc_len = 64"):
        strict.read_lengths(10**9)


def test_our_writer_reads_in_megatron_and_pretokenize_uses_it(corpora, tmp_path):
    """Our writer's files, read by megatron-core: one sequence per document, the dtype, the
    tokens. ``tools.pretokenize`` writes exactly those files for the byte tokenizer's ids (uint16:
    the smallest dtype for 264 ids), and records the tokenizer beside them."""
    from torchtitan_wlb.data.tokenizer import ByteTokenizer

    read = np.load(corpora / "read.npz")
    docs = _ours()
    assert str(read["ours.dtype"]) == "uint16"
    np.testing.assert_array_equal(read["ours.doc_idx"], np.arange(len(docs) + 1))
    np.testing.assert_array_equal(read["ours.seq_lens"], [d.size for d in docs])
    np.testing.assert_array_equal(read["ours.tokens"], np.concatenate(docs))
    ids = [np.asarray(ByteTokenizer().encode(t), np.uint16) for t in _texts()]
    write_index(str(tmp_path / "expect.idx"), np.dtype(np.uint16), np.array([i.size for i in ids]))
    assert (corpora / "ours.idx").read_bytes() == (tmp_path / "expect.idx").read_bytes()
    assert (corpora / "ours.bin").read_bytes() == np.concatenate(ids).tobytes()
    record = json.loads((corpora / "ours.tokenizer.json").read_text())
    assert record["tokenizer"] == "bytes" and record["documents"] == len(ids)


def _loader_batches(args, dp):
    """Every rank's micro-batches of a finite pass, step by step: per step, per rank, the list of
    (document lengths, ids, tokens)."""
    from torchtitan_wlb.data.dataloader import build_wlb_dataloader
    from torchtitan_wlb.data.tokenizer import ByteTokenizer
    from torchtitan_wlb.models.llama3_wlb import cost_model_for_job
    from torchtitan_wlb.validate import parse_job_config

    cfg = parse_job_config(args)
    ranks = []
    for rank in range(dp):
        loader = build_wlb_dataloader(dp, rank, ByteTokenizer(), cfg, cost_model_for_job(cfg))
        ranks.append(
            [
                (inp["doc_lens"].tolist(), inp["doc_ids"].tolist(), inp["input"].tolist())
                for inp, _ in loader
            ]
        )
    return ranks


def test_indexed_gives_the_micro_batches_of_the_same_jsonl(corpora):
    """Same tokenizer, same order (shuffle_seed unset): the same micro-batches on each DP rank."""
    base = ["--job.config_file", DEBUG_CPU, "--model.flavor", "tiny", "--training.seq_len", "128",
            "--wlb.micro_batch_max_len", "160", "--training.global_batch_size", "4",
            "--wlb.epochs", "1"]  # fmt: skip
    text = _loader_batches([*base, "--training.dataset", "jsonl",
                            "--training.dataset_path", str(corpora / "docs.jsonl")], dp=2)  # fmt: skip
    indexed = _loader_batches([*base, "--training.dataset", "indexed",
                               "--training.dataset_path", str(corpora / "ours")], dp=2)  # fmt: skip
    assert len(text[0]) > 5 and sum(len(d) for d, _, _ in text[0]) > 10
    assert indexed == text


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _fault_missing_bin(p):
    os.remove(f"{p}.bin")


def _fault_truncated_bin(p):
    os.truncate(f"{p}.bin", os.path.getsize(f"{p}.bin") - 2)


def _fault_last_pointer(p):
    n = int(np.fromfile(f"{p}.idx", np.uint64, 1, offset=18)[0])
    _patch(f"{p}.idx", 34 + 4 * n + 8 * (n - 1), np.int64(10**9).tobytes())


def _fault_other_tokenizer(p):
    path = Path(f"{p}.tokenizer.json")
    record = json.loads(path.read_text())
    record.update(tokenizer="huggingface", sha256="ab" * 32)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "fault, expected",
    [
        (_fault_missing_bin, ["ours.bin: missing"]),
        (_fault_truncated_bin, ["ours.bin: truncated", "pointers past the end"]),
        (lambda p: _patch(f"{p}.idx", 0, b"NOTANIDX\x00"), ["ours.idx: bad magic"]),
        (lambda p: _patch(f"{p}.idx", 9, np.uint64(2).tobytes()), ["ours.idx: version 2"]),
        (lambda p: _patch(f"{p}.idx", 17, b"\x06"), ["ours.idx: token dtype code 6"]),
        (_fault_last_pointer, ["ours.bin: truncated", "sequence 59 at bytes 1000000000"]),
        (_fault_other_tokenizer, ["ours.tokenizer.json: the corpus was tokenized with a Hugging "
                                  "Face tokenizer.json", "this run uses the built-in byte"]),
        ("i32", ["i32.bin: token id 99951", "outside the tokenizer's vocabulary (264)"]),
    ],
)  # fmt: skip
def test_validate_refuses_a_bad_corpus_in_one_line(corpora, tmp_path, capsys, fault, expected):
    from torchtitan_wlb.validate import main

    prefix = corpora / "i32" if fault == "i32" else tmp_path / "ours"
    if fault != "i32":
        for suffix in (".bin", ".idx", ".tokenizer.json"):
            shutil.copy(corpora / f"ours{suffix}", tmp_path / f"ours{suffix}")
        fault(str(prefix))
    args = ["--job.config_file", DEBUG_CPU, "--model.flavor", "tiny", "--training.dataset",
            "indexed", "--training.dataset_path", str(prefix), "--job.dump_folder",
            str(tmp_path / "run")]  # fmt: skip
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(e in err for e in expected), err


def test_shuffle_seed_needs_an_indexed_corpus(corpora, tmp_path, capsys):
    from torchtitan_wlb.validate import main

    args = ["--job.config_file", DEBUG_CPU, "--training.dataset", "jsonl", "--training.dataset_path",
            str(corpora / "docs.jsonl"), "--wlb.shuffle_seed", "3"]  # fmt: skip
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: [wlb] shuffle_seed = 3 needs [training] dataset = 'indexed' (a text source is "
        "read in its order), not 'jsonl'; leave it unset (-1)"
    )


def test_shuffled_indexed_loader_resumes_exactly(corpora):
    """Mid-pass, with documents read ahead and outliers queued: a loader restored from the state
    gives the rest of the micro-batches, over two shuffled epochs."""
    from torchtitan_wlb.data.dataloader import build_wlb_dataloader
    from torchtitan_wlb.data.tokenizer import ByteTokenizer
    from torchtitan_wlb.models.llama3_wlb import cost_model_for_job
    from torchtitan_wlb.validate import parse_job_config

    cfg = parse_job_config(["--job.config_file", DEBUG_CPU, "--model.flavor", "tiny",
                            "--training.seq_len", "128", "--wlb.micro_batch_max_len", "160",
                            "--training.global_batch_size", "4", "--wlb.epochs", "2",
                            "--training.dataset", "indexed", "--wlb.shuffle_seed", "3",
                            "--training.dataset_path", str(corpora / "ours")])  # fmt: skip

    def make():
        return build_wlb_dataloader(2, 1, ByteTokenizer(), cfg, cost_model_for_job(cfg))

    def ids(batches):
        return [inp["doc_ids"].tolist() for inp, _ in batches]

    ref = ids(make())
    for cut in (3, 9):
        loader = make()
        it = iter(loader)
        head = [next(it) for _ in range(cut)]
        saved = loader.state_dict()
        resumed = make()
        resumed.load_state_dict(saved)
        assert ids(head) + ids(resumed) == ref
    seen = [i for mb in ref for i in mb]  # this rank's share of two epochs, each piece once
    assert len(ref) > 20 and len(seen) == len(set(seen)) and max(seen) > len(_texts())


def test_heldout_set_from_an_indexed_corpus_is_the_jsonl_ones(corpora):
    """[validation] dataset = 'indexed': the same held-out documents as the same jsonl text (pieces
    of at most seq_len), and training on that corpus as well is refused in one line."""
    from torchtitan_wlb.data.heldout import read_heldout_documents
    from torchtitan_wlb.data.sources import TextSource
    from torchtitan_wlb.data.tokenizer import build_wlb_tokenizer
    from torchtitan_wlb.validate import ConfigError, check_job_config, parse_job_config

    args = ["--job.config_file", DEBUG_CPU, "--model.flavor", "tiny", "--validation.enable",
            "--validation.dataset", "indexed", "--validation.dataset_path", str(corpora / "ours"),
            "--validation.seq_len", "64"]  # fmt: skip
    job_config = parse_job_config(args)
    check_job_config(job_config, world_size=1)  # trains on the built-in corpus: accepted
    tokenizer = build_wlb_tokenizer(job_config)
    text = TextSource("jsonl", str(corpora / "docs.jsonl"))
    indexed = TextSource("indexed", str(corpora / "ours"))
    for budget in (None, 500):
        want = read_heldout_documents(text, tokenizer, 64, budget)
        got = read_heldout_documents(indexed, tokenizer, 64, budget)
        assert len(got) == len(want) > 3 and all(map(np.array_equal, got, want))
    same = ["--training.dataset", "indexed", "--training.dataset_path", str(corpora / "ours")]
    with pytest.raises(ConfigError, match=r"\[validation\] dataset = 'indexed'.*training reads"):
        check_job_config(parse_job_config([*args, *same]), world_size=1)


def test_pretokenize_writes_the_same_corpus_from_parquet_and_a_local_hf_dataset(
    tmp_path, monkeypatch
):
    """The same documents as jsonl, parquet and a local Hugging Face dataset folder (offline):
    ``tools.pretokenize`` writes byte-identical ``.bin`` and ``.idx`` files from each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchtitan_wlb.tools.pretokenize import main as pretokenize

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    texts = _texts(n=25, seed=3)
    (tmp_path / "hf").mkdir()
    for path in (tmp_path / "docs.jsonl", tmp_path / "hf" / "train.jsonl"):
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "docs.parquet")
    sources = {"jsonl": "docs.jsonl", "parquet": "docs.parquet", "hf": "hf"}
    for kind, path in sources.items():
        args = [str(tmp_path / kind), "--dataset", kind, "--dataset-path", str(tmp_path / path)]
        assert pretokenize([*args, "--workers", "1"]) == 0, kind
    assert IndexedCorpus(str(tmp_path / "jsonl")).num_docs == len(texts)
    for kind in ("parquet", "hf"):
        for suffix in (".bin", ".idx"):
            want = (tmp_path / f"jsonl{suffix}").read_bytes()
            assert (tmp_path / f"{kind}{suffix}").read_bytes() == want, (kind, suffix)
