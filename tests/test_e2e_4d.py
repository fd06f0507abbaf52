"""End-to-end 4D training on CPU (gloo) against a single-process reference, and held-out loss.

Every run starts from the same seed checkpoint (TorchTitan's ``create_seed_checkpoint``), so the
parallel runs and the reference hold the same weights; they see the same documents because the
packing plan is global. Step 1's loss and gradient norm compare the forward and backward passes
directly; step 2's loss also compares the optimizer update those gradients produced.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from torchtitan_wlb.audit_log import read_audit_logs
from torchtitan_wlb.tools.audit import audit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
LAUNCH = os.path.join(ROOT, "tests", "fork_launch.py")

pytestmark = pytest.mark.slow

COMMON = [
    "--job.config_file", DEBUG_CPU, "--model.flavor", "tiny", "--training.seq_len", "128",
    "--wlb.micro_batch_max_len", "160", "--training.global_batch_size", "4",
    "--wlb.advanced.metrics_jsonl", "--metrics.disable_color_printing", "--checkpoint.enable",
    "--checkpoint.interval", "1000", "--checkpoint.no-last-save-model-only", "--debug.seed", "7",
]  # fmt: skip


def _cmd(nproc, dump, *args):
    """torchtitan_wlb.train on ``nproc`` ranks, forked by torchrun's agent (tests/fork_launch.py):
    the runs below start 26 ranks, each of which would otherwise import torch and TorchTitan."""
    return [
        sys.executable,
        LAUNCH,
        f"--nproc_per_node={nproc}",
        *COMMON,
        "--job.dump_folder",
        str(dump),
        *args,
    ]


def _run(nproc, dump, *args, timeout=420):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        _cmd(nproc, dump, *args),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def _records(dump):
    """Per step, the record of a rank that holds the loss (the last pipeline stage)."""
    out: dict[int, dict] = {}
    folder = os.path.join(dump, "wlb_metrics")
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            for rec in map(json.loads, f):
                if rec["loss"] > 0:
                    out[rec["step"]] = rec  # later lines win: a resumed run rewrites steps
    return out


def _model_flops(dump):
    """Per step, the model FLOPs (``wlb/model_flops``, MFU's numerator) of every rank, summed."""
    out: dict[int, float] = {}
    folder = os.path.join(dump, "wlb_metrics")
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            for rec in map(json.loads, f):
                out[rec["step"]] = out.get(rec["step"], 0.0) + rec["wlb/model_flops"]
    return out


def _trained(dump):
    """Per step, the documents all DP ranks trained, from the audit logs of every rank (the last
    launch's record of a step wins: a resumed launch re-trains the steps after its checkpoint)."""
    by_step: dict[int, dict[int, list]] = {}
    for rec in read_audit_logs(str(dump)):
        if rec["event"] == "step":
            by_step.setdefault(rec["step"], {})[rec["dp_rank"]] = rec["micro_batches"]
    return {
        step: sorted(i for mbs in per_dp.values() for mb in mbs for i in mb)
        for step, per_dp in by_step.items()
    }


VALIDATE_EACH_STEP = ["--validation.enable", "--validation.freq", "1", "--validation.steps", "2",
                      "--validation.seq_len", "128"]  # fmt: skip


def _validation(dump):
    with open(os.path.join(dump, "wlb_validation.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """A seed checkpoint and the single-process reference run from it."""
    base = tmp_path_factory.mktemp("e2e")
    seed = base / "seed"
    _run(1, seed, "--checkpoint.create_seed_checkpoint", "--training.steps", "1")
    ref = base / "ref"
    shutil.copytree(seed / "checkpoint", ref / "checkpoint")
    _run(1, ref, "--training.steps", "2", *VALIDATE_EACH_STEP)
    return base, seed, _records(ref), _trained(ref)


LAYOUTS = {
    "dp2_cp2_pp2": (8, ["--parallelism.data_parallel_shard_degree", "2",
                        "--parallelism.context_parallel_degree", "2",
                        "--parallelism.pipeline_parallel_degree", "2"]),
    "tp2_cp2": (4, ["--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.context_parallel_degree", "2"]),
    # TP's sequence shards cross the pipeline's stages; compiled (TorchDynamo and AOTAutograd,
    # without Inductor's code generation), the loss eager under TP's loss parallelism
    "tp2_pp2_compiled": (4, ["--parallelism.tensor_parallel_degree", "2",
                             "--parallelism.pipeline_parallel_degree", "2",
                             "--compile.enable", "--compile.backend", "aot_eager"]),
    # Zero-bubble schedules: input-grad and weight-grad actions, 2 stages per rank; ZBV's V puts
    # stages 0 and 3 on rank 0. Interleaved1F1B runs the same runtime without the split
    # (tests/test_pipeline_varlen.py checks it against one process).
    "pp2_interleaved_zb": (2, ["--parallelism.pipeline_parallel_degree", "2",
                               "--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble"]),
    "pp2_zbv": (2, ["--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
}  # fmt: skip
# Schedules running 2 stages per rank (the others here: 1).
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_4d_matches_single_process(seeded, layout):
    base, seed, ref, ref_trained = seeded
    nproc, args = LAYOUTS[layout]
    run = base / layout
    shutil.copytree(seed / "checkpoint", run / "checkpoint")
    _run(nproc, run, "--training.steps", "2", "--wlb.cp_sharding", "per_document",
         *VALIDATE_EACH_STEP, *args)  # fmt: skip
    got = _records(run)
    # the held-out loss after each step, under TP and the combined layouts too
    ref_val, got_val = _validation(base / "ref"), _validation(run)
    assert [v["tokens"] for v in got_val] == [v["tokens"] for v in ref_val]
    for v, r in zip(got_val, ref_val, strict=True):
        assert v["loss"] == pytest.approx(r["loss"], rel=1e-4), v["step"]
    for step in (1, 2):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=2e-5), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=2e-4), step
        # the same documents were trained on
        assert set(got[step]["doc_ids"]) <= set(ref[step]["doc_ids"])
        if "--parallelism.pipeline_parallel_degree" in args:
            _check_pp_actions(got[step], 2 if set(MULTI_STAGE) & set(args) else 1)
    # every rank of the layout logged its documents: together, exactly the reference's
    report = audit(str(run))
    assert report.ok and report.steps == 2, report.message
    assert _trained(run) == ref_trained
    # Each rank's FLOPs are its share (CP by the plan, TP and PP splitting them, padding left
    # out): over the ranks, the same documents' FLOPs as in the single process.
    flops, ref_flops = _model_flops(run), _model_flops(base / "ref")
    assert flops == pytest.approx(ref_flops, rel=1e-9) and sorted(flops) == [1, 2]


def _check_pp_actions(record, stages_per_rank):
    """Per-action pipeline times in the metrics log, and their calibration records."""
    from torchtitan_wlb.tools.e2e_bench import calibration_records

    (act,) = record["pp_actions"]
    n_mb = len(act["doc_lens"])
    assert n_mb >= 1 and len(act["stages"]) == stages_per_rank
    for fwd, bwd in zip(act["fwd_s"], act["bwd_s"], strict=True):
        assert len(fwd) == len(bwd) == n_mb and min(fwd) > 0 and min(bwd) > 0
    recs = calibration_records([{record["step"]: record}], [record["step"]])["microbatches"]
    assert len(recs) == n_mb * stages_per_rank
    assert {r["stage"] for r in recs} == set(act["stages"])
    assert all(r["seconds"] == pytest.approx(r["fwd_s"] + r["bwd_s"]) for r in recs)


VALIDATION = [
    "--validation.enable", "--validation.freq", "1", "--validation.steps", "6",
    "--validation.seq_len", "128", "--optimizer.lr", "0", "--training.steps", "1",
]  # fmt: skip
VALIDATION_LAYOUTS = {
    "dp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
}  # fmt: skip


def _heldout_reference(checkpoint):
    """One process, no validator: the checkpoint's model on each held-out document alone, the
    mean cross-entropy over all their predicted tokens, and how many there are."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_wlb.attention.metadata import metadata_from_doc_lens
    from torchtitan_wlb.data.heldout import read_heldout_documents
    from torchtitan_wlb.data.sources import TextSource
    from torchtitan_wlb.data.tokenizer import ByteTokenizer
    from torchtitan_wlb.models.llama3_wlb import WLBTransformer, llama3_wlb_args

    model = WLBTransformer(dataclasses.replace(llama3_wlb_args["tiny"], max_seq_len=160))
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(checkpoint))
    model.load_state_dict(state)
    docs = read_heldout_documents(TextSource("wlb_builtin_validation"), ByteTokenizer(), 128, 768)
    total, count = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            tokens = torch.from_numpy(doc.astype("int64"))[None]
            logits = model(tokens, attention_masks=metadata_from_doc_lens([doc.size]))
            ce = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="sum")
            total, count = total + float(ce), count + doc.size - 1
    return total / count, count


def test_validation_loss_is_the_same_in_every_layout(seeded):
    """The held-out loss of the seed checkpoint's weights (lr 0: step 1 changes nothing) under
    DP = 2, CP = 2 and PP = 2 (evaluated through the pipeline), against one process running each
    held-out document alone: one mean over the same tokens, however packed and dealt to ranks."""
    base, seed, _, _ = seeded
    loss, tokens = _heldout_reference(seed / "checkpoint" / "step-0")
    assert tokens > 600 and 0 < loss < 10
    for name, args in VALIDATION_LAYOUTS.items():
        run = base / f"validation_{name}"
        shutil.copytree(seed / "checkpoint", run / "checkpoint")
        r = _run(2, run, *VALIDATION, *args)
        assert "validate step:  1" in r.stdout + r.stderr
        with open(run / "wlb_validation.jsonl") as f:
            (got,) = map(json.loads, f)
        assert got["tokens"] == tokens, name  # the same held-out set
        assert got["loss"] == pytest.approx(loss, abs=1e-5), name
