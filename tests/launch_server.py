"""The launch server of the multi-process tests: torch and TorchTitan imported once per pytest run.

    python tests/launch_server.py SOCKET     # started by tests/conftest.py

Every ``tests/fork_launch.py`` launch starts an elastic agent that imports ``torchtitan_wlb.train``
and TorchTitan's trainer before forking its ranks: about 8 CPU seconds per launch, most of a small
run's cost, and the suite makes dozens of launches. This server imports all of it once, then
serves each launch by forking the agent from itself: ``fork_launch.py`` (which then imports
nothing heavy) sends its arguments, environment, working directory and standard streams over a
Unix socket; the forked agent takes them over, runs exactly what ``fork_launch.py`` would have run
(:func:`fork_launch.launch`), and its exit status goes back as the script's own.

A launch that must not be served here is refused, and ``fork_launch.py`` then launches by itself:
one from another checkout or interpreter, or whose environment differs in what torch reads when it
is imported (``TORCH*``, ``PYTORCH*``, ``PYTHONPATH``, thread counts). The agent runs in a process
group of its own, with its ranks: if the script is killed (a test's timeout), its connection
closes and the server kills that group. The server is single-threaded (it forks, so no other
thread may hold a lock at that moment) and exits when its parent, pytest, is gone.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
ENV_VAR = "WLB_TEST_LAUNCH_SERVER"
STREAMS = 3  # stdin, stdout, stderr
_IMPORT_TIME = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The variables torch and its libraries read when they are imported."""
    return {k: v for k, v in env.items() if k in _IMPORT_TIME or k.startswith(("TORCH", "PYTORCH"))}


def _read_line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(64)
        if not chunk:
            raise ConnectionError("the launch server closed the connection")
        data += chunk
    return data.decode().strip()


def request(argv: list[str]) -> int | None:
    """Run one launch on the server named by ``WLB_TEST_LAUNCH_SERVER``: its exit status, or
    None where there is no server or it refuses (the caller then launches by itself)."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    body = json.dumps(
        {
            "argv": argv,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "root": ROOT,
            "python": sys.executable,
        }
    ).encode()
    fds = array.array("i", range(STREAMS))
    sock.sendmsg(
        [len(body).to_bytes(8, "big") + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
    )
    reply = _read_line(sock)
    if reply == "refused":
        sock.close()
        return None
    agent = int(reply.split()[1])
    for sig in (signal.SIGTERM, signal.SIGINT):  # pass a polite stop on to the agent's group
        signal.signal(sig, lambda signum, frame: os.killpg(agent, signum))
    status = int(_read_line(sock).split()[1])
    sock.close()
    return status


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: its JSON body and the client's standard streams."""
    size = socket.CMSG_LEN(STREAMS * array.array("i").itemsize)
    data, ancdata, _, _ = conn.recvmsg(65536, size)
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("request cut short")
        data += chunk
    return json.loads(data[8:]), list(fds)


def _agent(request_: dict, fds: list[int], open_sockets: list[socket.socket]) -> None:
    """The forked agent: the client's streams, directory, environment and arguments, then what
    ``fork_launch.py`` runs; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        for sock in open_sockets:
            sock.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd >= STREAMS:
                os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request_["cwd"])
        os.environ.clear()
        os.environ.update(request_["env"])
        sys.argv = [os.path.join(TESTS, "fork_launch.py"), *request_["argv"]]
        import fork_launch

        code = fork_launch.launch(request_["argv"])
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _status(wait_status: int) -> int:
    """A child's wait status as a shell would report it."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def serve(path: str) -> None:
    import fork_launch

    fork_launch.preload()
    own_env = _import_time_env(dict(os.environ))
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    agents: dict[int, socket.socket] = {}  # agent pid -> its client's connection
    while os.getppid() == parent:
        readable, _, _ = select.select([listener, *agents.values()], [], [], 0.05)
        for sock in readable:
            if sock is listener:
                conn, _ = listener.accept()
                _start(conn, own_env, listener, agents)
            elif not sock.recv(1):  # the client is gone: stop its agent and ranks
                pid = next(p for p, c in agents.items() if c is sock)
                _kill_group(pid)
        while agents:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = agents.pop(pid)
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {_status(wait_status)}\n".encode())
            conn.close()
    for pid in agents:
        _kill_group(pid)


def _start(conn: socket.socket, own_env: dict, listener: socket.socket, agents: dict) -> None:
    """Fork the agent of one request, or refuse it."""
    try:
        request_, fds = _receive(conn)
    except (OSError, ValueError):
        conn.close()
        return
    same = (
        request_["root"] == ROOT
        and request_["python"] == sys.executable
        and _import_time_env(request_["env"]) == own_env
        and len(fds) == STREAMS
    )
    if not same:
        for fd in fds:
            os.close(fd)
        conn.sendall(b"refused\n")
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _agent(request_, fds, [listener, conn, *agents.values()])
    with contextlib.suppress(OSError):  # also done by the agent: whichever runs first
        os.setpgid(pid, pid)
    for fd in fds:
        os.close(fd)
    agents[pid] = conn
    conn.sendall(f"started {pid}\n".encode())


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.path.insert(0, TESTS)
    serve(sys.argv[1])
