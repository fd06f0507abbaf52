"""[validation]: the held-out split training never reads, the layout-free held-out set, and the
one-line refusals (the multi-process layout test is in tests/test_e2e_4d.py, the resume one in
tests/test_train_smoke.py)."""

import copy
import json
import os
import re

import numpy as np
import pytest
from torchtitan.components.loss import IGNORE_INDEX

from torchtitan_wlb.config import ConfigError
from torchtitan_wlb.data.heldout import deal, pack_sequences, read_heldout_documents
from torchtitan_wlb.data.sources import DataError, TextSource, builtin_corpus, builtin_split
from torchtitan_wlb.data.tokenizer import ByteTokenizer
from torchtitan_wlb.validate import check_job_config, main, parse_job_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")


def test_training_never_reads_the_builtin_heldout_split():
    corpus = builtin_corpus()
    heldout = builtin_split(heldout=True)
    training = [text for _, text in TextSource("wlb_builtin").open_texts()]
    assert len(heldout) == len(corpus) // 20 and len(training) + len(heldout) == len(corpus)
    assert training + heldout == corpus  # disjoint parts, in order: no text in both
    streamed = [text for _, text in TextSource("wlb_builtin_validation").open_texts()]
    assert streamed == heldout


def test_heldout_set_is_packed_like_training_and_dealt_whole():
    docs = read_heldout_documents(TextSource("wlb_builtin_validation"), ByteTokenizer(), 96, 2000)
    assert sum(d.size for d in docs) >= 2000 and max(d.size for d in docs) <= 96
    sequences = pack_sequences(docs, 96)
    assert all(s.tokens.size <= 96 for s in sequences)
    assert np.array_equal(np.concatenate([s.tokens for s in sequences]), np.concatenate(docs))
    for world in (1, 2, 3):  # every sequence on exactly one rank, whatever the DP degree
        shares = [deal(sequences, r, world) for r in range(world)]
        assert sorted(id(s) for share in shares for s in share) == sorted(map(id, sequences))
    input_dict, labels = sequences[0].batch()
    ends = np.cumsum(sequences[0].doc_lens)
    # no label across a document boundary; positions restart at every document
    assert (labels[0, ends - 1] == IGNORE_INDEX).all()
    assert (input_dict["positions"][0, ends[:-1]] == 0).all()


@pytest.fixture
def own_data(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": "word " * (5 + i)}) + "\n" for i in range(30)))
    return train


def test_validation_refusals_are_one_line(capsys, own_data, tmp_path):
    args = ["--job.config_file", DEBUG_CPU, "--model.flavor", "tiny", "--validation.enable"]
    os.environ["NGPU"] = "2"
    try:  # the pre-flight check: one line, exit status 2, before any rank starts
        assert main([*args, "--validation.dataset", "c4_validation"]) == 2
    finally:
        del os.environ["NGPU"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: [validation] dataset = 'c4_validation'")
    assert "wlb_builtin_validation" in err
    good = parse_job_config(args)
    check_job_config(good, world_size=2)
    own = {"dataset": "jsonl", "dataset_path": str(own_data)}
    cases = [  # (table, changes, what the line says)
        ("validation", {"dataset": "wlb_builtin"}, "holds documents training reads too"),
        ("training", {"dataset": "wlb_builtin_validation"}, "is the built-in corpus's held-out"),
        ("validation", {"seq_len": 4096}, "[validation] seq_len = 4096 exceeds the model's"),
        ("validation", {"freq": 0}, "[validation] freq = 0 is out of range"),
        ("validation", {"dataset": "jsonl", "dataset_path": str(tmp_path / "none.jsonl")},
         "[validation] dataset_path"),
    ]  # fmt: skip
    for table, changes, expected in cases:
        job_config = copy.deepcopy(good)
        for key, value in changes.items():
            setattr(getattr(job_config, table), key, value)
        with pytest.raises((ConfigError, DataError), match=re.escape(expected)):
            check_job_config(job_config, world_size=2)
    job_config = copy.deepcopy(good)  # your own files: the same files for both are refused
    vars(job_config.training).update(own)
    vars(job_config.validation).update(own)
    with pytest.raises(ConfigError, match="holds documents training reads too"):
        check_job_config(job_config, world_size=2)
