"""Measured micro-batch times: the calibration file format (docs/simulator.md#calibration), read
and regrouped. Pipeline runs write one record per micro-batch *and stage*."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class MicroBatchRecord:
    """One measured micro-batch: its documents and forward + backward seconds; the step (-1:
    standalone) and DP rank that ran it; for pipeline records the (virtual) stage (-1: whole
    model), its index in the step and that stage's forward and backward seconds."""

    doc_lens: np.ndarray
    seconds: float
    step: int = -1
    rank: int = 0
    stage: int = -1
    mb: int = -1
    fwd_s: float | None = None
    bwd_s: float | None = None


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def parse_records(raw: list, source: str) -> list[MicroBatchRecord]:
    """Validate a list of JSON records (dicts, or ``[doc_lens, seconds]`` pairs)."""
    records = []
    for i, item in enumerate(raw):
        if isinstance(item, dict):
            if "doc_lens" not in item or "seconds" not in item:
                raise ValueError(f"{source}: micro-batch record {i} needs 'doc_lens' and 'seconds'")
            lens, secs = item["doc_lens"], item["seconds"]
            ints = {"step": -1, "rank": 0, "stage": -1, "mb": -1}
            extra = {k: int(item.get(k, d)) for k, d in ints.items()}
            extra |= {
                k: None if item.get(k) is None else float(item[k]) for k in ("fwd_s", "bwd_s")
            }
            if extra["stage"] >= 0 and not (
                extra["mb"] >= 0 and _positive(extra["fwd_s"]) and _positive(extra["bwd_s"])
            ):
                raise ValueError(
                    f"{source}: pipeline record {i} (stage {extra['stage']}) needs 'mb' >= 0 and "
                    f"'fwd_s', 'bwd_s' > 0"
                )
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            (lens, secs), extra = item, {}
        else:
            raise ValueError(f"{source}: micro-batch record {i} must be {{doc_lens, seconds}}")
        ok = isinstance(lens, list) and all(isinstance(d, int) and _positive(d) for d in lens)
        if not (ok and lens):
            raise ValueError(
                f"{source}: micro-batch record {i} doc_lens = {lens!r} must be positive integers"
            )
        if not _positive(secs):
            raise ValueError(f"{source}: micro-batch record {i} seconds = {secs!r} must be > 0")
        records.append(MicroBatchRecord(np.asarray(lens, dtype=np.int64), float(secs), **extra))
    return records


def load_records(path: str | Path) -> tuple[list[MicroBatchRecord], dict[int, float], dict]:
    """Read a calibration file: (micro-batch records, measured step times, metadata)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"calibration file {str(path)!r} does not exist")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {path}: invalid JSON ({exc.msg})") from None
    meta: dict = {}
    steps: dict[int, float] = {}
    if isinstance(raw, dict):
        meta = {k: v for k, v in raw.items() if k not in ("microbatches", "steps")}
        steps = {int(s["step"]): float(s["seconds"]) for s in raw.get("steps", [])}
        raw = raw.get("microbatches", [])
    if not isinstance(raw, list):
        raise ValueError(f"calibration file {path}: expected a list of micro-batch records")
    return parse_records(raw, str(path)), steps, meta


def whole_model_records(records: list[MicroBatchRecord]) -> list[MicroBatchRecord]:
    """Per-stage records summed over the stages (each micro-batch's whole time)."""
    by_mb: dict[tuple[int, int], list[MicroBatchRecord]] = {}
    for r in records:
        by_mb.setdefault((r.step, r.mb), []).append(r)
    n_stages = len({r.stage for r in records})
    return [
        MicroBatchRecord(rs[0].doc_lens, float(sum(r.seconds for r in rs)), step)
        for (step, _), rs in sorted(by_mb.items())
        if len({r.stage for r in rs}) == n_stages
    ]


def pipeline_steps(records: list[MicroBatchRecord]) -> dict[int, dict]:
    """step -> {"lens": [doc_lens per mb], "fwd", "bwd": measured [n_stages, m]}; steps missing
    an action (a rank's log is incomplete) are left out."""
    row = {k: i for i, k in enumerate(sorted({r.stage for r in records if r.stage >= 0}))}
    by_step: dict[int, list[MicroBatchRecord]] = {}
    for r in records:
        if r.stage >= 0 and r.step >= 0:
            by_step.setdefault(r.step, []).append(r)
    out = {}
    for step, recs in by_step.items():
        m = max(r.mb for r in recs) + 1
        fwd, bwd = np.full((len(row), m), np.nan), np.full((len(row), m), np.nan)
        lens: list[np.ndarray | None] = [None] * m
        for r in recs:
            if not np.isnan(fwd[row[r.stage], r.mb]):
                raise ValueError(
                    f"step {step}: two records for stage {r.stage}, micro-batch {r.mb}; pipeline "
                    f"calibration supports one pipeline (DP = 1)"
                )
            fwd[row[r.stage], r.mb], bwd[row[r.stage], r.mb] = r.fwd_s, r.bwd_s
            lens[r.mb] = r.doc_lens
        if not (np.isnan(fwd).any() or np.isnan(bwd).any() or any(x is None for x in lens)):
            out[step] = {"lens": lens, "fwd": fwd, "bwd": bwd}
    return out
