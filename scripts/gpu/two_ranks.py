"""Two ranks on one device against one process: CP = 2 (per-document, hybrid) and PP = 2.

    python scripts/gpu/two_ranks.py --out outputs/two_ranks.json
    python scripts/gpu/two_ranks.py --layouts pp2 --steps 2 --timeout 60
    python scripts/gpu/two_ranks.py --fake-backend always   # the fake-backend runs too

Each layout trains as two torchrun ranks on this machine's one device, through
``scripts/gpu/shared_device.py`` (on a CUDA device: both ranks on ``cuda:0``, collectives over gloo;
on a CPU-only machine the entry changes nothing unless ``WLB_SHARED_DEVICE=1``, which puts both
CPU ranks on ``cpu:0`` the same way), and is compared with one process training the same job.
As in tests/test_e2e_4d.py, every run starts from one seed checkpoint (TorchTitan's
``--checkpoint.create_seed_checkpoint``, written by one process) with the same seed, global batch
(4 micro-batches of up to 1.25 x seq-len tokens) and float32 weights, and its per-step loss and
gradient norm are read from the metrics JSONL. The attention runs on the bucketed SDPA backend
(``--wlb.advanced.attention_backend cpu``, on any device): the CUDA varlen kernels compute in bf16
or fp16 only. At the default 1024 tokens, hybrid CP meets micro-batches of whole documents only
(no K/V gathered), of one split document, and of both.

A layout that fails names the last error line of its log; when that line shows gloo refusing an
operation, the layout is ``refused`` and ``collective`` names it (from gloo's message, else the last
``torch.distributed`` call of the traceback). Then the same layout runs one step in one process
with TorchTitan's fake backend (``COMM_MODE=fake_backend NGPU=2 ./run_train.sh``), which builds
and steps the layout without real collectives and compares nothing. Under PP it builds the
layout but cannot step it: torch's pipeline stages exchange their shapes before the first step.
Each run has a time cap; a failure does not stop the others.

Flags: ``--layouts`` (comma-separated, default all: cp2_per_document, cp2_hybrid, pp2), ``--steps``
(default 3), ``--flavor`` (default tiny), ``--seq-len`` (default 1024), ``--rtol`` (largest
relative loss difference accepted, default 1e-4), ``--grad-rtol`` (gradient norm, default 1e-3),
``--timeout`` (seconds per run, default 150), ``--comm-timeout`` (gloo's, seconds, default 45),
``--fake-backend`` (on-failure, always or never; default on-failure), ``--work`` (run folders and
logs, default outputs/two_ranks), ``--out`` (the JSON, also printed as the last line).

JSON keys: ``device``, ``device_name``, ``torch``, ``steps``, ``rtol``, ``grad_rtol``,
``reference`` (``status``, ``seconds``, ``loss``, ``grad_norm``, ``error``), ``layouts`` (one per
layout: ``layout``, ``nproc``, ``shared_device`` (its ranks that printed the entry's line),
``status`` ok / fail / refused, ``max_rel_loss_diff``, ``max_rel_grad_norm_diff``, ``loss``,
``grad_norm``, ``seconds``, ``error``, ``collective``,
``fake_backend`` ran / built / failed / not run, ``fake_backend_error``), ``ok`` (every layout
ok, or refused and its fake-backend run "ran", or "built" where no step can run) and ``wall_s``.
Exit status 0 when ``ok``, 1 otherwise, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from torchtitan_wlb.tools.cli import ToolParser, json_text  # noqa: E402

ENTRY = ROOT / "scripts" / "gpu" / "shared_device.py"
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"
LAYOUTS: dict[str, list[str]] = {
    "cp2_per_document": ["--parallelism.context_parallel_degree", "2",
                         "--wlb.cp_sharding", "per_document"],
    "cp2_hybrid": ["--parallelism.context_parallel_degree", "2", "--wlb.cp_sharding", "hybrid"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
}  # fmt: skip
FAKE_MODES = ("on-failure", "always", "never")
COVERED = ("ran", "built")


@dataclass
class Run:
    """One launch's outcome: exit status (None: stopped at the time cap), wall time, its log."""

    code: int | None
    seconds: float
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def job_args(args: argparse.Namespace, dump: Path) -> list[str]:
    """The flags every run shares after its config file (debug_cpu.toml on either device):
    tests/test_e2e_4d.py's job, float32, a fixed seed."""
    return [
        "--job.dump_folder", str(dump),
        "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
        "--wlb.micro_batch_max_len", str(args.seq_len * 5 // 4),
        "--training.global_batch_size", "4", "--training.mixed_precision_param", "float32",
        "--wlb.advanced.attention_backend", "cpu", "--wlb.advanced.metrics_jsonl",
        "--metrics.log_freq", "1", "--metrics.disable_color_printing", "--debug.seed", "7",
        "--comm.init_timeout_seconds", str(args.comm_timeout),
        "--comm.train_timeout_seconds", str(args.comm_timeout),
    ]  # fmt: skip


CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "1000",
              "--checkpoint.no-last-save-model-only"]  # fmt: skip


def torchrun(nproc: int) -> list[str]:
    """torchrun as run_train.sh starts it, every rank's output shown, ranks on the entry."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--role", "rank",
        "--tee", "3", str(ENTRY), "--job.config_file", str(CONFIG),
    ]  # fmt: skip


def launch(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> Run:
    """``cmd`` with its output in ``log``, stopped (its process group) after ``timeout`` s."""
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its ranks on SIGTERM
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return Run(code, time.monotonic() - start, log)


def run_env(device: str) -> dict[str, str]:
    """The ranks' environment: this checkout first on the path, run_train.sh's allocator setting,
    one intra-op thread per CPU rank (two ranks share the cores, as in the tests)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    env.setdefault("WLB_PYTHON", sys.executable)  # run_train.sh (fake backend): this interpreter
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def fresh(work: Path, name: str, seed: Path | None) -> Path:
    """An empty run folder ``work/name``, holding a copy of the seed checkpoint if given."""
    dump = work / name
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    if seed is not None:
        shutil.copytree(seed / "checkpoint", dump / "checkpoint")
    return dump


def records(dump: Path) -> dict[int, dict[str, Any]]:
    """Per step, the metrics record of a rank that holds the loss (PP: the last stage)."""
    out: dict[int, dict[str, Any]] = {}
    folder = dump / "wlb_metrics"
    for path in sorted(folder.glob("rank_*.jsonl")) if folder.is_dir() else []:
        for rec in map(json.loads, path.read_text().splitlines()):
            if rec.get("loss", 0) > 0:
                out[rec["step"]] = rec
    return out


# A line of a failed rank that shows gloo refusing an operation: ProcessGroupGloo's argument checks
# ("ProcessGroupGloo::allgather: unsupported device type"), its reductions and dtypes, gloo's
# transport given a device pointer (send and recv pass the tensor's pointer on unchecked).
REFUSAL = re.compile(
    r"ProcessGroupGloo::\w+|Cannot use ReduceOp\.\w+ with Gloo|Unhandled ReduceOp|Invalid scalar type"
    r"|gloo.*(not supported|unsupported|does not support|only supports|Bad address)"
    r"|(not supported|unsupported|does not support).*gloo",
    re.IGNORECASE,
)
ERROR = re.compile(r"\w*(Error|Exception)\b|error:|Signal \d+|exitcode\s*:| - ERROR - ")
GLOO_CALL = re.compile(r"ProcessGroupGloo::(\w+)|ReduceOp\.(\w+) with Gloo")
FRAME = re.compile(r'File ".*torch/distributed/[\w/]+\.py", line \d+, in (\w+)')
NOT_COLLECTIVES = {"wrapper", "inner", "_exception_logger", "_time_logger", "wait", "__call__"}
RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:")


def failure(text: str) -> tuple[str | None, str | None, bool]:
    """``(error line, collective, refused by gloo)`` from a failed run's log: the last refusal line
    if any, else the last error line of the ranks, else of the launcher. The collective is the one gloo
    names, else the last ``torch.distributed`` call of a rank's traceback (decorators skipped)."""
    raw = text.splitlines()
    lines = [RANK_PREFIX.sub("", line).strip() for line in raw]
    ranks = [RANK_PREFIX.sub("", line).strip() for line in raw if RANK_PREFIX.match(line)]
    refusals = [line for line in lines if REFUSAL.search(line)]
    errors = [line for line in ranks if ERROR.search(line) and not line.startswith("File ")]
    errors = errors or [
        line for line in lines if ERROR.search(line) and not line.startswith("File ")
    ]
    line = (refusals or errors or [line for line in lines if line] or [None])[-1]
    named = GLOO_CALL.search(line or "")
    calls = [
        m.group(1) for m in map(FRAME.search, ranks) if m and m.group(1) not in NOT_COLLECTIVES
    ]
    collective = next(filter(None, named.groups()), None) if named else None
    return line, collective or (calls[-1] if calls else None), bool(refusals)


def error_of(run: Run, timeout: float) -> str | None:
    """A failed run's error line, said to be after the time cap when it was stopped there."""
    line = failure(run.text())[0]
    return line if run.code is not None else f"stopped after {timeout:g} s; last error line: {line}"


def rel_diff(got: list[float], ref: list[float]) -> float:
    """The largest relative difference of two equally long series (inf: lengths differ)."""
    if len(got) != len(ref) or not ref:
        return float("inf")
    return max(abs(g - r) / max(abs(r), 1e-12) for g, r in zip(got, ref, strict=True))


def series(dump: Path, steps: int) -> tuple[list[float], list[float]]:
    """Loss and gradient norm of steps 1..steps (shorter when the run logged fewer)."""
    recs = records(dump)
    done = [s for s in range(1, steps + 1) if s in recs]
    return [recs[s]["loss"] for s in done], [recs[s].get("grad_norm", float("nan")) for s in done]


def reference(args: argparse.Namespace, env: dict[str, str]) -> tuple[dict[str, Any], Path | None]:
    """The seed checkpoint and the one-process run from it; the reference's summary and the seed
    folder (None: no seed)."""
    seed = fresh(args.work, "seed", None)
    cmd = [*torchrun(1), *job_args(args, seed), *CHECKPOINT,
           "--checkpoint.create_seed_checkpoint", "--training.steps", "1"]  # fmt: skip
    run = launch(cmd, args.work / "seed.log", args.timeout, env)
    if run.code != 0 or not (seed / "checkpoint" / "step-0").is_dir():
        return {
            "status": "fail",
            "seconds": run.seconds,
            "error": error_of(run, args.timeout),
        }, None
    dump = fresh(args.work, "reference", seed)
    cmd = [*torchrun(1), *job_args(args, dump), *CHECKPOINT, "--training.steps", str(args.steps)]
    run = launch(cmd, args.work / "reference.log", args.timeout, env)
    loss, grad = series(dump, args.steps)
    ok = run.code == 0 and len(loss) == args.steps
    summary = {"status": "ok" if ok else "fail", "seconds": run.seconds, "loss": loss,
               "grad_norm": grad, "error": None if ok else error_of(run, args.timeout)}  # fmt: skip
    return summary, seed


def compare(
    args: argparse.Namespace, ref: dict[str, Any], loss: list[float], grad: list[float]
) -> tuple[str, float | None, float | None, str | None]:
    """The layout's status, its largest relative loss and gradient-norm differences from the
    reference, and why it failed (None: it did not)."""
    if ref["status"] != "ok":
        return "fail", None, None, "no reference to compare with"
    d_loss, d_grad = rel_diff(loss, ref["loss"]), rel_diff(grad, ref["grad_norm"])
    if len(loss) != args.steps:
        return "fail", None, None, f"{len(loss)} of {args.steps} steps logged"
    ok = d_loss <= args.rtol and d_grad <= args.grad_rtol
    why = None if ok else f"loss differs by {d_loss:.2e}, gradient norm by {d_grad:.2e} (relative)"
    return ("ok" if ok else "fail"), d_loss, d_grad, why


def layout_run(
    args: argparse.Namespace, name: str, ref: dict[str, Any], seed: Path | None, env: dict[str, str]
) -> dict[str, Any]:
    """One layout: two ranks on the device, compared with the reference."""
    result: dict[str, Any] = {
        "layout": name, "nproc": 2, "shared_device": 0, "status": "fail",
        "max_rel_loss_diff": None, "max_rel_grad_norm_diff": None, "loss": [], "grad_norm": [],
        "seconds": 0.0, "error": "no seed checkpoint", "collective": None,
    }  # fmt: skip
    if seed is None:
        return result
    dump = fresh(args.work, name, seed)
    cmd = [*torchrun(2), *job_args(args, dump), *CHECKPOINT, "--training.steps", str(args.steps),
           *LAYOUTS[name]]  # fmt: skip
    run = launch(cmd, args.work / f"{name}.log", args.timeout, env)
    loss, grad = series(dump, args.steps)
    shared = run.text().count("[shared_device] rank")
    result.update(loss=loss, grad_norm=grad, seconds=round(run.seconds, 1), shared_device=shared)
    if run.code != 0:
        _, collective, refused = failure(run.text())
        result.update(status="refused" if refused else "fail", collective=collective,
                      error=error_of(run, args.timeout))  # fmt: skip
        return result
    status, d_loss, d_grad, why = compare(args, ref, loss, grad)
    return {**result, "status": status, "max_rel_loss_diff": d_loss,
            "max_rel_grad_norm_diff": d_grad, "error": why}  # fmt: skip


def fake_backend(args: argparse.Namespace, name: str, env: dict[str, str]) -> tuple[str, Any]:
    """The layout for one step in one process with TorchTitan's fake backend (run_train.sh's
    ``COMM_MODE=fake_backend``): ``("ran" | "built" | "failed", error line)``, "built" when the
    trainer was built and the step failed (PP: torch's pipeline stages exchange their shapes
    before the first step, which fake collectives cannot deliver)."""
    dump = fresh(args.work, f"fake_{name}", None)
    cmd = ["bash", str(ROOT / "run_train.sh"), *job_args(args, dump), "--checkpoint.no-enable",
           *LAYOUTS[name]]  # fmt: skip
    run = launch(cmd, args.work / f"fake_{name}.log", args.timeout,
                 dict(env, COMM_MODE="fake_backend", NGPU="2", CONFIG_FILE=str(CONFIG)))  # fmt: skip
    if run.code == 0:
        return "ran", None
    built = "Training starts at step" in run.text()
    return ("built" if built else "failed"), error_of(run, args.timeout)


def device_info() -> dict[str, str]:
    """The device the ranks will train on (the trainer's choice: CUDA when present, else CPU)."""
    import torch

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    return {"device": "cuda" if cuda else "cpu", "device_name": name, "torch": torch.__version__}


def parser() -> ToolParser:
    p = ToolParser.from_doc("two_ranks", __doc__ or "")
    p.prog = "python scripts/gpu/two_ranks.py"
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: "
                   + ", ".join(LAYOUTS))  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="training steps compared (default 3)")
    p.add_argument("--flavor", default="tiny", help="model flavor (default tiny)")
    p.add_argument("--seq-len", type=int, default=1024, help="context length (default 1024)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative loss difference accepted")
    p.add_argument("--grad-rtol", type=float, default=1e-3, help="same, gradient norm")
    p.add_argument("--timeout", type=float, default=150, help="seconds per run (default 150)")
    p.add_argument("--comm-timeout", type=int, default=45, help="gloo's timeout, seconds")
    p.add_argument("--fake-backend", default="on-failure", choices=FAKE_MODES,
                   help="when the fake-backend run of a layout happens (default on-failure)")  # fmt: skip
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "two_ranks",
                   help="run folders and logs (default outputs/two_ranks)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return p


def check(p: ToolParser, args: argparse.Namespace) -> None:
    """One line and exit status 2 for a bad flag."""
    names = [n for n in args.layouts.split(",") if n]
    if not names or any(n not in LAYOUTS for n in names):
        p.error(f"--layouts {args.layouts!r}: accepted values are {', '.join(LAYOUTS)}")
    args.layouts = names
    for flag in ("steps", "seq_len", "comm_timeout"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} = {getattr(args, flag)} must be >= 1")
    for flag in ("rtol", "grad_rtol", "timeout"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} = {getattr(args, flag)} must be > 0")


def table(summary: dict[str, Any]) -> str:
    """The human-readable table of ``summary``."""

    def num(x: Any) -> str:
        return "-" if x is None else f"{x:.1e}"

    ref = summary["reference"]
    rows = [f"device {summary['device']} ({summary['device_name']}), torch {summary['torch']}",
            f"reference (1 process): {ref['status']}, {ref['seconds']:.1f} s, "
            f"loss {[round(x, 5) for x in ref.get('loss', [])]}",
            f"{'layout':<18} {'shared':<6} {'status':<8} {'loss diff':>9} {'grad diff':>9} {'s':>6}  "
            f"{'fake backend':<12} error"]  # fmt: skip
    for r in summary["layouts"]:
        error = r["error"] if r["collective"] is None else f"[{r['collective']}] {r['error']}"
        shared = f"{r.get('shared_device', 0)}/{r['nproc']}"
        rows.append(f"{r['layout']:<18} {shared:<6} {r['status']:<8} {num(r['max_rel_loss_diff']):>9} "
                    f"{num(r['max_rel_grad_norm_diff']):>9} {r['seconds']:>6.1f}  "
                    f"{r['fake_backend']:<12} {error or ''}")  # fmt: skip
    return "\n".join(rows)


def run_layouts(args: argparse.Namespace, env: dict[str, str]) -> tuple[dict, list[dict]]:
    """The reference, then each layout, then (``--fake-backend on-failure``) its fake-backend run
    when it did not pass. ``always``: the fake-backend runs go beside them, one at a time; each is
    one process, mostly importing, so they overlap the others at little cost."""
    with ThreadPoolExecutor(1) as pool:
        always = args.fake_backend == "always"
        fakes = (
            {name: pool.submit(fake_backend, args, name, env) for name in args.layouts}
            if always
            else {}
        )
        ref, seed = reference(args, env)
        layouts = []
        for name in args.layouts:
            result = layout_run(args, name, ref, seed, env)
            print(f"[two_ranks] {name}: {result['status']} ({result['seconds']:.1f} s)", flush=True)
            if args.fake_backend == "on-failure" and result["status"] != "ok":
                fakes[name] = pool.submit(fake_backend, args, name, env)
            layouts.append(result)
        for result in layouts:
            fake = fakes.get(result["layout"])
            state, error = fake.result() if fake else ("not run", None)
            result.update(fake_backend=state, fake_backend_error=error)
    return ref, layouts


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check(p, args)
    start = time.monotonic()
    info = device_info()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    ref, layouts = run_layouts(args, run_env(info["device"]))
    # A refused layout counts as covered by its fake-backend run: a step, or under PP the build.
    ok = all(r["status"] == "ok" or (r["status"] == "refused" and r["fake_backend"] in COVERED)
             for r in layouts)  # fmt: skip
    summary = {**info, "steps": args.steps, "rtol": args.rtol, "grad_rtol": args.grad_rtol,
               "reference": ref, "layouts": layouts, "ok": ok,
               "wall_s": round(time.monotonic() - start, 1)}  # fmt: skip
    print(table(summary))
    text = json_text(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
