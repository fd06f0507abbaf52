"""Measure the (q_len, kv_len) attention throughput table used by adaptive CP selection.

    python -m torchtitan_wlb.tools.cp_profile --device cuda --out cuda_h100.json   # gpu
    python -m torchtitan_wlb.tools.cp_profile --device cpu --out cpu_profile.json
    python -m torchtitan_wlb.tools.cp_profile --device cpu --lengths 16,32,64 --out small.json

Use your model's attention shape and point ``[wlb] cp_profile`` at the output file; the shipped
CPU table and its command: docs/context_parallel.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchtitan_wlb.cp.profile import measure_profile
from torchtitan_wlb.tools.cli import ToolParser

DEFAULT_CPU_LENGTHS = "16,32,64,128,256,512,1024,2048,4096"
DEFAULT_CUDA_LENGTHS = "64,128,256,512,1024,2048,4096,8192,16384,32768,65536,131072"


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.cp_profile", __doc__)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--backend", default="auto", help="auto | cpu | flash | torch_varlen")
    p.add_argument("--lengths", default=None, help="comma-separated grid (default by device)")
    p.add_argument("--heads", type=int, default=None, help="query heads (cpu 4, cuda 32)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (cpu 2, cuda 8)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (cpu 32, cuda 128)")
    p.add_argument("--dtype", default=None, help="float32 (cpu) / bfloat16 (cuda)")
    p.add_argument("--tile", type=int, default=None, help="FLOP padding tile (cpu 16, cuda 128)")
    p.add_argument("--pairs-per-cell", type=int, default=None, help="(q, k) pairs per grid cell")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="keys per cell at most (cuda 2**18, cpu none)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True, help="output JSON path")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    lengths = args.lengths or (DEFAULT_CUDA_LENGTHS if cuda else DEFAULT_CPU_LENGTHS)
    try:
        grid = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lengths must be comma-separated integers; got {lengths!r}")
    if not grid or min(grid) < 1:
        p.error(f"--lengths must be positive integers; got {lengths!r}")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1; got {args.max_tokens}")

    import torch

    if cuda and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device")
    threads = torch.get_num_threads()
    if not cuda:
        # One thread: the CPU table is timed in process CPU time, like cp_bench --measure.
        torch.set_num_threads(1)
    try:
        profile = measure_profile(
            grid,
            device=args.device,
            backend=args.backend,
            n_heads=args.heads or (32 if cuda else 4),
            n_kv_heads=args.kv_heads or (8 if cuda else 2),
            head_dim=args.head_dim or (128 if cuda else 32),
            dtype=args.dtype or ("bfloat16" if cuda else "float32"),
            tile=args.tile,
            pairs_per_cell=args.pairs_per_cell or ((1 << 30) if cuda else (1 << 19)),
            max_tokens=args.max_tokens or ((1 << 18) if cuda else None),
            repeats=args.repeats,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
        Path(args.out).write_text(profile.to_json() + "\n")
    except (ValueError, RuntimeError, OSError) as exc:  # e.g. no such device or backend
        p.error(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    finally:
        torch.set_num_threads(threads)
    print(f"wrote {args.out}: {len(grid)}x{len(grid)} grid, backend {profile.backend}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
