"""CPU as a TorchTitan device: the pieces of TorchTitan's profiling that ask for an accelerator."""

import os

import pytest
import torch

from torchtitan_wlb import cpu_support


@pytest.mark.skipif(not cpu_support.is_active(), reason="CPU mode only")
def test_profiler_takes_torchtitans_activity_list_without_an_accelerator():
    # TorchTitan lists CPU and the accelerator's activity, which is None without one.
    activities = [torch.profiler.ProfilerActivity.CPU, None]
    with torch.profiler.profile(activities=activities) as prof:
        torch.ones(8).add_(1)
    assert any(event.name == "aten::add_" for event in prof.events())


@pytest.mark.skipif(not cpu_support.is_active(), reason="CPU mode only")
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs procfs")
def test_memory_snapshot_is_the_process_memory_summary():
    torch.cpu.memory._record_memory_history(max_entries=100)
    summary = torch.cpu.memory._snapshot()
    assert summary["device"] == "cpu"
    sizes = summary["bytes"]
    assert set(sizes) == {"VmPeak", "VmSize", "VmHWM", "VmRSS", "RssAnon", "RssFile", "VmSwap"}
    assert sizes["VmHWM"] >= sizes["VmRSS"] > 0 and sizes["VmPeak"] >= sizes["VmSize"]
