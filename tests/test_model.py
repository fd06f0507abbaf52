"""llama3_wlb: a packed micro-batch behaves exactly like its documents run one by one."""

import dataclasses

import numpy as np
import pytest
import torch
from test_catalogue import ffn_hidden_dim

from torchtitan_wlb.attention.metadata import metadata_from_doc_lens
from torchtitan_wlb.config import WLB, OnlineCostModel
from torchtitan_wlb.data.collate import collate_micro_batch
from torchtitan_wlb.models.llama3_wlb import WLBTransformer, cost_model_for_job, llama3_wlb_args


def _model(seed=0):
    args = dataclasses.replace(llama3_wlb_args["tiny"], max_seq_len=64)
    torch.manual_seed(seed)
    model = WLBTransformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def test_packed_documents_do_not_see_each_other():
    model = _model()
    lens = np.array([5, 1, 17, 9])
    tokens = np.random.default_rng(0).integers(0, 256, lens.sum())
    inp, _ = collate_micro_batch(tokens, lens)
    meta = metadata_from_doc_lens(inp["doc_lens"])
    packed = model(inp["input"], attention_masks=meta, positions=inp["positions"])
    start = 0
    for d in lens:
        alone = torch.from_numpy(tokens[start : start + d]).unsqueeze(0)
        ref = model(alone, attention_masks=metadata_from_doc_lens([d]))
        torch.testing.assert_close(packed[:, start : start + d], ref, rtol=1e-5, atol=1e-5)
        start += d


def test_gradients_match_documents_run_separately():
    lens = np.array([7, 3, 12])
    tokens = np.random.default_rng(1).integers(0, 256, lens.sum())
    inp, labels = collate_micro_batch(tokens, lens)
    packed_model, ref_model = _model(3), _model(3)
    meta = metadata_from_doc_lens(inp["doc_lens"])
    logits = packed_model(inp["input"], attention_masks=meta, positions=inp["positions"])
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    loss.backward()
    ref_loss = 0.0
    start = 0
    for d in lens:
        sub_inp, sub_labels = collate_micro_batch(tokens[start : start + d], np.array([d]))
        out = ref_model(sub_inp["input"], attention_masks=metadata_from_doc_lens([d]))
        ref_loss = ref_loss + torch.nn.functional.cross_entropy(
            out.flatten(0, 1), sub_labels.flatten(), ignore_index=-100, reduction="sum"
        )
        start += d
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for (name, p), (_, q) in zip(
        packed_model.named_parameters(), ref_model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def _rotated_qk(model, monkeypatch, tokens, doc_lens, positions):
    """The RoPE-rotated queries and keys every layer hands to attention, for one sequence."""
    import torchtitan_wlb.models.llama3_wlb as llama3_wlb

    seen = []
    attend = llama3_wlb.attention_from_metadata

    def spy(q, k, v, meta):
        seen.append((q.detach().clone(), k.detach().clone()))
        return attend(q, k, v, meta)

    monkeypatch.setattr(llama3_wlb, "attention_from_metadata", spy)
    meta = metadata_from_doc_lens(doc_lens)
    model(torch.as_tensor(tokens)[None], attention_masks=meta, positions=positions)
    monkeypatch.setattr(llama3_wlb, "attention_from_metadata", attend)
    return seen


def _check_positions_reset(model, monkeypatch, positions_of):
    """Every document's rotated queries and keys in the packed sequence equal those of the
    document run on its own with positions from 0.

    The attention *outputs* cannot tell: RoPE is relative, so a document whose positions run on
    from the previous one attends exactly as if they started at 0. The rotated q and k are
    absolute: a document not reset to 0 is rotated by other angles.
    """
    lens = np.array([6, 9, 4])
    tokens = np.random.default_rng(0).integers(0, 256, lens.sum())
    inp, _ = collate_micro_batch(tokens, lens)
    packed = _rotated_qk(model, monkeypatch, tokens, inp["doc_lens"], positions_of(inp))
    start = 0
    for d in lens:
        alone = _rotated_qk(
            model, monkeypatch, tokens[start : start + d], [d], torch.arange(d)[None]
        )
        for (pq, pk), (aq, ak) in zip(packed, alone, strict=True):
            torch.testing.assert_close(pq[start : start + d], aq, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pk[start : start + d], ak, rtol=1e-5, atol=1e-5)
        start += d


def test_positions_reset_at_every_document(monkeypatch):
    """The pipeline's positions restart RoPE at 0 for every document of a packed sequence."""
    _check_positions_reset(_model(), monkeypatch, lambda inp: inp["positions"])


@pytest.mark.parametrize(
    "positions_of",
    [
        lambda inp: None,  # no positions: TorchTitan numbers the packed sequence from 0
        lambda inp: torch.arange(inp["input"].shape[1])[None],  # reset_positions = False
    ],
    ids=["positions_none", "positions_not_reset"],
)
def test_position_check_fails_when_positions_are_not_reset(monkeypatch, positions_of):
    """The check above can fail: positions that run over the packed sequence are caught."""
    with pytest.raises(AssertionError):
        _check_positions_reset(_model(), monkeypatch, positions_of)


class _Cfg:
    pass


def test_cost_model_follows_flavor_dims():
    cfg = _Cfg()
    cfg.wlb = type("W", (), {"cost_model": "analytic"})()
    cfg.model = type("M", (), {"flavor": "8B"})()
    cfg.parallelism = type("P", (), {"tensor_parallel_degree": 1, "context_parallel_degree": 1})()
    cm = cost_model_for_job(cfg)
    args = llama3_wlb_args["8B"]
    assert ffn_hidden_dim(args) == 14336  # Llama 3 8B's published FFN size
    # attention FLOPs of one token pair, fwd+bwd, summed over layers: 3 * 2 * dim * n_layers
    assert cm.attn_coef == 3 * 2 * args.dim * args.n_layers
    # the break-even length of an 8B model is tens of thousands of tokens (~64K in the paper)
    assert 20_000 < cm.break_even_length < 100_000


@pytest.mark.parametrize("scale", [1.0, 1.5, 2.25])
def test_online_starts_from_the_analytic_model_with_attention_priced_up(scale):
    """ "online" starts from the FLOP model with its attention coefficient times
    ``[wlb.online] initial_attn_scale``; the linear one and the other cost models are left as they
    are."""
    cfg = _Cfg()
    cfg.model = type("M", (), {"flavor": "tiny"})()
    cfg.parallelism = type("P", (), {"tensor_parallel_degree": 1, "context_parallel_degree": 2})()
    online_table = OnlineCostModel(initial_attn_scale=scale)
    cfg.wlb = WLB(cost_model="analytic", online=online_table)
    flops = cost_model_for_job(cfg)
    cfg.wlb = WLB(cost_model="online", online=online_table)
    online = cost_model_for_job(cfg)
    assert online.attn_coef == pytest.approx(scale * flops.attn_coef, rel=1e-12)
    assert online.linear_coef == flops.linear_coef and online.unit == flops.unit == "flops"
    assert cost_model_for_job(cfg) == online  # the same model every call (every rank, resumes)
