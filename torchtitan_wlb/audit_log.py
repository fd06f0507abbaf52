"""The exactly-once audit log: which documents every rank trained, step by step, across launches.

Every rank of a run with the document loader appends to ``<dump_folder>/wlb_audit/rank_<rank>.jsonl``
one JSON object per line (``python -m torchtitan_wlb.tools.audit`` reads them back):

``{"event": "start", "launch", "launch_time", "rank", "dp_rank", "dp_degree", "resumed_from"}``
    written before the launch's first step. ``launch`` is one id shared by all ranks of a launch
    (rank 0's, broadcast), ``launch_time`` orders launches, ``resumed_from`` is the checkpoint step
    the launch restored (0: from scratch). A resumed launch re-trains every step after it: the
    records of earlier launches for those steps are superseded.
``{"event": "step", "launch", "rank", "dp_rank", "step", "micro_batches": [[doc ids], ...]}``
    written once the step's optimizer update is done: the documents of each of this rank's
    micro-batches, in order (a filler micro-batch at the end of the data is ``[]``).
``{"event": "checkpoint", "launch", "rank", "step", "pending": [doc ids]}``
    written after a checkpoint of ``step`` is complete on disk (its ``.metadata`` written; an
    asynchronous save that is still in flight is not recorded): the documents the packer still
    holds (queued or carried) in that checkpoint's data state.
``{"event": "end", "launch", "rank", "step", "reason", "pending", "documents"}``
    written when the training loop ends normally: ``reason`` is ``"end of data"`` (the pass is
    over) or ``"steps"`` (``training.steps`` reached); ``documents`` is how many documents the
    data pipeline produced (known at the end of the data), ``pending`` as above.

Every record is one ``write`` of a whole line, flushed at once: a rank killed mid-write leaves at
most a truncated last line. The next launch starts on a new line after it, and the reader skips
such a line (the end of a file, or just before a start record): it was the killed launch's last
record, a step after its last checkpoint, which the resumed launch re-trains anyway.

Pure Python, no torch: the audit tool reads logs of any run without loading a model.
"""

from __future__ import annotations

import json
import os
from typing import Any

AUDIT_FOLDER = "wlb_audit"
EVENTS = {
    "start": ("launch", "launch_time", "rank", "dp_rank", "dp_degree", "resumed_from"),
    "step": ("launch", "rank", "dp_rank", "step", "micro_batches"),
    "checkpoint": ("launch", "rank", "step", "pending"),
    "end": ("launch", "rank", "step", "reason", "pending", "documents"),
}

__all__ = ["AUDIT_FOLDER", "AuditLog", "AuditLogError", "read_audit_logs"]


class AuditLogError(ValueError):
    """An audit log that cannot be read; the message names the file and line."""


class AuditLog:
    """One rank's writer. The trainer calls :meth:`start` before the launch's first step,
    :meth:`add_micro_batch` for every micro-batch, :meth:`step_done`, :meth:`checkpoint` and
    :meth:`end`.

    Args:
        dump_folder: the job's ``[job] dump_folder``; the log goes to ``wlb_audit/`` under it.
        rank: global rank. dp_rank, dp_degree: this rank's data-parallel position.
    """

    def __init__(self, dump_folder: str, rank: int, dp_rank: int, dp_degree: int) -> None:
        folder = os.path.join(dump_folder, AUDIT_FOLDER)
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank_{rank}.jsonl")
        if os.path.isfile(self.path) and os.path.getsize(self.path):
            with open(self.path, "rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # the last launch was killed while writing its record
                    f.write(b"\n")
        self.rank = rank
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.launch: str | None = None
        self._micro_batches: list[list[int]] = []

    @property
    def started(self) -> bool:
        return self.launch is not None

    def _write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "launch": self.launch, "rank": self.rank, **fields})
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def start(self, launch: str, launch_time: float, resumed_from: int) -> None:
        self.launch = launch
        self._write(
            "start",
            launch_time=launch_time,
            dp_rank=self.dp_rank,
            dp_degree=self.dp_degree,
            resumed_from=int(resumed_from),
        )

    def begin_step(self) -> None:
        """Forget micro-batches of a step that did not complete (the end of the data)."""
        self._micro_batches = []

    def add_micro_batch(self, doc_ids: list[int]) -> None:
        self._micro_batches.append([int(i) for i in doc_ids])

    def step_done(self, step: int) -> None:
        micro_batches, self._micro_batches = self._micro_batches, []
        self._write("step", dp_rank=self.dp_rank, step=int(step), micro_batches=micro_batches)

    def checkpoint(self, step: int, pending: list[int]) -> None:
        self._write("checkpoint", step=int(step), pending=sorted(int(i) for i in pending))

    def end(self, step: int, reason: str, pending: list[int], documents: int | None) -> None:
        self._write(
            "end",
            step=int(step),
            reason=reason,
            pending=sorted(int(i) for i in pending),
            documents=documents,
        )


def read_audit_logs(output_dir: str) -> list[dict[str, Any]]:
    """Every record of every rank under ``output_dir`` (a dump folder, or its ``wlb_audit/``).

    Raises :class:`AuditLogError` naming the folder, file and line of anything unreadable. A
    truncated last line (a rank killed while writing it) is skipped.
    """
    folder = os.path.join(output_dir, AUDIT_FOLDER)
    if not os.path.isdir(folder):
        if os.path.basename(os.path.normpath(output_dir)) == AUDIT_FOLDER:
            folder = output_dir
        elif not os.path.isdir(output_dir):
            raise AuditLogError(f"{output_dir}: no such directory (give the run's dump folder)")
        else:
            raise AuditLogError(
                f"{output_dir}: no {AUDIT_FOLDER}/ folder; give the dump folder of a run that used "
                '[wlb] loader = "documents" (the audit log is written by every rank of such a run)'
            )
    names = sorted(n for n in os.listdir(folder) if n.startswith("rank_") and n.endswith(".jsonl"))
    if not names:
        raise AuditLogError(f"{folder}: no rank_<N>.jsonl audit log in it")
    records: list[dict[str, Any]] = []
    for name in names:
        path = os.path.join(folder, name)
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f.read().split("\n"), 1) if line.strip()]
        for k, (lineno, line) in enumerate(lines):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if k + 1 == len(lines) or lines[k + 1][1].startswith('{"event": "start"'):
                    continue  # cut off by a kill mid-write (see the module docstring)
                raise AuditLogError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            _check_record(rec, f"{path}:{lineno}")
            records.append(rec)
    return records


def _check_record(rec: Any, where: str) -> None:
    if not isinstance(rec, dict) or rec.get("event") not in EVENTS:
        raise AuditLogError(
            f"{where}: not an audit record (expected an object with event one of "
            f"{', '.join(EVENTS)})"
        )
    missing = [k for k in EVENTS[rec["event"]] if k not in rec]
    if missing:
        raise AuditLogError(f"{where}: {rec['event']} record without {', '.join(missing)}")
