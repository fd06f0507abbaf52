"""The one-device rank entry (scripts/gpu/shared_device.py) and its driver's reading of a failed
run (scripts/gpu/two_ranks.py), in process. The runs themselves need a CUDA device for what the
entry changes; on CPU the driver's runs are the multi-process tests' layouts (tests/test_e2e_4d.py).
"""

import importlib.util
import os
import sys

import pytest
import torch
import torch.distributed as dist

from torchtitan_wlb import cpu_support

SCRIPTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu"
)


def _load(name):
    spec = importlib.util.spec_from_file_location(
        f"_gpu_{name}", os.path.join(SCRIPTS, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


shared_device = _load("shared_device")
two_ranks = _load("two_ranks")


def test_share_device_makes_every_rank_device_0_over_gloo():
    environ = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    backends = dict(dist.Backend.default_device_backend_map)
    shared_device.share_device(environ, backends)
    assert environ == {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       shared_device.LAUNCHER_LOCAL_RANK: "1"}  # fmt: skip
    assert backends["cuda"] == "gloo"
    assert {k: v for k, v in backends.items() if k != "cuda"} == {
        k: v for k, v in dist.Backend.default_device_backend_map.items() if k != "cuda"
    }


def test_install_changes_nothing_without_cuda_and_patches_this_process_with_it(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv(shared_device.LAUNCHER_LOCAL_RANK, raising=False)
    backends = dist.Backend.default_device_backend_map
    monkeypatch.setitem(backends, "cuda", backends["cuda"])  # restored after the test
    monkeypatch.setattr(cpu_support, "adapt_fsdp_for_cpu", cpu_support.adapt_fsdp_for_cpu)
    before = (dict(os.environ), dict(backends), cpu_support.adapt_fsdp_for_cpu)

    assert shared_device.install(False) is False  # CPU ranks: the pass-through
    assert (dict(os.environ), dict(backends), cpu_support.adapt_fsdp_for_cpu) == before

    assert shared_device.install(True) is True
    assert os.environ["LOCAL_RANK"] == "0" and os.environ[shared_device.LAUNCHER_LOCAL_RANK] == "1"
    assert backends["cuda"] == "gloo"
    # what the model's parallelisation calls once sharded (models/llama3_wlb.py)
    assert cpu_support.adapt_fsdp_for_cpu is shared_device.force_sum_reductions


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_force_sum_reductions_reaches_every_fsdp_module(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in m._get_fsdp_state()._fsdp_param_groups]  # fmt: skip
    assert len(groups) == 2 and not any(g.force_sum_reduction_for_comms for g in groups)
    shared_device.force_sum_reductions(model)
    assert all(g.force_sum_reduction_for_comms for g in groups)


GLOO_REFUSAL = """\
[rank1]:   File "/x/torch/distributed/distributed_c10d.py", line 4512, in reduce_scatter_tensor
[rank1]:     work = group._reduce_scatter_base(output, input, opts)
[rank1]: RuntimeError: ProcessGroupGloo::_reduce_scatter_base: unsupported device type cuda
E1129 16:00:00 torch/distributed/elastic/multiprocessing/api.py: failed (exitcode: 1) local_rank: 1
"""
OTHER_FAILURE = """\
[rank0]:   File "/x/torch/distributed/c10d_logger.py", line 83, in wrapper
[rank0]:   File "/x/torch/distributed/distributed_c10d.py", line 3891, in recv_object_list
[rank0]: RuntimeError: DefaultCPUAllocator: can't allocate memory
  File "/x/torch/distributed/launcher/api.py", line 383, in launch_agent
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  exitcode  : 1 (pid: 12668)
"""


def test_failed_runs_name_the_refused_collective_or_their_last_error():
    line, collective, refused = two_ranks.failure(GLOO_REFUSAL)
    assert refused and collective == "_reduce_scatter_base"
    assert (
        line == "RuntimeError: ProcessGroupGloo::_reduce_scatter_base: unsupported device type cuda"
    )
    line, collective, refused = two_ranks.failure(OTHER_FAILURE)
    assert not refused and collective == "recv_object_list"
    assert line == "RuntimeError: DefaultCPUAllocator: can't allocate memory"
    assert two_ranks.failure("") == (None, None, False)


@pytest.mark.parametrize(
    "argv, message",
    [(["--layouts", "cp4"], "--layouts 'cp4': accepted values are cp2_per_document, cp2_hybrid, pp2"),
     (["--steps", "0"], "--steps = 0 must be >= 1"),
     (["--fake-backend", "sometimes"], "invalid choice: 'sometimes'")],
)  # fmt: skip
def test_bad_flags_are_one_line_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        two_ranks.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
