"""PNG figures of simulation results; matplotlib (the ``sim`` extra) is imported only to draw."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from torchtitan_wlb.sim.engine import ModeResult


def _subplots(*args, **kw):
    """matplotlib (imported here, headless) and a new figure: (pyplot, figure, axes)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(
            "--plot needs matplotlib: pip install 'torchtitan-wlb[sim]' (or pip install matplotlib)"
        ) from exc
    return (plt, *plt.subplots(*args, **kw))


def _save(plt, fig, path: str | Path, **kw) -> Path:
    """Write ``fig`` (laid out tight unless ``kw`` says how) and free it."""
    if not kw:
        fig.tight_layout()
    fig.savefig(Path(path), dpi=110, **kw)
    plt.close(fig)
    return Path(path)


def latency_heatmap(results: Sequence[ModeResult], path: str | Path, max_rows: int = 48) -> Path:
    """Each micro-batch's compute on each CP rank over its step's mean (paper Figure 4): rows that
    differ are PP-level imbalance, columns CP-level; one colour scale so that modes compare."""
    n_steps, n_mb, cp = results[0].mb_rank_compute_s.shape
    steps = max(1, min(n_steps, max_rows // max(1, n_mb)))
    # Normalised within each step: balance inside the global batch is the goal, not across steps.
    lats = [r.mb_rank_compute_s[:steps] for r in results]
    mats = [(lat / lat.mean(axis=(1, 2), keepdims=True)).reshape(-1, cp) for lat in lats]
    vmax = max(1.1, *(float(m.max()) for m in mats))
    vmin = min(0.9, *(float(m.min()) for m in mats))
    n_rows = mats[0].shape[0]
    size = (2.2 * len(results) + 1.5, 1.6 + 0.16 * n_rows)
    plt, fig, axes = _subplots(1, len(results), figsize=size, squeeze=False)
    im = None
    dp = results[0].rank_compute_s.shape[1]
    labels = [
        f"s{s} dp{d} mb{j}" for s in range(steps) for d in range(dp) for j in range(n_mb // dp)
    ]
    for ax, r, mat in zip(axes[0], results, mats, strict=True):
        im = ax.imshow(
            mat, cmap="RdYlGn_r", vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest"
        )
        ax.set_title(f"{r.mode.name}\nworst {mat.max():.2f}", fontsize=9)
        ax.set_xlabel("CP rank", fontsize=8)
        ax.set_xticks(range(cp))
        ax.tick_params(labelsize=7)
        ax.set_yticks([])
    axes[0, 0].set_yticks(range(n_rows), labels, fontsize=6)  # row labels on the first panel only
    fig.colorbar(im, ax=axes[0].tolist(), label="latency / step mean", shrink=0.9)
    return _save(plt, fig, path, bbox_inches="tight")


def gantt(results: Sequence[ModeResult], path: str | Path) -> Path:
    """One step's pipeline timeline (slowest DP replica) per mode on a shared time axis; the hue
    is the micro-batch, so a long one can be followed through the stages."""
    plt, fig, axes = _subplots(
        len(results),
        1,
        figsize=(12, 1.3 + 0.45 * results[0].gantt[0].pp * len(results)),
        squeeze=False,
        sharex=True,
    )
    cmap = plt.get_cmap("tab20")
    for ax, r in zip(axes[:, 0], results, strict=True):
        sched, start, end = r.gantt
        base = np.array([cmap((2 * int(mb)) % 20) for mb in sched.mb])
        colors = np.where(sched.is_fwd[:, None], base, base * np.array([0.6, 0.6, 0.6, 1.0]))
        for rank in range(sched.pp):  # one call per stage, not per operation
            sel = np.flatnonzero(sched.rank == rank)
            ax.broken_barh(
                list(zip(start[sel], end[sel] - start[sel], strict=True)),
                (rank - 0.4, 0.8),
                facecolors=colors[sel],
                edgecolor="white",
                linewidth=0.3,
            )
        ax.set_ylim(sched.pp - 0.5, -0.5)
        ax.set_yticks(range(sched.pp), [f"PP{p}" for p in range(sched.pp)], fontsize=8)
        title = f"{r.mode.name}: step {end.max():.2f} s, bubbles {r.bubble_fraction[0]:.0%}"
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("time (s); light = forward, dark = backward, colour = micro-batch")
    return _save(plt, fig, path)


def speedup_bars(
    speedups: Mapping[str, Mapping[str, float]],
    path: str | Path,
    title: str = "Speedup over Plain-4D",
    paper: Mapping | None = None,
) -> Path:
    """Grouped bars: per configuration (outer key) each mode's speedup; ``paper`` (same keys)
    adds the paper's values as black ticks."""
    configs = list(speedups)
    modes = list(dict.fromkeys(m for c in configs for m in speedups[c]))
    width = 0.8 / max(1, len(modes))
    plt, fig, ax = _subplots(
        figsize=(max(5.0, 1.1 * len(configs) * max(1, len(modes)) * 0.6 + 2), 3.6)
    )
    x = np.arange(len(configs))
    for j, mode in enumerate(modes):
        vals = [speedups[c].get(mode, np.nan) for c in configs]
        pos = x + (j - (len(modes) - 1) / 2) * width
        bars = ax.bar(pos, vals, width, label=mode)
        for b, v in zip(bars, vals, strict=True):
            if np.isfinite(v):  # inside the bar's top, clear of the paper's tick above it
                ax.text(
                    b.get_x() + b.get_width() / 2,
                    v - 0.012,
                    f"{v:.2f}",
                    ha="center",
                    va="top",
                    fontsize=7,
                    color="white",
                    fontweight="bold",
                )
        if paper:
            pv = [paper.get(c, {}).get(mode, np.nan) for c in configs]
            ax.scatter(
                pos,
                pv,
                marker="_",
                s=300,
                color="black",
                zorder=3,
                label="paper" if j == 0 else None,
            )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(x, configs, fontsize=8)
    ax.set_ylabel("speedup (x)")
    ax.set_ylim(0.8, max(1.5, np.nanmax([v for c in speedups.values() for v in c.values()]) + 0.12))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=min(4, len(modes) + 1))
    return _save(plt, fig, path)


def length_histogram(hist: Sequence[Mapping], context_len: int, path: str | Path) -> Path:
    """Documents per length bucket and each bucket's token share: ``wlb-analyze --plot``."""
    plt, fig, (a1, a2) = _subplots(1, 2, figsize=(10, 3.4))
    x = np.arange(len(hist))
    a1.bar(x, [r["docs"] for r in hist], color="tab:blue")
    a1.set_yscale("log")
    a1.set_ylim(bottom=0.8)  # bars start at one document, so small buckets stay visible
    a1.set_title("documents per length bucket")
    a2.bar(
        x,
        [100 * r["token_share"] for r in hist],
        color=["tab:red" if r["over_half_context"] else "tab:green" for r in hist],
    )
    a2.set_title(f"share of tokens (%); red: > context/2 ({context_len // 2})")
    for ax in (a1, a2):
        ax.set_xticks(x, [f"{r['min_len']}" for r in hist], rotation=60, fontsize=7)
        ax.set_xlabel("document length (tokens, bucket start)")
    return _save(plt, fig, path)
