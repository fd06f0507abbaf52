"""Where a measured micro-batch imbalance comes from: the plan, or the machine's timing noise.

    python -m torchtitan_wlb.tools.imbalance_report runs/      # the records of e2e_bench --records-out
    python -m torchtitan_wlb.tools.imbalance_report runs/ --from-step 12 --json

For each ``records_<mode>.json`` of a directory (``e2e_bench --records-out``, the noise floor's
``records_floor.json`` included), on the device clock:

- ``measured``: the time-weighted micro-batch imbalance (Σ max / Σ mean per step; a micro-batch's
  slowest CP rank, each pipeline stage apart), as e2e_bench's ``measured_imbalance_device``;
- ``fitted``: the same of the times the run's own best fit predicts (in sample; under CP the
  trainer's per-rank features ``a Σd² share + b local + g gathered + c``, else ``a Σd² + b Σd + c``
  per stage): the plans' imbalance on this machine, timing noise removed;
- ``residual_spread``: the standard deviation of measured / fitted within a step (a step's common
  slow-down taken out), the noise left on top of the plan; for the floor, whose micro-batches are
  identical, the spread of their times within a step;
- under CP with the trainer's features, ``rank_spread_mean`` / ``_p95``: the fitted max / mean
  over a micro-batch's ranks; and ``fitted_whole``: the same fit with every micro-batch priced as
  the packer prices it, its ranks even and its documents local up to hybrid's floor and gathered
  beyond (all gathered where the run saw no local token): what the packing leaves, ``fitted``
  above it being the CP plans' part.

A mode whose ``fitted`` is near 1 and whose ``residual_spread`` is the floor's cannot be balanced
better by packing; docs/benchmarks_e2e.md reads these for the CPU runs.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_wlb.cost_fit import FitStats, fit_nnls
from torchtitan_wlb.cp.plan import default_hybrid_max_len
from torchtitan_wlb.tools.analysis import imbalance
from torchtitan_wlb.tools.cli import ToolParser, json_text

FLOOR = "floor"


def _groups(
    micro_batches: list[dict[str, Any]], cp: int
) -> dict[tuple[int, int], list[list[dict]]]:
    """``{(step, unit): [micro-batch: [its records]]}``: under PP a unit is a stage and each
    micro-batch one record; else one unit per step, and under CP a micro-batch is its records on
    every rank (the i-th record of a rank in a step is its i-th micro-batch); DP ranks' records
    are micro-batches of their own."""
    out: dict[tuple[int, int], dict[Any, list[dict]]] = collections.defaultdict(dict)
    seen: collections.Counter = collections.Counter()
    for m in micro_batches:
        if "stage" in m:
            out[(m["step"], m["stage"])].setdefault(m["mb"], []).append(m)
            continue
        i = seen[(m["step"], m["rank"])]
        seen[(m["step"], m["rank"])] += 1
        key = i if cp > 1 else (m["rank"], i)
        out[(m["step"], 0)].setdefault(key, []).append(m)
    return {key: [mbs[i] for i in sorted(mbs)] for key, mbs in sorted(out.items())}


def _cp(records: dict[str, Any]) -> int:
    return int(records.get("layout", {}).get("cp", 1))


def _features(m: dict[str, Any], per_rank: bool) -> list[float]:
    """A record's ``(Σd², local, gathered tokens, 1)``: the trainer's per-rank features, else of
    its documents (every token local)."""
    if per_rank:
        return [*map(float, m["fit_features"]), 1.0]
    d = np.asarray(m["doc_lens"], np.float64)
    return [float(d @ d), float(d.sum()), 0.0, 1.0]


def _fit(rows: list[dict[str, Any]], per_rank: bool) -> np.ndarray:
    """The run's own best ``(a, b, g, c)`` of the records' times on the device clock (the cost
    model's fit, every row as given)."""
    x = np.array([_features(m, per_rank) for m in rows])
    t = np.array([m["device_s"] for m in rows])
    coef, why = fit_nnls(FitStats.from_samples(x[:, 0], x[:, 1], t, x[:, 2]), online_checks=False)
    if coef is None:
        raise ValueError(f"cannot fit the micro-batch times: {why}")
    return coef


def report(records: dict[str, Any], from_step: int = 0) -> dict[str, Any]:
    """The figures above for one ``records_<mode>.json``, on its steps ``>= from_step``."""
    mbs = [m for m in records["microbatches"] if m["step"] >= from_step]
    if not mbs:
        raise ValueError(f"no micro-batch recorded from step {from_step} on")
    groups = _groups(mbs, _cp(records))
    per_rank = _cp(records) > 1 and all("fit_features" in m for m in mbs)
    # One fit per pipeline stage (the stages run different layers), one for all else.
    units = sorted({unit for _, unit in groups})
    coef = {}
    for unit in units:
        rows = [m for (_, u), mb in groups.items() if u == unit for recs in mb for m in recs]
        coef[unit] = _fit(rows, per_rank)
    measured, fitted, residuals, spread = [], [], [], []
    for (_, unit), mb in groups.items():
        t = np.array([max(m["device_s"] for m in recs) for recs in mb])
        ranks = [np.array([_features(m, per_rank) for m in recs]) @ coef[unit] for recs in mb]
        p = np.array([r.max() for r in ranks])
        measured.append(t)
        fitted.append(p)
        ratio = t / p
        residuals.extend(ratio / ratio.mean() - 1.0)
        spread.extend(r.max() / r.mean() for r in ranks if len(r) > 1)
    out = {
        "micro_batches": sum(len(t) for t in measured),
        "measured": imbalance(measured),
        "fitted": imbalance(fitted),
        "fit_mean_abs_error": float(
            np.mean(np.abs(np.concatenate(fitted) / np.concatenate(measured) - 1.0))
        ),
        "residual_spread": float(np.std(residuals)),
    }
    if per_rank and spread:
        out["rank_spread_mean"] = float(np.mean(spread))
        out["rank_spread_p95"] = float(np.percentile(spread, 95))
        out["fitted_whole"] = imbalance(_whole_costs(groups, coef, _cp(records)))
    return out


def _whole_costs(
    groups: dict[tuple[int, int], list[list[dict]]], coef: dict[int, np.ndarray], cp: int
) -> list[np.ndarray]:
    """Per step, each micro-batch's cost by the per-rank fit ``(a, b, g, c)`` as the packer sees
    it: ``(a Σd² + b Σ local d + g Σ gathered d) / cp + c``, a document local up to hybrid's floor
    (the packer's ``whole_max_len``), or gathered whatever its length when no rank held a local
    token (per-document sharding)."""
    local_seen = any(m["fit_features"][1] > 0 for mb in groups.values() for r in mb for m in r)
    whole_max = default_hybrid_max_len(cp) if local_seen else 0
    out = []
    for (_, unit), mb in groups.items():
        rows = []
        for recs in mb:
            d = np.asarray(recs[0]["doc_lens"], np.float64)
            local = float(d[d <= whole_max].sum())
            rows.append([float(d @ d) / cp, local / cp, (float(d.sum()) - local) / cp, 1.0])
        out.append(np.asarray(rows) @ coef[unit])
    return out


def floor_report(records: dict[str, Any], from_step: int = 0) -> dict[str, Any]:
    """The floor's identical micro-batches: measured imbalance and their spread within a step."""
    mbs = [m for m in records["microbatches"] if m["step"] >= from_step]
    if not mbs:
        raise ValueError(f"no micro-batch recorded from step {from_step} on")
    measured, spread = [], []
    for mb in _groups(mbs, _cp(records)).values():
        t = np.array([max(m["device_s"] for m in recs) for recs in mb])
        measured.append(t)
        spread.extend(t / t.mean() - 1.0)
    return {
        "micro_batches": sum(len(t) for t in measured),
        "measured": imbalance(measured),
        "residual_spread": float(np.std(spread)),
    }


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.imbalance_report", __doc__)
    p.add_argument("records", help="directory of records_<mode>.json (e2e_bench --records-out)")
    p.add_argument("--from-step", type=int, default=0, help="leave out the steps before this one")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    files = sorted(Path(args.records).glob("records_*.json"))
    if not files:
        p.error(
            f"{args.records!r} holds no records_<mode>.json (write them with e2e_bench "
            "--records-out DIR)"
        )
    out: dict[str, Any] = {}
    for path in files:
        mode = path.stem.removeprefix("records_")
        try:
            records = json.loads(path.read_text())
            out[mode] = (floor_report if mode == FLOOR else report)(records, args.from_step)
        except (ValueError, KeyError, TypeError) as e:
            p.error(f"{path}: {type(e).__name__}: {e}")
    if args.json:
        print(json_text(out))
        return 0
    for mode, r in out.items():
        line = f"{mode:12s} measured {r['measured']:.3f}  "
        line += f"fitted {r['fitted']:.3f}  " if "fitted" in r else " " * 16
        line += f"residual spread {100 * r['residual_spread']:.2f} %"
        if "rank_spread_mean" in r:
            line += f"  ranks {r['rank_spread_mean']:.4f} (p95 {r['rank_spread_p95']:.4f})"
            line += f"  whole {r['fitted_whole']:.3f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
