"""The exactly-once audit log: which documents every rank trained, step by step, across launches
(records: docs/data.md). No torch: ``tools.audit`` reads any run's logs without a model."""

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


class AuditLogError(ValueError):
    """An audit log that cannot be read; the message names the file and line."""


class AuditLog:
    """One rank's writer; a record is one ``write`` of a whole line (a kill truncates the last)."""

    def __init__(self, dump_folder: str, rank: int, dp_rank: int, dp_degree: int) -> None:
        folder = os.path.join(dump_folder, AUDIT_FOLDER)
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank_{rank}.jsonl")
        if os.path.isfile(self.path) and os.path.getsize(self.path):
            with open(self.path, "rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # the last launch was killed while writing its record
                    f.write(b"\n")
        self.rank, self.dp_rank, self.dp_degree = rank, dp_rank, dp_degree
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
        dp = {"dp_rank": self.dp_rank, "dp_degree": self.dp_degree}
        self._write("start", launch_time=launch_time, **dp, resumed_from=int(resumed_from))

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
        pending = sorted(int(i) for i in pending)
        self._write("end", step=int(step), reason=reason, pending=pending, documents=documents)


def read_audit_logs(output_dir: str) -> list[dict[str, Any]]:
    """Every rank's records under ``output_dir`` (a dump folder, or its ``wlb_audit/``)."""
    folder = os.path.join(output_dir, AUDIT_FOLDER)
    if not os.path.isdir(folder):
        if os.path.basename(os.path.normpath(output_dir)) == AUDIT_FOLDER:
            folder = output_dir
        elif not os.path.isdir(output_dir):
            raise AuditLogError(f"{output_dir}: no such directory (give the run's dump folder)")
        else:
            raise AuditLogError(
                f"{output_dir}: no {AUDIT_FOLDER}/ folder; give the dump folder of a run that used "
                '[wlb.advanced] loader = "documents" (the audit log is written by every rank of '
                "such a run)"
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
                    continue  # cut off by a kill mid-write: the killed launch's last record
                raise AuditLogError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            where = f"{path}:{lineno}"
            if not isinstance(rec, dict) or rec.get("event") not in EVENTS:
                raise AuditLogError(
                    f"{where}: not an audit record (expected an object with event one of "
                    f"{', '.join(EVENTS)})"
                )
            if missing := [k for k in EVENTS[rec["event"]] if k not in rec]:
                raise AuditLogError(f"{where}: {rec['event']} record without {', '.join(missing)}")
            records.append(rec)
    return records
