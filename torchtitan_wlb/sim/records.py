"""The calibration records file (docs/simulator.md#calibration): measured micro-batch times, read
and checked, and grouped into whole micro-batches or pipeline steps for ``fit`` and ``replay``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchtitan_wlb.cost_fit import stage_sums


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


Records = list[MicroBatchRecord]
_INT_FIELDS = {"step": -1, "rank": 0, "stage": -1, "mb": -1}  # optional, with their defaults


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def parse_records(raw: list, source: str) -> Records:
    """Validate a list of JSON records (dicts, or ``[doc_lens, seconds]`` pairs)."""
    records = []
    for i, item in enumerate(raw):
        where = f"{source}: micro-batch record {i}"
        if isinstance(item, (list, tuple)) and len(item) == 2:
            item = {"doc_lens": item[0], "seconds": item[1]}
        if not isinstance(item, dict) or "doc_lens" not in item or "seconds" not in item:
            raise ValueError(f"{where} must be {{doc_lens, seconds, ...}} or [doc_lens, seconds]")
        lens, secs = item["doc_lens"], item["seconds"]
        extra = {k: int(item.get(k, d)) for k, d in _INT_FIELDS.items()}
        extra |= {k: None if item.get(k) is None else float(item[k]) for k in ("fwd_s", "bwd_s")}
        if extra["stage"] >= 0 and not (
            extra["mb"] >= 0 and _positive(extra["fwd_s"]) and _positive(extra["bwd_s"])
        ):
            raise ValueError(
                f"{source}: pipeline record {i} (stage {extra['stage']}) needs 'mb' >= 0 and "
                f"'fwd_s', 'bwd_s' > 0"
            )
        ok = isinstance(lens, list) and all(isinstance(d, int) and _positive(d) for d in lens)
        if not (ok and lens):
            raise ValueError(f"{where} doc_lens = {lens!r} must be positive integers")
        if not _positive(secs):
            raise ValueError(f"{where} seconds = {secs!r} must be > 0")
        records.append(MicroBatchRecord(np.asarray(lens, dtype=np.int64), float(secs), **extra))
    return records


def load_records(path: str | Path) -> tuple[Records, dict[int, float], dict]:
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


def whole_model_records(records: Records) -> Records:
    """Per-stage records summed over the stages (each micro-batch's whole time)."""
    keys = [(r.step, r.mb, tuple(r.doc_lens.tolist())) for r in records]
    done, sums = stage_sums(keys, [r.stage for r in records], [r.seconds for r in records])
    rows = zip(done, sums[:, 0].tolist(), strict=True)
    return [MicroBatchRecord(np.asarray(k[2], np.int64), t, k[0]) for k, t in rows]


def pipeline_steps(records: Records) -> dict[int, tuple[list[np.ndarray], np.ndarray]]:
    """step -> (doc_lens per micro-batch, measured [fwd / bwd, n_stages, m] seconds); steps
    missing an action (a rank's log is incomplete) are left out."""
    row = {k: i for i, k in enumerate(sorted({r.stage for r in records if r.stage >= 0}))}
    by_step: dict[int, Records] = {}
    for r in records:
        if r.stage >= 0 and r.step >= 0:
            by_step.setdefault(r.step, []).append(r)
    out = {}
    for step, recs in by_step.items():
        m = max(r.mb for r in recs) + 1
        times, lens = np.full((2, len(row), m), np.nan), [np.zeros(0, np.int64)] * m
        for r in recs:
            if not np.isnan(times[0, row[r.stage], r.mb]):
                raise ValueError(
                    f"step {step}: two records for stage {r.stage}, micro-batch {r.mb}; pipeline "
                    f"calibration supports one pipeline (DP = 1)"
                )
            times[:, row[r.stage], r.mb], lens[r.mb] = (r.fwd_s, r.bwd_s), r.doc_lens
        if not np.isnan(times).any():  # every (stage, micro-batch) recorded
            out[step] = (lens, times)
    return out
