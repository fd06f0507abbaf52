"""``[compile] enable = true`` with context and pipeline parallelism on CPU (gloo), against eager.

Each compiled run and its eager twin start from the same seed on the same layout, so they hold the
same weights and train the same documents: step 1's gradients (``tests/grad_dump.py``, rank 0's
parameters) and the first steps' losses must agree to float32 round-off. The compiled runs also
checkpoint activations selectively (TorchTitan's ``op`` and ``layer`` modes), which their eager
twins do not, so the comparison covers the custom ops under SAC too.

The compiled runs use TorchTitan's ``[compile] backend = "aot_eager"``: TorchDynamo and
AOTAutograd trace the blocks, the attention ops' fake kernels and their backward exactly as with
Inductor, without Inductor's code generation, which on two shared cores costs minutes per graph.
The hybrid run trains 20 steps of variable-length micro-batches and counts its recompiles.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CPU = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
LAUNCH = os.path.join(ROOT, "tests", "fork_launch.py")

pytestmark = pytest.mark.slow

COMMON = [
    "--job.config_file", DEBUG_CPU, "--model.flavor", "tiny", "--training.seq_len", "128",
    "--wlb.micro_batch_max_len", "160", "--training.global_batch_size", "2",
    "--wlb.advanced.metrics_jsonl", "--metrics.disable_color_printing", "--checkpoint.no-enable",
    "--debug.seed", "7", "--wlb.advanced.attention_backend", "cpu",
    # the same learning rate at steps 1-3 whatever the run's length: warmup, then constant
    "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0",
]  # fmt: skip
COMPILED = ["--compile.enable", "--compile.backend", "aot_eager"]
MAX_RECOMPILES = 4  # after step 1, over 20 steps of variable-length micro-batches

# name -> (ranks, layout arguments, compiled run's extra arguments, compiled run's steps)
LAYOUTS = {
    "pp2_cp2_per_document": (
        4,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree",
         "2", "--wlb.cp_sharding", "per_document"],
        ["--activation_checkpoint.mode", "selective",
         "--activation_checkpoint.selective_ac_option", "op"],
        3,
    ),
    "cp2_hybrid": (
        2,
        ["--parallelism.context_parallel_degree", "2", "--wlb.cp_sharding", "hybrid"],
        ["--activation_checkpoint.mode", "selective",
         "--activation_checkpoint.selective_ac_option", "1"],
        20,
    ),
}  # fmt: skip


def _run(nproc: int, dump, args: list[str], grads) -> list[dict]:
    """One launch; the last rank's metrics records (the last pipeline stage's, which holds the
    loss), one per step."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WLB_TEST_GRADS=str(grads))
    env["WLB_ALLOW_OVERSUBSCRIBE"] = "1"
    cmd = [sys.executable, LAUNCH, f"--nproc_per_node={nproc}", *COMMON]
    cmd += ["--job.dump_folder", str(dump), *args]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    # The step line counts the documents' FLOPs whether the model is compiled or not.
    assert re.search(r"tflops: \d+\.\d\d  mfu: n/a", r.stdout + r.stderr), r.stderr[-3000:]
    with open(os.path.join(dump, "wlb_metrics", f"rank_{nproc - 1}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def runs(request, tmp_path_factory):
    """The eager and the compiled run of one layout: (records, step-1 gradients) each."""
    name = request.param
    nproc, layout, extra, steps = LAYOUTS[name]
    base = tmp_path_factory.mktemp(name)
    eager = _run(nproc, base / "eager", [*layout, "--training.steps", "3"], base / "eager.pt")
    compiled_args = [*layout, *COMPILED, *extra, "--training.steps", str(steps)]
    compiled = _run(nproc, base / "compiled", compiled_args, base / "compiled.pt")
    return (
        name,
        (eager, torch.load(base / "eager.pt")),
        (compiled, torch.load(base / "compiled.pt")),
    )


def _plain(grads: dict) -> dict:
    """Parameter names without the wrappers compile and activation checkpointing add."""
    wrappers = ("_orig_mod.", "_checkpoint_wrapped_module.")
    renamed = {}
    for name, grad in grads.items():
        for wrapper in wrappers:
            name = name.replace(wrapper, "")
        renamed[name] = grad
    return renamed


def test_compiled_matches_eager(runs):
    name, (eager, eager_grads), (compiled, compiled_grads) = runs
    compiled_grads = _plain(compiled_grads)
    for step in range(3):
        want, got = eager[step]["loss"], compiled[step]["loss"]
        assert want > 0, f"{name}: no loss on the last rank"
        assert abs(got - want) <= 1e-4 * abs(want), f"{name} step {step + 1}: {got} vs {want}"
    assert sorted(compiled_grads) == sorted(eager_grads) and eager_grads, name
    for param, want in eager_grads.items():
        got = compiled_grads[param]
        err = (got - want).abs().max().item()
        assert err <= 1e-4 * max(want.abs().max().item(), 1e-3), f"{name} {param}: {err:.3e}"


def test_variable_lengths_recompile_a_bounded_number_of_times(runs):
    name, _, (compiled, _) = runs
    lengths = {sum(d) for r in compiled for d in r.get("micro_batch_doc_lens", [])}
    recompiles = compiled[-1]["wlb/recompiles"]
    assert compiled[0]["wlb/compiled_graphs"] >= 1, name
    assert recompiles <= MAX_RECOMPILES, (
        f"{name}: {recompiles} recompiles over {len(compiled)} steps"
    )
    if len(compiled) >= 20:  # the long run: its micro-batches did vary in length
        assert len(lengths) > 1, lengths
