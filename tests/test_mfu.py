"""The step line's ``tflops`` and ``mfu``: the FLOPs they divide equal a count made directly from
the micro-batches' documents (token by token, from each token's position in its document), with and
without CP and over a pipeline step's micro-batches; TensorBoard gets them under TorchTitan's names.
"""

import logging
import types

import numpy as np
import pytest
import torch

from torchtitan_wlb import metrics
from torchtitan_wlb.cp import build_cp_plan
from torchtitan_wlb.data.collate import collate_micro_batch
from torchtitan_wlb.metrics import WLBMetricsProcessor
from torchtitan_wlb.mfu import resolve_peak_flops, table_peak_tflops
from torchtitan_wlb.models.llama3_wlb import WLBTransformer, llama3_wlb_args
from torchtitan_wlb.trainer import WLBTrainer
from torchtitan_wlb.validate import parse_job_config

FLAVOR = "tiny"
# A step's micro-batches (under PP the schedule's): short and long documents, one of a token.
STEP = [[7, 1, 120, 3], [64, 64, 1], [200], [5] * 20]
SECONDS = 10.0  # the logged interval (the processor's clock is fixed)
PEAK_TFLOPS = 50.0


@pytest.fixture(scope="module")
def model():
    """The flavor's arguments and its model on the meta device (no memory, no initialisation)."""
    args = llama3_wlb_args[FLAVOR]
    with torch.device("meta"):
        return args, WLBTransformer(args)


def direct_flops(model, queries):
    """FLOPs of one rank's work, counted without torchtitan_wlb.mfu: ``queries`` are the document
    positions of the query tokens it computed. Per token, 2 FLOPs per parameter outside the
    embedding forward and 4 backward; per query at position p, p + 1 keys, each costing the scores'
    and the output's matmuls, 2 FLOPs per head dimension each, forward and twice that backward."""
    args, module = model
    params = sum(p.numel() for n, p in module.named_parameters() if not n.startswith("tok_emb"))
    keys = sum(p + 1 for p in queries)
    per_key = 3 * 2 * 2 * args.n_layers * args.n_heads * (args.dim // args.n_heads)
    return 6 * params * len(queries) + per_key * keys


@pytest.fixture(scope="module")
def cfg():
    """The job's config, parsed once (the processor reads the peak at construction)."""
    argv = ["--job.config_file", "train_configs/debug_cpu.toml", "--model.flavor", FLAVOR]
    return parse_job_config(argv)


def processor(cfg, model, parallel=None, peak=PEAK_TFLOPS):
    """A rank's metrics processor as the trainer builds it (TorchTitan sets the FLOPs per token
    from the model's arguments), logging to a list in place of TensorBoard."""
    args, module = model
    cfg.wlb.advanced.peak_tflops = peak
    dims = {"non_data_parallel_size": 1, "pp_enabled": False, "tp": 1, "pp": 1, **(parallel or {})}
    proc = WLBMetricsProcessor(cfg, types.SimpleNamespace(**dims), args)
    proc.num_flops_per_token = args.get_nparams_and_flops(module, cfg.training.seq_len)[1]
    proc.received = []
    proc._tap.inner = types.SimpleNamespace(log=lambda m, step: proc.received.append(m))
    return proc


def log_step(proc, monkeypatch):
    """Log step 1, ``SECONDS`` after the interval began; TorchTitan's figures for it."""
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: 100.0))
    proc.start_at(1)
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: 100 + SECONDS))
    proc.data_loading_times = [0.0]
    proc.log(1, 1.0, 1.0, 1.0)
    return proc.received[-1]


def through_trainer(proc, cfg, step):
    """The step's micro-batches through the trainer's own hook (no CP: each whole)."""
    trainer = WLBTrainer.__new__(WLBTrainer)
    dims = types.SimpleNamespace(cp_enabled=False, tp_enabled=False)
    trainer.__dict__.update(
        metrics_processor=proc, _audit=None, _fit=None, job_config=cfg, parallel_dims=dims
    )
    for lens in step:
        input_dict, labels = collate_micro_batch(np.zeros(sum(lens), np.int64), np.array(lens))
        trainer.post_dataloading_process(input_dict, labels)


@pytest.mark.parametrize("pp", [1, 2])
def test_flops_of_whole_micro_batches(cfg, model, monkeypatch, caplog, pp):
    """No CP; with ``pp = 2`` each of the two stages reports half of every micro-batch."""
    proc = processor(cfg, model, {"pp": pp, "pp_enabled": pp > 1})
    through_trainer(proc, cfg, STEP)
    caplog.set_level(logging.INFO)
    figures = log_step(proc, monkeypatch)
    want = direct_flops(model, [p for lens in STEP for d in lens for p in range(d)]) / pp
    assert figures["tflops"] * 1e12 * SECONDS == pytest.approx(want, rel=1e-3)
    assert figures["wlb/model_flops"] == pytest.approx(want, rel=1e-3)
    mfu = 100 * want / SECONDS / (PEAK_TFLOPS * 1e12)
    assert figures["mfu(%)"] == pytest.approx(mfu, rel=1e-3)
    tflops = want / SECONDS / 1e12
    assert f"tflops: {tflops:,.2f}  mfu: {mfu:.2f}%" in caplog.text  # the step line


@pytest.mark.parametrize(
    "cp, strategy", [(2, "per_document"), (2, "hybrid"), (3, "per_sequence")]
)  # fmt: skip
def test_flops_of_each_cp_rank(cfg, model, monkeypatch, cp, strategy):
    """Under CP each rank reports its own share by the micro-batch's plan, the sharding's padding
    (a last document past the micro-batch's own) left out; the shares add up to the whole."""
    pad = 5
    plans = [build_cp_plan(np.array([*lens, pad]), cp, strategy) for lens in STEP]
    total = 0.0
    for rank in range(cp):
        proc = processor(cfg, model, {"non_data_parallel_size": cp})
        queries = []
        for lens, plan in zip(STEP, plans, strict=True):
            proc.flops.cp_share(plan, rank, n_docs=len(lens))  # as WLBTrainer._shard_for_cp
            tokens, positions = plan.rank_indices(rank)
            queries += positions[tokens < sum(lens)].tolist()
        figures = log_step(proc, monkeypatch)
        want = direct_flops(model, queries)
        assert figures["tflops"] * 1e12 * SECONDS == pytest.approx(want, rel=1e-3)
        total += figures["wlb/model_flops"]
    whole = direct_flops(model, [p for lens in STEP for d in lens for p in range(d)])
    assert total == pytest.approx(whole, rel=1e-9)


def test_no_peak_no_mfu(cfg, model, monkeypatch, caplog):
    """On a CPU without ``[wlb.advanced] peak_tflops``: ``mfu: n/a``, and no ``mfu(%)`` for
    TensorBoard; ``tflops`` still the documents' own."""
    proc = processor(cfg, model, peak=0.0)
    through_trainer(proc, cfg, STEP[:1])
    caplog.set_level(logging.INFO)
    figures = log_step(proc, monkeypatch)
    assert "mfu(%)" not in figures and figures["tflops"] > 0 and "mfu: n/a" in caplog.text


def test_peak_table():
    assert table_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert table_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert table_peak_tflops("NVIDIA H200") == 989.0
    assert table_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert table_peak_tflops("NVIDIA B200") == 2250.0
    assert table_peak_tflops("NVIDIA L4") is None
    assert resolve_peak_flops(0.0, "NVIDIA H200", on_cpu=False)[0] == 989e12
    assert resolve_peak_flops(0.0, "AMD EPYC x2", on_cpu=True)[0] is None
    assert resolve_peak_flops(0.0, "NVIDIA L4", on_cpu=False) == (
        None,
        "Peak FLOPS: unknown for NVIDIA L4, MFU not reported; set [wlb.advanced] peak_tflops "
        "to its dense bf16 TFLOP/s",
    )
    assert resolve_peak_flops(121.0, "NVIDIA L4", on_cpu=False)[0] == 121e12
