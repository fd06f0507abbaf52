"""Measure micro-batch and step times of the ``llama3_wlb`` model on this CPU, as a calibration file
for ``sim.calibrate`` (docs/simulator.md#standalone-cpu-measurements)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def micro_batches(seq_len: int, n: int, seed: int) -> list[np.ndarray]:
    """n micro-batches of at most ``seq_len`` tokens: packer outputs and equal-length packs."""
    from torchtitan_wlb.models.catalogue import get_model
    from torchtitan_wlb.sim.config import MODES, SimConfig
    from torchtitan_wlb.sim.engine import pack_steps
    from torchtitan_wlb.sim.hardware import Layout
    from torchtitan_wlb.workloads import generate

    cfg = SimConfig(model=get_model("debugmodel"), layout=Layout(), context_len=seq_len, schedule="1f1b",
                    micro_batches=4, warmup_steps=0, cost_model="analytic")  # fmt: skip
    lengths = generate("longtail", 20_000, seq_len, seed=seed)
    packed = []
    for mode in ("plain_4d", "wlb"):
        steps, _ = pack_steps(MODES[mode], lengths, cfg, max(1, n // 8))
        packed += [mb for s in steps for mb in s if mb.size]
    rng = np.random.default_rng(seed)
    lens = np.unique(np.geomspace(64, seq_len, max(2, n // 2)).astype(np.int64))
    # Each equal-length pack fills 60-100 % of the sequence.
    equal = [np.full(max(1, int(seq_len * rng.uniform(0.6, 1.0)) // int(d)), d) for d in lens]
    out = packed[: n - len(equal)] + equal
    return [out[i] for i in rng.permutation(len(out))]


def run(a: argparse.Namespace) -> dict:
    """The calibration file: standalone micro-batches, then steps of ``a.grad_accum`` micro-batches
    and the optimizer update. Each time is the minimum of ``a.repeats`` runs: on a shared machine
    other processes only ever add time."""
    import dataclasses

    import torch

    from torchtitan_wlb import cpu_support

    cpu_support.activate()  # before torchtitan is imported (below)
    from torchtitan_wlb.attention.metadata import metadata_from_doc_lens
    from torchtitan_wlb.data.collate import document_positions
    from torchtitan_wlb.models.llama3_wlb import WLBTransformer, llama3_wlb_args

    if a.flavor not in llama3_wlb_args:
        raise ValueError(f"unknown flavor {a.flavor!r}; accepted: {', '.join(llama3_wlb_args)}")
    args = dataclasses.replace(llama3_wlb_args[a.flavor], max_seq_len=int(a.seq_len * 1.25))
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = WLBTransformer(args)
    with torch.no_grad():
        model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(a.seed)

    def fwd_bwd(lens: np.ndarray) -> float:
        tokens = torch.from_numpy(rng.integers(0, args.vocab_size, size=(1, int(lens.sum()) + 1)))
        pos = torch.from_numpy(document_positions(lens)).view(1, -1)
        meta = metadata_from_doc_lens(lens, backend="cpu")
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1], attention_masks=meta, positions=pos)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[0, 1:])
        loss.backward()
        return time.perf_counter() - t0

    n_mb, accum = a.micro_batches, a.grad_accum
    mbs = micro_batches(a.seq_len, n_mb + a.steps * accum, a.seed)
    fwd_bwd(mbs[0])  # warm-up
    records, steps = [], []
    for lens in mbs[:n_mb]:
        best = min(fwd_bwd(lens) for _ in range(a.repeats))
        records.append({"doc_lens": lens.tolist(), "seconds": best, "step": -1})
        opt.zero_grad(set_to_none=True)
    for s in range(a.steps):
        group = mbs[n_mb + s * accum : n_mb + (s + 1) * accum]
        best_step, best_mb = float("inf"), [float("inf")] * len(group)
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            times = [fwd_bwd(lens) for lens in group]
            opt.step()
            opt.zero_grad(set_to_none=True)
            best_step = min(best_step, time.perf_counter() - t0)
            best_mb = [min(x, y) for x, y in zip(best_mb, times, strict=True)]
        records += [{"doc_lens": lens.tolist(), "seconds": t, "step": s}
                    for lens, t in zip(group, best_mb, strict=True)]  # fmt: skip
        steps.append({"step": s, "seconds": best_step})
    return {"microbatches": records, "steps": steps, "flavor": a.flavor, "seq_len": a.seq_len,
            "threads": a.threads, "layout": {"tp": 1, "cp": 1, "pp": 1, "dp": 1}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtitan_wlb.sim.measure_cpu")
    p.add_argument("--out", required=True)
    p.add_argument("--flavor", default="debugmodel", help="llama3_wlb flavor (debugmodel, tiny)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batches", type=int, default=24, help="standalone micro-batches")
    p.add_argument("--steps", type=int, default=8, help="measured steps")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (minimum kept)")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        data = run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data))
    n_mb, n_steps = len(data["microbatches"]), len(data["steps"])
    print(f"wrote {args.out}: {n_mb} micro-batch records, {n_steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
