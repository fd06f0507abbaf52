"""The model catalogue: one shape per name, TorchTitan's own where TorchTitan has the model, and
every registered llama3_wlb flavor built from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.model import FeedForward

from torchtitan_wlb.models.catalogue import DIM_FIELDS, MODELS, PAPER_MODELS, ModelSpec, get_model
from torchtitan_wlb.models.llama3_wlb import FLAVORS, llama3_wlb_args
from torchtitan_wlb.sim.reproduce import PAPER_TABLE1

REPO = Path(__file__).resolve().parents[1]
SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")


def torchtitan_ffn(args) -> int:
    """The SwiGLU width TorchTitan's own FeedForward builds from ``args`` (on the meta device)."""
    with torch.device("meta"):
        ffn = FeedForward(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
    return ffn.w1.out_features


def ffn_hidden_dim(args) -> int:
    """The SwiGLU hidden size TorchTitan's FeedForward derives from the model args, by its formula."""
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


def test_catalogue_and_workloads_import_without_torch():
    code = (
        "import sys, torchtitan_wlb.models.catalogue, torchtitan_wlb.workloads; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.parametrize("ours, theirs", [("llama3_8B", "8B"), ("llama3_70B", "70B")])
def test_llama3_models_are_torchtitans(ours, theirs):
    spec, ref = get_model(ours), llama3_args[theirs]
    assert [getattr(spec, f) for f in SHAPE] == [getattr(ref, f) for f in SHAPE]
    assert spec.ffn_hidden_dim == torchtitan_ffn(ref)


def test_every_flavor_is_its_catalogue_model():
    assert set(llama3_wlb_args) == set(FLAVORS)
    for flavor, args in llama3_wlb_args.items():
        spec = get_model(FLAVORS[flavor])
        assert [getattr(args, f) for f in SHAPE] == [getattr(spec, f) for f in SHAPE], flavor
        assert torchtitan_ffn(args) == ffn_hidden_dim(args) == spec.ffn_hidden_dim, flavor
        assert args.rope_theta == 500000
    for flavor in ("8B", "70B"):  # the Llama 3.1 flavors are TorchTitan's but for the FFN recipe
        ours, ref = llama3_wlb_args[flavor], llama3_args[flavor]
        for field in (*SHAPE, "rope_theta", "norm_eps", "max_seq_len"):
            assert getattr(ours, field) == getattr(ref, field), (flavor, field)
    assert {FLAVORS[f"paper_{m}"] for m in PAPER_MODELS} == set(PAPER_MODELS)


@pytest.mark.parametrize("row", PAPER_TABLE1, ids=lambda r: f"{r.model}-{r.context_len}")
def test_paper_models_fit_their_table1_layouts(row):
    """TorchTitan shards query and K/V heads over TP, and the layers over PP x 2 interleaved
    stages: every Table 1 layout must divide them."""
    spec = get_model(row.model)
    assert spec.n_heads % row.layout.tp == 0
    assert spec.n_kv_heads % row.layout.tp == 0
    assert spec.n_layers % (2 * row.layout.pp) == 0


@pytest.mark.parametrize("name, billions", [("550M", 0.55), ("7B", 7), ("30B", 30), ("70B", 70)])
def test_paper_models_have_their_nominal_size(name, billions):
    assert 0.85 < get_model(name).n_params / (billions * 1e9) < 1.2


def test_lookup_and_validation():
    assert get_model(" 550m ") is MODELS["550M"]
    assert get_model("LLAMA3_8b") is MODELS["llama3_8B"]
    assert tuple(get_model("7B").dims()) == DIM_FIELDS
    with pytest.raises(ValueError, match="unknown model preset '1T'; accepted: 550M, 7B, 30B"):
        get_model("1T")
    with pytest.raises(ValueError, match="not divisible by n_kv_heads=3"):
        ModelSpec("x", dim=64, n_layers=1, n_heads=4, n_kv_heads=3, ffn_hidden_dim=8, vocab_size=8)
    with pytest.raises(ValueError, match="n_layers=0"):
        ModelSpec("x", dim=64, n_layers=0, n_heads=4, n_kv_heads=2, ffn_hidden_dim=8, vocab_size=8)
