"""Achieved attention throughput by (q_len, kv_len): the table adaptive CP selection looks up.

Measured, because a kernel runs small query chunks far below its peak (a 128-row tile holding 20
queries is mostly padding) by an amount kernel and hardware decide (docs/context_parallel.md).
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from torchtitan_wlb.cp.plan import causal_pairs

if TYPE_CHECKING:
    from torchtitan_wlb.cp.plan import CPPlan

# Forward (QK^T and PV: 2 matmuls x 2 FLOPs per multiply-add) plus backward (2.5x forward: five
# matmuls), per (query, key) pair, per head, per head-dim element.
FLOPS_PER_PAIR_PER_HEAD_DIM = 4.0 * 3.5
MAX_LUT_LENGTH = 1 << 20  # grids up to this length use a direct lookup table (<= 8 MB)
_SCALAR_FIELDS = {
    "tile": int,
    "device": str,
    "backend": str,
    "n_heads": int,
    "n_kv_heads": int,
    "head_dim": int,
    "dtype": str,
}


def attention_flops(q_len, kv_len, n_heads: int, head_dim: int) -> np.ndarray:
    """Forward + backward FLOPs of bottom-right causal segments (vectorised)."""
    return FLOPS_PER_PAIR_PER_HEAD_DIM * n_heads * head_dim * causal_pairs(q_len, kv_len)


@dataclass(frozen=True)
class CPProfile:
    """A measured throughput table and the configuration it was measured with."""

    lengths: tuple[int, ...]  # sorted grid of segment lengths, for both q_len and kv_len
    # [len(lengths)]^2 achieved TFLOP/s (padded FLOPs / time); NaN where q_len > kv_len (a
    # causal-prefix segment never has more queries than keys)
    tflops: tuple[tuple[float, ...], ...]
    tile: int  # kernel tile the FLOP count pads every length up to (128 for the CUDA kernels)
    device: str  # where it was measured, e.g. "cpu" or the CUDA device name
    backend: str  # attention backend measured ("cpu" | "flash" | "torch_varlen")
    n_heads: int  # attention configuration of the measurement: query heads,
    n_kv_heads: int  # KV heads,
    head_dim: int  # head size
    dtype: str  # and torch dtype name

    def __post_init__(self) -> None:
        grid = np.asarray(self.lengths)
        if grid.ndim != 1 or grid.size == 0 or np.any(np.diff(grid) <= 0) or grid[0] < 1:
            raise ValueError(
                f"profile lengths must be strictly increasing and >= 1: {self.lengths}"
            )
        table = self.table
        if table.shape != (grid.size, grid.size):
            raise ValueError(
                f"profile tflops must be {grid.size}x{grid.size} for lengths {self.lengths}; "
                f"got shape {table.shape}"
            )
        need = np.triu(np.ones_like(table, dtype=bool))  # q_len <= kv_len
        missing = need & ~(np.isfinite(table) & (table > 0))
        if missing.any():
            pairs = [(int(grid[i]), int(grid[j])) for i, j in np.argwhere(missing)]
            raise ValueError(
                f"profile table has missing or non-positive entries for (q_len, kv_len) = "
                f"{pairs[:8]}{' ...' if len(pairs) > 8 else ''}; re-measure with "
                "python -m torchtitan_wlb.tools.cp_profile"
            )
        if self.tile < 1:
            raise ValueError(f"profile tile must be >= 1; got {self.tile}")

    @functools.cached_property
    def table(self) -> np.ndarray:
        """``tflops`` as a read-only float64 array (cached: the profile is immutable)."""
        table = np.asarray(self.tflops, dtype=np.float64)
        table.flags.writeable = False
        return table

    @functools.cached_property
    def _grid_lut(self) -> np.ndarray:
        """``lut[x]`` = index of the largest grid length <= x (0 below the grid), for
        ``0 <= x <= lengths[-1]``: one gather per lookup instead of a binary search."""
        grid = np.asarray(self.lengths)
        lut = np.maximum(np.searchsorted(grid, np.arange(grid[-1] + 1), side="right") - 1, 0)
        lut = lut.astype(np.int64)
        lut.flags.writeable = False
        return lut

    def lookup_tflops(self, q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
        """Achieved TFLOP/s for each (q_len, kv_len); largest grid point <= length, clamped."""
        if self.lengths[-1] > MAX_LUT_LENGTH:  # very long grids: binary search, no big table
            grid = np.asarray(self.lengths)
            qi = np.clip(np.searchsorted(grid, q_len, side="right") - 1, 0, grid.size - 1)
            ki = np.clip(np.searchsorted(grid, kv_len, side="right") - 1, 0, grid.size - 1)
            return self.table[qi, np.maximum(ki, qi)]
        lut = self._grid_lut
        top = len(lut) - 1
        qi = lut[np.clip(q_len, 0, top)]
        ki = np.maximum(lut[np.clip(kv_len, 0, top)], qi)
        return self.table.ravel()[qi * len(self.lengths) + ki]

    def segment_seconds(self, q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
        """Estimated forward + backward time of each segment: padded FLOPs / achieved throughput.
        Segments with no queries cost nothing."""
        q = np.asarray(q_len, dtype=np.float64)
        tile = float(self.tile)
        pq = np.ceil(q * (1.0 / tile)) * tile
        pk = np.maximum(np.ceil(np.asarray(kv_len, dtype=np.float64) * (1.0 / tile)) * tile, pq)
        scale = FLOPS_PER_PAIR_PER_HEAD_DIM * self.n_heads * self.head_dim / 1e12
        # padded causal pairs pq*pk - pq*(pq-1)/2
        seconds = (pk - 0.5 * (pq - 1.0)) * pq * scale / self.lookup_tflops(q_len, kv_len)
        seconds[q == 0] = 0.0
        return seconds

    def estimate_plan_seconds(self, plan: CPPlan) -> float:
        """Estimated attention time of the slowest rank under ``plan``."""
        seconds = self.segment_seconds(plan.seg_len, plan.seg_start + plan.seg_len)
        return float(plan.rank_totals(seconds).max())

    def to_json(self) -> str:
        data = asdict(self)
        data["tflops"] = [[None if not np.isfinite(x) else x for x in row] for row in self.tflops]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CPProfile:
        data = json.loads(text)
        if missing := sorted({"lengths", "tflops", *_SCALAR_FIELDS} - set(data)):
            raise ValueError(f"profile JSON lacks the fields {missing}")
        return cls(
            lengths=tuple(int(x) for x in data["lengths"]),
            tflops=tuple(
                tuple(float("nan") if x is None else float(x) for x in row)
                for row in data["tflops"]
            ),
            **{name: cast(data[name]) for name, cast in _SCALAR_FIELDS.items()},
        )

    @classmethod
    def load(cls, path: str | Path) -> CPProfile:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"CP profile file {str(path)!r} does not exist")
        return cls.from_json(path.read_text())


@functools.cache
def default_profile() -> CPProfile:
    """The packaged CPU table (measured on a 2-core x86 CPU; see docs/context_parallel.md)."""
    text = resources.files("torchtitan_wlb.cp").joinpath("profiles/cpu_default.json").read_text()
    return CPProfile.from_json(text)


def gpu_family(device_name: str) -> str | None:
    """The accelerator family in a device name ("NVIDIA H100 80GB HBM3" -> "H100"): a letter and
    two or three digits standing alone; None when the name holds none (e.g. "cpu")."""
    match = re.search(r"\b([A-Z]\d{2,3})\b", device_name.upper())
    return match[1] if match else None


def packaged_profiles() -> list[CPProfile]:
    """Every profile shipped in ``cp/profiles/`` (the CPU default and the measured GPU tables)."""
    folder = resources.files("torchtitan_wlb.cp").joinpath("profiles")
    files = sorted(f for f in folder.iterdir() if f.name.endswith(".json"))
    return [CPProfile.from_json(f.read_text()) for f in files]


def packaged_profile_for(device_name: str) -> CPProfile | None:
    """The shipped profile measured on this accelerator: the same device name, else the same
    family (an H100 PCIe takes an H100 SXM table before the CPU one); None when none was shipped,
    so that the caller can say the CPU table is in use. Adding a measured ``cp/profiles/*.json``
    is all it takes for a new GPU to get its own table."""
    shipped = [p for p in packaged_profiles() if p.device != "cpu"]
    exact = [p for p in shipped if p.device.strip().lower() == device_name.strip().lower()]
    family = gpu_family(device_name)
    same_family = [p for p in shipped if family is not None and gpu_family(p.device) == family]
    return (exact or same_family or [None])[0]


def resolve_profile(profile: CPProfile | str | Path | None) -> CPProfile:
    """A profile object from an object, a JSON path, or ``None``/``""`` (packaged CPU default)."""
    if profile is None or profile == "":
        return default_profile()
    if isinstance(profile, CPProfile):
        return profile
    if isinstance(profile, str | Path):
        return CPProfile.load(profile)
    raise ValueError(f"profile must be a CPProfile, a JSON path or None; got {type(profile)}")


def measure_profile(
    lengths: list[int],
    *,
    device: str = "cpu",
    backend: str = "auto",
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: str = "float32",
    tile: int | None = None,
    pairs_per_cell: int = 1 << 19,
    max_tokens: int | None = None,
    repeats: int = 3,
    log=None,
) -> CPProfile:
    """Time forward + backward of ``document_attention`` for every (q_len <= kv_len) grid cell on
    about ``pairs_per_cell`` (query, key) pairs of identical segments (as small chunks arrive),
    with at most ``max_tokens`` keys per cell (None: no cap). The cap is what keeps a GPU table
    in memory: 2**30 pairs of 64-token segments are 33M tokens, 270 GB of bf16 q at 32 x 128."""
    import torch

    from torchtitan_wlb.attention import resolve_backend

    dev = torch.device(device)
    chosen = resolve_backend(backend, dev)
    if tile is None:
        tile = 128 if dev.type == "cuda" else 16
    torch_dtype = getattr(torch, dtype)
    grid = sorted(int(x) for x in lengths)
    n = len(grid)
    table = np.full((n, n), np.nan)
    for i, q_len in enumerate(grid):
        for j in range(i, n):
            kv_len = grid[j]
            m = max(1, pairs_per_cell // int(causal_pairs(q_len, kv_len)))
            if max_tokens is not None:
                m = max(1, min(m, max_tokens // kv_len))
            like = {"device": dev, "dtype": torch_dtype, "requires_grad": True}
            q = torch.randn(m * q_len, n_heads, head_dim, **like)
            k = torch.randn(m * kv_len, n_kv_heads, head_dim, **like)
            v = torch.randn_like(k, requires_grad=True)
            cu_q = torch.arange(m + 1, dtype=torch.int32, device=dev) * q_len
            cu_k = torch.arange(m + 1, dtype=torch.int32, device=dev) * kv_len
            args = (q, k, v, cu_q, cu_k, q_len, kv_len)
            seconds = _median_seconds(args, torch.randn_like(q), chosen, dev, repeats)
            pq = -(-q_len // tile) * tile
            pk = max(-(-kv_len // tile) * tile, pq)
            flops = m * float(attention_flops(pq, pk, n_heads, head_dim))
            table[i, j] = flops / seconds / 1e12
            if log is not None:
                log(f"q_len={q_len} kv_len={kv_len} segments={m} {table[i, j]:.4f} TFLOP/s")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rows = tuple(tuple(float(x) for x in row) for row in table)
    return CPProfile(tuple(grid), rows, tile, name, chosen, n_heads, n_kv_heads, head_dim, dtype)


def _median_seconds(args: tuple, grad, backend: str, dev, repeats: int) -> float:
    """Median seconds of ``document_attention(*args)`` forward + backward after one warm-up; on
    CPU this process's CPU time, so that other jobs on a shared machine do not inflate it."""
    import torch

    from torchtitan_wlb.attention import document_attention

    cuda = dev.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    times = []
    for _ in range(repeats + 1):  # the first run warms up (kernel selection, allocator)
        sync()
        start = clock()
        document_attention(*args, backend=backend).backward(grad)
        sync()
        times.append(clock() - start)
    return float(np.median(times[1:]))
