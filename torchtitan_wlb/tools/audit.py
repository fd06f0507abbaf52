"""Prove from a run's audit logs that every document was trained exactly once.

    python -m torchtitan_wlb.tools.audit outputs/debug_cpu --require-complete

The directory is the run's ``[job] dump_folder``; what is proven, how, and the exit status:
docs/data.md.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchtitan_wlb.audit_log import AuditLogError, read_audit_logs
from torchtitan_wlb.tools.cli import ToolParser


@dataclass
class AuditReport:
    """The verdict on a run's logs."""

    ok: bool  # no document lost or repeated, and the logs cover every step that counts
    complete: bool  # the pass is over (the data ended) and proven
    message: str  # one line: the proof's summary, or the first problem (documents, steps)
    steps: int = 0  # last step that counts
    documents: int = 0  # documents trained in the steps that count
    # (first, last) step ranges of earlier launches re-trained by a resumed launch
    superseded: list[tuple[int, int]] = field(default_factory=list)


class _Violation(Exception):
    pass


def _where(loc: np.ndarray) -> str:
    step, dp_rank, mb = (int(x) for x in loc)
    return f"step {step} (DP rank {dp_rank}, micro-batch {mb})"


@dataclass
class _Timeline:
    """What counts after replaying every launch: the step records by step, up to ``last_step``."""

    steps: dict[int, list[dict]]
    superseded: list[tuple[int, int]]
    launches: int
    dp_degree: int
    last_step: int
    pending: list[int] | None  # in the packer after last_step; None: unknown
    documents: int | None  # documents the data produced, known once it has ended
    complete: bool
    note: str


def _replay(records: list[dict[str, Any]]) -> _Timeline:
    """Replay launches in order of their start: a launch resumed from step ``c`` drops the step
    and checkpoint records after ``c``."""
    by_launch: dict[str, list[dict[str, Any]]] = defaultdict(list)
    start_time: dict[str, float] = {}
    for rec in records:
        by_launch[rec["launch"]].append(rec)
        if rec["event"] == "start":
            start_time.setdefault(rec["launch"], float(rec["launch_time"]))
    if orphans := [r for r in records if r["launch"] not in start_time]:
        rec = orphans[0]
        raise AuditLogError(
            f"launch {rec['launch']!r} (rank {rec['rank']}) has {rec['event']} records but no "
            "start record"
        )
    kept: dict[str, dict[int, list[dict]]] = {"step": {}, "checkpoint": {}}  # by event, step
    superseded: list[tuple[int, int]] = []
    dp_degree: int | None = None
    order = sorted(start_time, key=lambda launch: (start_time[launch], launch))
    for launch in order:
        recs = by_launch[launch]
        starts = [r for r in recs if r["event"] == "start"]
        c = int(_same(starts, "resumed_from", f"where launch {launch} resumed"))
        degree = int(_same(starts, "dp_degree", f"the DP degree of launch {launch}"))
        if dp_degree not in (None, degree):
            raise _Violation(
                f"launch {launch} ran with DP degree {degree}, an earlier one with {dp_degree}"
            )
        dp_degree = degree
        if later := sorted(s for s in kept["step"] if s > c):
            superseded.append((later[0], later[-1]))
        kept = {
            event: {s: r for s, r in by_step.items() if s <= c} for event, by_step in kept.items()
        }
        for rec in recs:
            if rec["event"] in kept:
                kept[rec["event"]].setdefault(int(rec["step"]), []).append(rec)
    ends = [r for r in by_launch[order[-1]] if r["event"] == "end"]
    span = _span(ends, kept["checkpoint"], max(kept["step"], default=0))
    return _Timeline(kept["step"], superseded, len(order), int(dp_degree or 1), *span)


def _same(records: list[dict], key: str, what: str) -> Any:
    if len({repr(r[key]) for r in records}) > 1:
        raise _Violation(f"ranks {sorted(int(r['rank']) for r in records)} disagree on {what}")
    return records[0][key]


def _span(ends: list[dict], ckpts: dict[int, list[dict]], logged: int) -> tuple:
    """(last step that counts, pending, documents, complete, note) from the last launch's end
    records, else from its last checkpoint."""
    if ends:
        last_step = int(_same(ends, "step", "the last step"))
        complete = _same(ends, "reason", "why the run ended") == "end of data"
        note = "" if complete else f"; stopped by training.steps at step {last_step}"
        pending = _same(ends, "pending", "the documents still waiting")
        documents = _same(ends, "documents", "how many documents the data held")
        return last_step, pending, documents, complete, note
    if not ckpts:
        note = (
            "; the last launch did not end and no checkpoint is logged: lost documents cannot "
            "be ruled out"
        )
        return logged, None, None, False, note
    last = max(ckpts)
    pending = _same(ckpts[last], "pending", f"the checkpoint of step {last}")
    note = f"; the last launch did not end (killed?): counted up to its checkpoint of step {last}"
    if logged > last:
        note += f", steps {last + 1}-{logged} will be re-trained on resume"
    return last, pending, None, False, note


def _collect(t: _Timeline) -> tuple[np.ndarray, np.ndarray]:
    """All trained document ids of steps 1..last_step and their (step, dp_rank, micro-batch)."""
    ids: list[list[int]] = []
    locs: list[tuple[int, int, int]] = []
    for step in range(1, t.last_step + 1):
        recs = t.steps.get(step)
        if not recs:
            raise _Violation(
                f"step {step} has no audit record (the logs of the launch that trained it are "
                "missing, or the run resumed from a checkpoint written elsewhere)"
            )
        for dp_rank in range(t.dp_degree):
            peers = [r for r in recs if int(r["dp_rank"]) == dp_rank]  # its CP / TP / PP ranks
            if not peers:
                raise _Violation(f"step {step} has no audit record from DP rank {dp_rank}")
            mbs = _same(peers, "micro_batches", f"the documents of step {step}")
            ids += mbs
            locs += [(step, dp_rank, mb) for mb in range(len(mbs))]
    flat = np.fromiter((i for group in ids for i in group), np.int64)
    counts = np.asarray([len(group) for group in ids], np.int64)
    return flat, np.repeat(np.asarray(locs, np.int64).reshape(-1, 3), counts, axis=0)


def _first_problem(trained: np.ndarray, where: np.ndarray, t: _Timeline) -> str | None:
    """The lowest document trained twice, trained yet still waiting, or lost; None if none."""
    uniq, first, counts = np.unique(trained, return_index=True, return_counts=True)
    problems: list[tuple[int, str]] = []
    repeated = uniq[counts > 1]
    if repeated.size:
        doc = int(repeated[0])
        a, b = (_where(where[i]) for i in np.flatnonzero(trained == doc)[:2])
        problems.append((doc, f"document {doc} was trained twice: {a} and {b}"))
    pend = np.asarray(t.pending or [], np.int64)
    both = np.intersect1d(uniq, pend)
    if both.size:
        doc = int(both[0])
        loc = _where(where[first[np.searchsorted(uniq, doc)]])
        problems.append(
            (doc, f"document {doc} was trained at {loc} and is still waiting in the packer")
        )
    if t.complete:
        top = t.documents if t.documents is not None else int(uniq.max(initial=-1)) + 1
        lost = np.setdiff1d(np.arange(top, dtype=np.int64), uniq)
        if pend.size:
            problems.append((int(pend[0]), f"the data ended with document {pend[0]} still waiting"))
    else:  # below the highest id trained, neither trained nor waiting (unknown: pending is None)
        below = np.arange(int(uniq.max(initial=-1)) + 1 if t.pending is not None else 0)
        lost = np.setdiff1d(np.setdiff1d(below, uniq), pend)
    if lost.size:
        doc = int(lost[0])
        near = [  # where the documents next to it were trained: the steps around a lost one
            f"document {other} at step {int(where[np.flatnonzero(trained == other)[0], 0])}"
            for other in (doc - 1, doc + 1)
            if other >= 0 and other in uniq
        ]
        near_text = f" ({'; '.join(near)})" if near else ""
        problems.append(
            (doc, f"document {doc} was never trained{near_text} and is not waiting in the packer")
        )
    return min(problems)[1] if problems else None


def audit(output_dir: str) -> AuditReport:
    """The verdict on the run dumped in ``output_dir`` (``AuditLogError``: unreadable logs)."""
    records = read_audit_logs(output_dir)
    try:
        t = _replay(records)
        trained, where = _collect(t)
        if problem := _first_problem(trained, where, t):
            raise _Violation(f"{problem}; steps 1-{t.last_step} audited")
    except _Violation as e:
        return AuditReport(ok=False, complete=False, message=f"NOT exactly once: {e}")
    uniq = np.unique(trained)
    n = int(uniq.size)
    history = f"{t.launches} launch{'es' if t.launches > 1 else ''}"
    if t.superseded:
        history += ", re-trained after resume: " + ", ".join(
            f"steps {a}-{b}" if a != b else f"step {a}" for a, b in t.superseded
        )
    waiting = len(t.pending or [])
    span_text = f"ids 0-{n - 1}" if n and int(uniq[-1]) == n - 1 else f"{n} distinct ids"
    message = (
        f"exactly once: {n} documents ({span_text}) over steps 1-{t.last_step} on "
        f"{t.dp_degree} DP rank{'s' if t.dp_degree > 1 else ''}"
        f"{f', {waiting} still waiting in the packer' if waiting else ''}; "
        f"{'the pass is complete (end of data)' if t.complete else 'the pass is not over'}"
        f"{t.note}; {history}"
    )
    return AuditReport(True, t.complete, message, t.last_step, n, t.superseded)


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.audit", __doc__)
    p.add_argument("output_dir", help="the run's dump folder ([job] dump_folder)")
    p.add_argument("--require-complete", action="store_true", help="fail unless the pass is over")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        report = audit(args.output_dir)
    except AuditLogError as e:
        print(f"audit: {e}", file=sys.stderr)
        return 2
    print(report.message)
    return 1 if not report.ok or (args.require_complete and not report.complete) else 0


if __name__ == "__main__":
    sys.exit(main())
