"""Test-suite set-up: CPU support must be active before anything imports torchtitan; the launch
server (tests/launch_server.py) serves the run's multi-process launches."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_wlb import cpu_support  # noqa: E402

cpu_support.activate()

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session", autouse=True)
def launch_server(tmp_path_factory):
    """Starts the launch server; ``tests/fork_launch.py`` uses it once it listens (it imports for
    a few seconds first: launches before that start by themselves)."""
    folder = tmp_path_factory.mktemp("launch_server")
    path = str(folder / "socket")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with open(folder / "server.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, os.path.join(TESTS, "launch_server.py"), path],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    os.environ["WLB_TEST_LAUNCH_SERVER"] = path
    yield path
    del os.environ["WLB_TEST_LAUNCH_SERVER"]
    server.terminate()
    server.wait(timeout=30)
