"""docs/reproduction.md, the paper's Table 2 and Figures 12-15 beside the simulator's: the page
template with every number computed from one run on the workload (docs/benchmarks_sim.md)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from torchtitan_wlb.cp.plan import ATTENTION_TILE
from torchtitan_wlb.cp.profile import resolve_profile
from torchtitan_wlb.models.catalogue import get_model
from torchtitan_wlb.packing.paper import PAPER_T2_ORIGINAL
from torchtitan_wlb.sim import engine as sim
from torchtitan_wlb.sim.config import MODES, SimConfig, epoch_steps
from torchtitan_wlb.sim.engine import ModeResult, simulate_mode, speedup
from torchtitan_wlb.sim.hardware import HardwareProfile, Layout
from torchtitan_wlb.workloads import (
    cut_stream,
    load_lengths,
    long_documents,
    long_token_share,
    split_long,
    steps_arg,
)

K = 1024


class PaperConfig(NamedTuple):
    """A setup of the paper (a Table 1 row): model (of models.catalogue), context, (TP, CP, PP, DP)."""

    model: str
    context_len: int
    layout: Layout


PAPER_TABLE1 = tuple(PaperConfig(m, c * K, Layout(*lay)) for m, c, lay in (
    ("550M", 64, (2, 2, 4, 2)), ("550M", 128, (2, 4, 4, 1)), ("7B", 64, (4, 2, 4, 1)),
    ("7B", 128, (8, 2, 4, 1)), ("30B", 64, (8, 2, 4, 1)), ("30B", 128, (8, 4, 4, 1)),
    ("70B", 64, (16, 4, 4, 1)), ("70B", 128, (16, 4, 4, 1))))  # fmt: skip
TOL = 0.05  # a figure meets the paper's when within +-TOL
WARMUP = 4
# The paper's published numbers (WLB-LLM, OSDI '25).
PAPER_FIG12 = {"avg": 1.23, "avg_64k": 1.15, "avg_128k": 1.30, "vs_fixed": 1.19, "fixed": 1.03}
PAPER_FIG13 = {"per_doc_cp": 1.02, "adaptive_cp": 1.05, "varlen_packing": 1.28, "wlb": 1.33}
PAPER_FIG14 = {64 * K: 1.07, 160 * K: 1.40}
PAPER_FIG15 = {"cp": 4, "adaptive_vs_per_sequence": 0.075, "adaptive_vs_per_document": 0.034}
H100_BF16_PEAK_TFLOPS = 989.0  # dense, datasheet
MAIN = PaperConfig("7B", 128 * K, Layout(8, 2, 4, 1))  # Table 2 and Figures 13-15
SCALE = PaperConfig("70B", 128 * K, Layout(8, 16, 16, 4))  # the paper's 8K-GPU job (model unknown)
SCALE_TIMED_STEPS, SCALE_TARGET_S = 20, 30.0
THREE = ("plain_4d", "fixed_4d", "wlb")
FIG13_CORE = ("plain_4d", "per_doc_cp", "adaptive_cp", "varlen_packing", "wlb")


CP_PROFILE: str | None = None
"""The measured attention table every figure times attention and adaptive CP with (``--cp-profile``,
set once by ``main``); None: the hardware profile's simulated kernel."""


def _cfg(model: str, ctx: int, layout: Layout, steps: int | None, lengths=None, **kw) -> SimConfig:
    """A figure's configuration; ``steps=None``: one pass over ``lengths`` (``epoch_steps``)."""
    if steps is None:
        steps = epoch_steps(int(np.sum(lengths)), layout.pp * layout.dp, ctx, WARMUP)
    return SimConfig(
        model=get_model(model),
        layout=layout,
        context_len=ctx,
        steps=steps,
        warmup_steps=WARMUP,
        cp_profile=CP_PROFILE,
        **kw,
    )


def attention_source(hw_name: str) -> dict:
    """What timed attention on this page, in the template's words: the measured table (its device
    and backend) or the simulated kernel of the hardware profile."""
    if CP_PROFILE is None:
        return {
            "attn_source": f"the simulated {hw_name} kernel",
            "attn_next": "A measured GPU table (`torchtitan_wlb.tools.cp_profile --device cuda`, "
            "then `--cp-profile FILE`) would replace the kernel model here.",
        }
    table = resolve_profile(CP_PROFILE)
    return {
        "attn_source": f"the attention table measured on {table.device} ({table.backend}, "
        f"`{CP_PROFILE}`)",
        "attn_next": "Attention time and adaptive CP's choices here come from that measured "
        "table, not from the kernel model.",
    }


def run_modes(lengths, cfg: SimConfig, modes: Iterable[str]) -> dict[str, ModeResult]:
    return {m: simulate_mode(MODES[m], lengths, cfg) for m in modes}


def x3(value: float) -> str:
    return f"{value:.3f}x"


def paper_x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def met(ok: bool, no: str = "**not met**") -> str:
    return "met" if ok else no


def md_rows(rows: Iterable[Sequence]) -> str:
    """A markdown table's rows (its header and fixed rows are the template's)."""
    return "\n".join("| " + " | ".join(map(str, r)) + " |" for r in rows)


def table2(workload: str, quick: bool, cfg: SimConfig) -> dict:
    """Table 2 through the packing benchmark (``pack_bench --table2``) with the profiled cost model."""
    cm = sim.cost_model_for(cfg)
    argv = [
        "--lengths",
        workload,
        "--context-len",
        str(cfg.context_len),
        "--micro-batches",
        str(cfg.n_global),
        "--steps",
        "40" if quick else "100",
        "--table2",
        "--attn-coef",
        repr(cm.attn_coef),
        "--linear-coef",
        repr(cm.linear_coef),
        "--solver-time-limit",
        "2" if quick else "5",
        "--solver-steps",
        "2" if quick else "4",
    ]
    cmd = [sys.executable, "-m", "torchtitan_wlb.tools.pack_bench", *argv, "--json"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    *progress, last = proc.stdout.strip().splitlines() or [""]
    if proc.returncode:
        raise ValueError(f"the packing benchmark failed (exit {proc.returncode}): {' '.join(cmd)}")
    print("\n".join(progress))
    rows = json.loads(last)["table2"]

    def name(r: dict) -> str:
        return r["packer"] + ("" if r["config"] == "-" else f" {r['config']}")

    def paper_ms(text: str) -> float:  # upper end of the paper's overhead, in ms (inf: none)
        m = re.search(r"([\d.]+)\s*(ms|s)$", text)
        return float("inf") if m is None else float(m[1]) * (1.0 if m[2] == "ms" else 1e3)

    by_imb = sorted(rows, key=lambda r: r["imbalance"])
    fg = [r["imbalance"] for r in rows if r["packer"] == "fixed_greedy"]
    wlb = next(r for r in rows if r["packer"] == "wlb")
    shape = (
        f"original packing the worst — {met(by_imb[-1]['packer'] == 'original')}; fixed-length "
        f"greedy better as G grows (at the cost of G - 1 steps of delay) — "
        f"{met(bool(np.all(np.diff(fg) < 0)))}; WLB-LLM the lowest imbalance — "
        f"{met(by_imb[0]['packer'] == 'wlb')}, with a mean delay of "
        f"{wlb['avg_delay_iters']:.2f} steps and {wlb['plan_ms']:.1f} ms overhead"
    )
    differ = [
        f"{name(r)} ({r['imbalance']:.3f} vs {r['paper_imbalance']:.2f})"
        for r in rows
        if r["paper_imbalance"] and abs(r["imbalance"] - r["paper_imbalance"]) > 0.1
    ]
    slower = [
        f"{name(r)} ({r['plan_ms']:.1f} ms vs {r['paper_overhead']})"
        for r in rows
        if r["plan_ms"] > paper_ms(r["paper_overhead"])
    ]
    table = [
        [
            r["packer"],
            r["config"],
            paper_x(r["paper_imbalance"]).rstrip("x"),
            f"{r['imbalance']:.3f}",
            r["paper_overhead"],
            f"{r['plan_ms']:.1f} ms",
            f"{r['avg_delay_iters']:.2f}",
        ]
        for r in rows
    ]
    return {
        "t2_table": md_rows(table),
        "t2_argv": " ".join(argv),
        "t2_shape": shape,
        "t2_differ": "; ".join(differ) or "none",
        "t2_slower": "; ".join(slower) or "none",
        "t2_limit": argv[argv.index("--solver-time-limit") + 1],
    }


F12_PAIRS = {
    "wlb": ("plain_4d", "wlb"),
    "fixed": ("plain_4d", "fixed_4d"),
    "wlb_fixed": ("fixed_4d", "wlb"),
    "tt": ("plain_4d_torchtitan", "wlb"),
}


def fig12(lengths, steps: int | None) -> dict:
    sp, bars, be, rows = {k: [] for k in F12_PAIRS}, {}, {}, []
    for pc in PAPER_TABLE1:
        cfg = _cfg(pc.model, pc.context_len, pc.layout, steps, lengths)
        res = run_modes(lengths, cfg, (*THREE, "plain_4d_torchtitan"))
        s = {k: speedup(res[a], res[b]) for k, (a, b) in F12_PAIRS.items()}
        for k, x in s.items():
            sp[k].append(x)
        be.setdefault(pc.model, []).append(sim.cost_model_for(cfg).break_even_length / K)
        bars[f"{pc.model}\n{pc.context_len // K}K"] = {"fixed_4d": s["fixed"], "wlb": s["wlb"]}
        plain, wlb = res["plain_4d"], res["wlb"]
        rows.append(
            [
                pc.model,
                f"{pc.context_len // K}K",
                pc.layout.as_tuple(),
                f"{plain.imbalance.mean():.2f}",
                x3(s["fixed"]),
                f"**{x3(s['wlb'])}**",
                x3(s["wlb_fixed"]),
                f"{plain.bubble_fraction.mean():.2f} / {wlb.bubble_fraction.mean():.2f}",
                x3(s["tt"]),
            ]
        )
    ctx, models = (
        np.array([getattr(pc, a) for pc in PAPER_TABLE1]) for a in ("context_len", "model")
    )
    sp_a = np.array(sp["wlb"])
    by_model = {m: float(sp_a[models == m].mean()) for m in dict.fromkeys(models)}
    wide = max(PAPER_TABLE1, key=lambda pc: pc.layout.tp)
    return {f"f12_{k}": float(np.mean(x)) for k, x in sp.items()} | {
        "a64": float(sp_a[ctx == 64 * K].mean()),
        "a128": float(sp_a[ctx == 128 * K].mean()),
        "f12_table": md_rows(rows),
        "bars": bars,
        "n_configs": len(PAPER_TABLE1),
        "size_ok": met(bool(np.all(np.diff(list(by_model.values())) < 0)), "**not monotone**"),
        "by_model": " / ".join(f"{m} {x3(s)}" for m, s in by_model.items()),
        "models": " / ".join(by_model),
        "by_model_x": " / ".join(map(x3, by_model.values())),
        "top_model": max(by_model, key=by_model.get),
        "break_even": ", ".join(
            f"{m} ~{min(b):.0f}"
            + ("" if round(min(b)) == round(max(b)) else f"-{max(b):.0f}")
            + "K"
            for m, b in be.items()
        ),
        "wide_model": wide.model,
        "wide_tp": wide.layout.tp,
        "wide_nodes": -(-wide.layout.tp // HardwareProfile().gpus_per_node),
        "dp_configs": ", ".join(
            f"{pc.model} at {pc.context_len // K}K" for pc in PAPER_TABLE1 if pc.layout.dp > 1
        ),
    }


def _span(docs: np.ndarray) -> float:
    """Token-weighted mean document length: the attention work per token grows with it."""
    d = np.asarray(docs, dtype=np.float64)
    return float((d * d).sum() / d.sum())


def shuffled_pack(mode, lengths, cfg: SimConfig, n_steps: int):
    """Diagnostic: the mode's packed micro-batches with their documents in random order, to separate
    the effect of *where* long documents sit in a sequence from per-sequence sharding itself."""
    steps, stats = sim.pack_steps(mode, lengths, cfg, n_steps)
    rng = np.random.default_rng(cfg.seed)
    return [[rng.permutation(mb) for mb in step] for step in steps], stats


def fig13(lengths, steps: int | None) -> tuple[dict, dict[str, ModeResult]]:
    cfg = _cfg(*MAIN, steps, lengths)
    names = (
        "plain_4d",
        "per_doc_cp",
        "adaptive_cp",
        "varlen_no_delay",
        "varlen_packing",
        "wlb_no_delay",
        "fixed_4d",
        "wlb_paper",
        "wlb",
    )
    res = run_modes(lengths, cfg, names + tuple(f"{n}_torchtitan" for n in FIG13_CORE[:3]))
    shuf = {n: simulate_mode(MODES[n], lengths, cfg, shuffled_pack) for n in FIG13_CORE[:2]}
    base, tt_modes = res["plain_4d_torchtitan"], ("per_doc_cp_torchtitan", "adaptive_cp_torchtitan")
    v = {n: speedup(res["plain_4d"], res[n]) for n in names}
    tt = {n: speedup(base, res[n]) for n in ("varlen_packing", "wlb", *tt_modes)} | {
        "shuffled": speedup(shuf["plain_4d"], shuf["per_doc_cp"]),
        "plain": speedup(res["plain_4d"], base),
    }

    def row(n: str, s: float, bold: bool) -> list:
        paper, r = PAPER_FIG13.get(n.removesuffix("_torchtitan")), res[n]
        mark = "" if paper is None else (" ✓" if abs(s - paper) <= TOL else f" ✗ (outside ±{TOL})")
        return [
            f"{MODES[n].description} (`{n}`)",
            paper_x(paper),
            f"**{x3(s)}**{mark}" if bold else x3(s),
            f"{r.imbalance.mean():.3f}",
            f"{r.per_document_share:.2f}",
        ]

    # A long document followed by short ones, sharded per sequence: its CP ranks' attention time.
    ctx = cfg.context_len
    ex_long, ex_short = 3 * ctx // 4, 2 * K
    ex = np.array([ex_long] + [ex_short] * ((ctx - ex_long) // ex_short))
    attn = sim.shard_costs(sim.cp_shards([ex], cfg, "per_sequence"), cfg).attn_fwd[0]
    return v | {f"tt_{k}": s for k, s in tt.items()} | {
        "f13_table": md_rows(row(n, v[n], True) for n in names),
        "f13_tt": md_rows(row(n, tt[n], False) for n in tt_modes),
        "shuf_imb": shuf["per_doc_cp"].imbalance.mean(),
        "tt_imb": base.imbalance.mean(),
        "shuf_share": shuf["per_doc_cp"].per_document_share,
        "tt_share": base.per_document_share,
        "tt_span_drop": 100.0
        * (1.0 - _span(cut_stream(lengths, ctx)) / _span(split_long(lengths, ctx))),
        "whole_imb": res["plain_4d"].pack_stats["imbalance"],
        "cut_imb": base.pack_stats["imbalance"],
        "ex_long": ex_long // K,
        "ex_short": ex_short,
        "ex_imb": float(attn.max() / attn.min()),
    }, res


def sensitivity(lengths, steps: int | None) -> dict:
    """Figure 13's rows under other hardware constants: could one close the CP-only gap?"""
    hw = HardwareProfile()
    variants = (
        [("default H100 profile", {})]
        + [
            (
                f"attention {f * hw.attn_tflops:.0f} TFLOP/s ({f}x)",
                {"attn_tflops": f * hw.attn_tflops},
            )
            for f in (0.7, 1.4, 1.8)
        ]
        + [
            (
                f"GEMM {0.75 * hw.gemm_tflops:.0f} TFLOP/s (0.75x)",
                {"gemm_tflops": 0.75 * hw.gemm_tflops},
            ),
            (
                f"attention half-efficiency at {4 * hw.attn_kv_half:.0f} keys (4x: small chunks slow)",
                {"attn_kv_half": 4 * hw.attn_kv_half},
            ),
            (
                "element-wise traffic 2x",
                {"elementwise_bytes_per_token_dim": 2 * hw.elementwise_bytes_per_token_dim},
            ),
        ]
    )

    def ratios(s: dict) -> tuple[float, float]:  # ln(CP-only gain) / ln(var-len gain)
        return tuple(float(np.log(s[m]) / np.log(s["varlen_packing"])) for m in FIG13_CORE[1:3])

    rows, out = (
        [
            [
                "paper",
                *map(paper_x, PAPER_FIG13.values()),
                *(f"{r:.2f}" for r in ratios(PAPER_FIG13)),
            ]
        ],
        [],
    )
    for label, over in variants:
        res = run_modes(
            lengths, _cfg(*MAIN, steps, lengths, hardware=replace(hw, **over)), FIG13_CORE
        )
        sp = {m: speedup(res["plain_4d"], res[m]) for m in FIG13_CORE[1:]}
        out.append(sp | dict(zip(("ratio_doc", "ratio_ad"), ratios(sp), strict=True)))
        rows.append(
            [
                label,
                *map(x3, sp.values()),
                f"{out[-1]['ratio_doc']:.2f}",
                f"{out[-1]['ratio_ad']:.2f}",
            ]
        )
    return {
        "sens": md_rows(rows),
        "r_doc": out[0]["ratio_doc"],
        "r_ad": out[0]["ratio_ad"],
        "r_lo": min(x["ratio_doc"] for x in out),
        "r_hi": max(x["ratio_doc"] for x in out),
        "cp_lo": min(x["per_doc_cp"] for x in out),
        "vl_lo": min(x["varlen_packing"] for x in out),
        "p_r_doc": ratios(PAPER_FIG13)[0],
        "p_r_ad": ratios(PAPER_FIG13)[1],
        "sens_steps": "whole pass" if steps is None else f"{steps} steps",
    }


def spread(lengths, windows: int, steps: int, whole: dict) -> dict:
    """Figure 12's average and Figure 13's rows on disjoint ``steps``-step windows of the stream
    (long documents are few, so the window moves the speedups), beside the whole pass's."""
    w: dict[str, list[float]] = {"f12_wlb": []} | {m: [] for m in FIG13_CORE[1:]}
    for k in range(windows):
        part = np.roll(lengths, -(k * len(lengths) // windows))
        sp = [
            speedup(
                *run_modes(
                    part, _cfg(pc.model, pc.context_len, pc.layout, steps), ("plain_4d", "wlb")
                ).values()
            )
            for pc in PAPER_TABLE1
        ]
        w["f12_wlb"].append(float(np.mean(sp)))
        res = run_modes(part, _cfg(*MAIN, steps), FIG13_CORE)
        for m in FIG13_CORE[1:]:
            w[m].append(speedup(res["plain_4d"], res[m]))
    rows = [
        (
            f"Figure 12: WLB-LLM vs Plain-4D, average of the {len(PAPER_TABLE1)} configs",
            PAPER_FIG12["avg"],
            "f12_wlb",
        )
    ]
    rows += [(f"Figure 13: {MODES[m].description}", PAPER_FIG13[m], m) for m in FIG13_CORE[1:]]
    inside = {k: sum(abs(x - paper) <= TOL for x in w[k]) for _, paper, k in rows}
    cfg = _cfg(*MAIN, steps)
    return {
        "spread_table": md_rows(
            [
                [
                    label,
                    paper_x(paper),
                    x3(whole[k]),
                    f"{x3(min(w[k]))} - {x3(max(w[k]))}",
                    f"{inside[k]} of {windows}",
                ]
                for label, paper, k in rows
            ]
        ),
        "avg_windows": f"; {windows} disjoint {steps}-step windows give {x3(min(w['f12_wlb']))}-"
        f"{x3(max(w['f12_wlb']))}, {inside['f12_wlb']} of {windows} inside the band",
        "n_windows": windows,
        "window_steps": steps,
        "spread": max(w["f12_wlb"]) - min(w["f12_wlb"]),
        # Documents above half the context that a window reads (N x context tokens per step).
        "long_docs": np.sum(long_documents(lengths, cfg.context_len))
        * steps
        * cfg.n_global
        * cfg.context_len
        / float(np.sum(lengths)),
    }


def fig14(lengths, steps: int | None) -> dict:
    model, _, lay = MAIN
    sp, rows = {}, []
    for ctx in (32 * K, 64 * K, 96 * K, 128 * K, 160 * K):
        res = run_modes(lengths, _cfg(model, ctx, lay, steps, lengths), ("plain_4d", "wlb"))
        sp[ctx] = speedup(res["plain_4d"], res["wlb"])
        rows.append(
            [
                f"{ctx // K}K",
                paper_x(PAPER_FIG14.get(ctx)),
                f"**{x3(sp[ctx])}**",
                f"{res['plain_4d'].imbalance.mean():.2f}",
            ]
        )
    first = min(PAPER_FIG14)
    return {
        "f14_table": md_rows(rows),
        "f14": sp,
        "f14_grows": met(bool(np.all(np.diff(list(sp.values())) > 0))),
        "p14_text": " and ".join(f"{paper_x(s)} at {c // K}K" for c, s in PAPER_FIG14.items()),
        "p14_first_k": first // K,
        "p14_first_cmp": "above" if sp[first] > PAPER_FIG14[first] else "below",
    }


def fig15(lengths, steps: int | None) -> dict:
    """Attention time of one layer (slowest CP rank, summed over micro-batches) per CP strategy."""
    model, ctx, lay = MAIN
    rows, out, gaps = [], {}, []
    for packer_mode in ("plain_4d", "wlb"):
        for cp in (2, 4, 8):
            cfg = _cfg(model, ctx, replace(lay, cp=cp), steps, lengths)
            packed, _ = sim.pack_steps(MODES[packer_mode], lengths, cfg, cfg.steps)
            flat = [mb for s in packed for mb in s]
            per_mb = {
                s: sim.shard_costs(sim.cp_shards(flat, cfg, s), cfg).attn_fwd.max(axis=1)
                for s in ("per_sequence", "per_document", "adaptive")
            }
            t = {s: float(x.sum()) for s, x in per_mb.items()}
            t["oracle"] = float(np.minimum(per_mb["per_sequence"], per_mb["per_document"]).sum())
            out[(packer_mode, cp)] = [
                1 - t["adaptive"] / t[s] for s in ("per_sequence", "per_document")
            ]
            gaps.append(100 * (t["adaptive"] / t["oracle"] - 1))
            rows.append(
                [
                    MODES[packer_mode].packer,
                    cp,
                    *(f"{1e3 * x / len(flat):.2f} ms" for x in t.values()),
                    *(f"{100 * a:+.1f} %" for a in out[(packer_mode, cp)]),
                ]
            )
    seq, doc = out[("wlb", PAPER_FIG15["cp"])]
    return {"f15_table": md_rows(rows), "seq": 100 * seq, "doc": 100 * doc, "oracle_gap": max(gaps)}


def scale(lengths, steps: int) -> dict:
    """The 8,192-GPU configuration, its run time, and speedup vs DP and CP degree."""
    model, ctx, lay = SCALE
    t0 = time.perf_counter()
    run_modes(lengths, _cfg(model, ctx, lay, SCALE_TIMED_STEPS), THREE)
    secs = time.perf_counter() - t0
    dps, cps = (1, 2, 4, 8), (4, 8, lay.cp)
    sweep, rows = {}, []
    for sub in [replace(lay, dp=d) for d in dps] + [replace(lay, cp=c) for c in cps[:-1]]:
        t0 = time.perf_counter()
        res = run_modes(lengths, _cfg(model, ctx, sub, steps), THREE)
        sweep[sub] = (speedup(res["plain_4d"], res["wlb"]), speedup(res["fixed_4d"], res["wlb"]))
        rows.append(
            [
                model,
                sub.as_tuple(),
                sub.world_size,
                f"**{x3(sweep[sub][0])}**",
                x3(sweep[sub][1]),
                f"{res['plain_4d'].imbalance.mean():.2f}",
                f"{time.perf_counter() - t0:.1f} s ({len(THREE)} modes, {steps} steps)",
            ]
        )
    dp_sp = [sweep[replace(lay, dp=d)][0] for d in dps]
    cp_sp = [sweep[replace(lay, cp=c)][0] for c in cps]
    return {
        "scale_table": md_rows(rows),
        "secs": secs,
        "sp": sweep[lay][0],
        "scale_steps": steps,
        "scale": SCALE,
        "scale_timed": SCALE_TIMED_STEPS,
        "scale_target": SCALE_TARGET_S,
        "scale_gpus_k": lay.world_size // K,
        "scale_ctx_k": ctx // K,
        "dp_degrees": ", ".join(map(str, dps)),
        "cp_degrees": ", ".join(map(str, cps)),
        "dp_trend": _trend(dp_sp),
        "cp_trend": _trend(cp_sp),
        "dp": " / ".join(map(x3, dp_sp)),
        "cp": " / ".join(map(x3, cp_sp)),
        "vs_fixed": " / ".join(x3(sweep[replace(lay, dp=d)][1]) for d in dps),
    }


def _trend(values: list[float]) -> str:
    """'increases' / 'decreases' / 'stays within ...' for a short series, read off the numbers."""
    d = np.diff(values)
    if np.all(d > 0):
        return "increases"
    if np.all(d < 0):
        return "decreases"
    return f"stays within {x3(min(values))}-{x3(max(values))}"


def figures(fig_dir: Path, bars: dict, f13: dict[str, ModeResult], f14: dict[int, float]) -> dict:
    from torchtitan_wlb.sim import plots

    fig_dir.mkdir(parents=True, exist_ok=True)
    ours13 = {n: {"ours": speedup(f13["plain_4d"], f13[n])} for n in PAPER_FIG13}
    heat = [f13[n] for n in ("plain_4d", "per_doc_cp", "varlen_packing", "wlb")]
    return {
        "fig12": plots.speedup_bars(
            bars,
            fig_dir / "fig12_speedup.png",
            title="Figure 12: speedup over Plain-4D (Table 1 configs)",
        ),
        "fig13": plots.speedup_bars(
            ours13,
            fig_dir / "fig13_breakdown.png",
            paper={n: {"ours": v} for n, v in PAPER_FIG13.items()},
            title="Figure 13: 7B / 128K breakdown (black: paper)",
        ),
        "fig14": plots.speedup_bars(
            {f"{c // K}K": {"wlb": v} for c, v in f14.items()},
            fig_dir / "fig14_context.png",
            paper={f"{c // K}K": {"wlb": v} for c, v in PAPER_FIG14.items()},
            title="Figure 14: 7B, WLB-LLM vs Plain-4D by context (black: paper)",
        ),
        "heat": plots.latency_heatmap(heat, fig_dir / "heatmap_7b_128k.png"),
        "gantt": plots.gantt([f13[n] for n in THREE], fig_dir / "gantt_7b_128k.png"),
    }


def fixed_values(lengths: np.ndarray, cfg: SimConfig) -> dict:
    """The workload's statistics, ``cfg``'s hardware and profiled cost model, the paper's values."""
    hw, cm, lay, p15 = cfg.hardware, sim.cost_model_for(cfg), cfg.layout, PAPER_FIG15
    long = cfg.context_len // 2
    return {
        "main": cfg,
        "hw": hw,
        "cm": cm,
        "p12": PAPER_FIG12,
        "p13": PAPER_FIG13,
        "p15": p15,
        "tol": TOL,
        "tile": ATTENTION_TILE,
        "n_docs": int(lengths.size),
        "long_k": long // K,
        "long_share": 100.0 * long_token_share(lengths, cfg.context_len),
        "hw_name": hw.name.upper(),
        "gemm_share": 100 * hw.gemm_tflops / H100_BF16_PEAK_TFLOPS,
        "peak": H100_BF16_PEAK_TFLOPS,
        "fsdp_exposed": 100 * (1 - hw.dp_overlap),
        "prof_min": int(sim.profiling_micro_batches(cfg.context_len, lay.cp)[0][0]),
        "be": cm.break_even_length / K,
        "ctx13": cfg.context_len // K,
        "main_short": f"{cfg.model.name} / {cfg.context_len // K}K",
        "below_tile": 2 * lay.cp * ATTENTION_TILE,
        "p_t2_orig": PAPER_T2_ORIGINAL,
        "p13_cp_gain": PAPER_FIG13["wlb"] / PAPER_FIG13["varlen_packing"],
        "p15_seq": 100 * p15["adaptive_vs_per_sequence"],
        "p15_doc": 100 * p15["adaptive_vs_per_document"],
    }


def render(values: dict, skip: Iterable[str] = ()) -> str:
    text = Path(__file__).with_name("reproduction_template.md").read_text()
    parts = re.split(r"^<!-- section: (\w+) -->\n", text, flags=re.M)[1:]
    return "".join(
        body.format_map(values)
        for name, body in zip(parts[::2], parts[1::2], strict=True)
        if name not in skip
    )


# fmt: off
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchtitan_wlb.sim.reproduce")
    p.add_argument("--workload", required=True, help="document lengths (as wlb-sim --lengths)")
    p.add_argument("--out", default="docs/reproduction.md")
    p.add_argument("--figures", default="docs/figures/sim")
    p.add_argument("--steps", type=steps_arg, default="epoch",
                   help="timed steps per configuration, or 'epoch' (default): one pass over the workload")
    p.add_argument("--windows", type=int, default=5,
                   help="disjoint windows of --window-steps steps for the spread section (0: skip)")
    p.add_argument("--window-steps", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="fewer steps, short Table 2")
    p.add_argument("--skip-table2", action="store_true")
    p.add_argument("--cp-profile", default=None, metavar="FILE",
                   help="measured attention table (tools.cp_profile) instead of the kernel model")
    return p


def main(argv: list[str] | None = None) -> int:
    global CP_PROFILE
    parser = build_parser()
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    CP_PROFILE = args.cp_profile
    steps = 8 if args.quick else (None if args.steps == "epoch" else args.steps)
    try:
        if args.windows < 0 or args.window_steps < 1:
            raise ValueError(f"--windows {args.windows} must be >= 0 and --window-steps "
                             f"{args.window_steps} >= 1")
        lengths = load_lengths(args.workload)
        v = fixed_values(lengths, _cfg(*MAIN, 8))
        v |= attention_source(v["hw_name"])
        if not args.skip_table2:
            v |= table2(args.workload, args.quick, _cfg(*MAIN, 8))
        v |= fig12(lengths, steps)
        f13, res13 = fig13(lengths, steps)
        v |= f13 | sensitivity(lengths, steps)
        miss = abs(v["f12_wlb"] - PAPER_FIG12["avg"]) - TOL
        v["avg_ok"] = met(miss <= 0, f"**missed** by {miss:.3f}")
        if args.windows:
            v |= spread(lengths, args.windows, 8 if args.quick else args.window_steps, v)
            v["avg_ok"] += v["avg_windows"]
        v |= fig14(lengths, steps) | fig15(lengths, steps)
        v |= scale(lengths, 50 if steps is None else min(steps, 50))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    figs = figures(Path(args.figures), v["bars"], res13, v["f14"])
    v |= {k: f.relative_to(out.parent) if f.is_relative_to(out.parent) else f for k, f in figs.items()}
    verdict = {ok: [f"{MODES[n].description} {x3(v[n])} (paper {paper_x(p)})"
                    for n, p in PAPER_FIG13.items() if (abs(v[n] - p) <= TOL) == ok] for ok in (1, 0)}
    v["verdict"] = ("met: " + "; ".join(verdict[1]) + "." if verdict[1] else "none met.") + (
        " **Missed: " + "; ".join(verdict[0]) + ".**" if verdict[0] else "")
    v["cmd"] = " ".join([f".venv/bin/python -m torchtitan_wlb.sim.reproduce --workload {args.workload} --out "
                         f"{args.out} --figures {args.figures}", *["--quick"] * args.quick] + [
        f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("steps", "windows", "window_steps", "cp_profile")
        if getattr(args, k) != parser.get_default(k)])
    n13 = res13["plain_4d"].step_time_s.size
    v["steps_text"] = (
        f"{n13} timed steps per configuration after {WARMUP} warm-up steps" if steps is not None
        else f"One pass over the workload per configuration (timed steps = its tokens / (PP x DP x "
        f"context) - {WARMUP} warm-up steps: {n13} for {v['main_short']})")
    v["workload"], v["seconds"] = Path(args.workload).name, time.perf_counter() - t_start
    skip = ({"t2"} if args.skip_table2 else set()) | (set() if args.windows else {"spread"})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(v, skip))
    print(f"wrote {out} and {len(figs)} figures in {v['seconds']:.0f} s")
    return 0
# fmt: on

if __name__ == "__main__":
    sys.exit(main())
