"""The figures of run_checks.sh's `online` part, from its archive of metrics JSONL:

    python scripts/gpu/online_report.py online_metrics.tar.gz [--after STEP]

Per run (floor, analytic, online), over the steps after STEP (default: the online run's first
adopted refit, so that both models are compared on the same steps; the floor after its first): the
measured micro-batch
imbalance (Σ over steps of the slowest micro-batch's forward+backward / Σ of their mean), the
predicted one beside it, tokens per second, peak memory; then each model's mean absolute relative
error on the micro-batches (the online fit as the trainer adopted it; the analytic model at the
scale that fits best, since only its shape matters to the packer).
"""

from __future__ import annotations

import argparse
import json
import tarfile

import numpy as np

from torchtitan_wlb.tools.analysis import fit_error, measured_imbalance
from torchtitan_wlb.tools.e2e_bench import calibration_records

RUNS = ("floor", "analytic", "online")


def read(archive: str) -> dict[str, dict[int, dict]]:
    """Each run's rank-0 metrics records by step."""
    runs = {}
    with tarfile.open(archive) as tar:
        for run in RUNS:
            lines = tar.extractfile(f"{run}/wlb_metrics/rank_0.jsonl").read().splitlines()
            runs[run] = {rec["step"]: rec for rec in map(json.loads, lines)}
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("archive")
    p.add_argument("--after", type=int, default=None, help="score the steps after this one")
    args = p.parse_args()
    try:
        runs = read(args.archive)
    except (OSError, tarfile.TarError, KeyError) as exc:  # not the online part's archive
        p.error(f"{args.archive}: not an archive of run_checks.sh's online part ({exc})")
    adopted = [r for r in runs["online"].values() if r.get("wlb/cost_refit_adopted")]
    after = (
        args.after
        if args.after is not None
        else int(adopted[0]["wlb/cost_refit_effective_step"]) - 1
    )
    print(f"steps after {after}")
    for run, recs in runs.items():
        steps = [s for s in sorted(recs) if s > (1 if run == "floor" else after)]
        tokens = sum(recs[s]["wlb/tokens"] for s in steps)
        seconds = sum(recs[s]["wlb/step_time_s"] for s in steps)
        predicted = sum(recs[s]["wlb/max_workload"] for s in steps) / sum(
            recs[s]["wlb/mean_workload"] for s in steps
        )
        print(
            f"{run:9s} steps {len(steps):2d}  measured imbalance "
            f"{measured_imbalance([recs], steps, 'dp2', device=True):.4f}  predicted "
            f"{predicted:.4f}  tokens/s {tokens / seconds:,.0f}  peak "
            f"{max(r['peak_mem_gib'] for r in recs.values()):.1f} GiB"
        )
    coef = [adopted[-1][f"wlb/cost_refit_{k}"] for k in "abc"]
    print("online coefficients (last adopted): a {:.4g}  b {:.4g}  c {:.4g}".format(*coef))
    # The online run logs the model in use: the analytic one until its first adoption.
    logged = next(r for r in runs["online"].values() if "wlb/cost_attn_coef" in r)
    attn, linear = logged["wlb/cost_attn_coef"], logged["wlb/cost_linear_coef"]
    for run in ("analytic", "online"):
        mbs = calibration_records([runs[run]], [s for s in runs[run] if s > after])["microbatches"]
        t = np.array([m["device_s"] for m in mbs])
        d2, d1 = np.array([[sum(x * x for x in m["doc_lens"]), sum(m["doc_lens"])] for m in mbs]).T
        shape = attn * d2 + linear * d1
        scale = float(t @ shape / (shape @ shape))
        print(
            f"on the {run} run's {len(mbs)} micro-batches: online fit error "
            f"{fit_error(mbs, coef, 1, 'device_s'):.4f}, analytic (best scale) "
            f"{float(np.mean(np.abs(scale * shape - t) / t)):.4f}"
        )


if __name__ == "__main__":
    main()
