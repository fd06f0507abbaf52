"""Workload model of a packed document, W(d) = W_a(d) + W_l(d) (docs/packing.md): the one measure
the packers, the CP planner and the simulator balance by."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Backward is two forward-sized matmuls per matmul (input and weight; dQ, dK/dV): 3 x forward.
_FWD_BWD_FACTOR = 3.0


@dataclass(frozen=True)
class CostModel:
    """``W(d) = attn_coef * d**2 + linear_coef * d`` per document; a micro-batch costs the sum
    over its documents (document masking: no cross-document work). Under CP, the online fit can
    price the tokens of documents the plan all-gathers apart (``gathered_coef``)."""

    attn_coef: float
    """Cost of causal attention per squared token (``W_a(d) = attn_coef * d**2``); >= 0."""
    linear_coef: float
    """Cost of everything else per token (``W_l(d) = linear_coef * d``); >= 0."""
    unit: str = "flops"
    """Unit of the costs: ``"flops"`` (analytic) or ``"seconds"`` (measured / given)."""
    gathered_coef: float | None = None
    """Under CP, the cost per token of a document whose K/V the CP plan all-gathers (one longer
    than ``whole_max_len``), as the online fit measures it; None: ``linear_coef`` for all tokens."""
    whole_max_len: int = 0
    """Under CP with ``gathered_coef``: documents up to this length stay whole on one rank (hybrid
    sharding keeps them local) and pay ``linear_coef`` per token; 0: every document is gathered."""

    def __post_init__(self) -> None:
        for name in ("attn_coef", "linear_coef", "gathered_coef"):
            value = getattr(self, name)
            if value is None and name == "gathered_coef":
                continue
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {value!r}")
        if self.attn_coef == 0 and self.linear_coef == 0:
            raise ValueError("CostModel needs attn_coef > 0 or linear_coef > 0, got both 0")
        if self.unit not in ("flops", "seconds"):
            raise ValueError(f"CostModel.unit must be 'flops' or 'seconds', got {self.unit!r}")
        whole = self.whole_max_len
        if isinstance(whole, bool) or not isinstance(whole, int) or whole < 0:
            raise ValueError(
                f"CostModel.whole_max_len must be an int >= 0, got {self.whole_max_len!r}"
            )

    def _per_token(self, d: np.ndarray) -> np.ndarray | float:
        """Linear cost per token of each document: ``gathered_coef`` above ``whole_max_len``."""
        if self.gathered_coef is None:
            return self.linear_coef
        return np.where(d > self.whole_max_len, self.gathered_coef, self.linear_coef)

    def attention_cost(self, lengths: np.ndarray) -> np.ndarray:
        """``W_a(d)`` for every length in ``lengths`` (float64 array of the same shape)."""
        d = np.asarray(lengths, dtype=np.float64)
        return self.attn_coef * d * d

    def linear_cost(self, lengths: np.ndarray) -> np.ndarray:
        """``W_l(d)`` for every length in ``lengths``."""
        d = np.asarray(lengths, dtype=np.float64)
        return self._per_token(d) * d

    def doc_cost(self, lengths: np.ndarray) -> np.ndarray:
        """``W(d) = W_a(d) + W_l(d)`` for every length in ``lengths``."""
        d = np.asarray(lengths, dtype=np.float64)
        return d * (self.attn_coef * d + self._per_token(d))

    def microbatch_cost(self, doc_lens: np.ndarray) -> float:
        """Cost of one packed micro-batch: the sum of its documents' costs."""
        return float(self.doc_cost(doc_lens).sum())

    @property
    def break_even_length(self) -> float:
        """Length ``d`` at which ``W_a(d) == W_l(d)`` (``inf`` without attention cost)."""
        return self.linear_coef / self.attn_coef if self.attn_coef else math.inf

    @classmethod
    def from_coefficients(
        cls, attn_coef: float, linear_coef: float, unit: str = "seconds"
    ) -> CostModel:
        """A model with given coefficients (e.g. from TOML or fitted offline)."""
        return cls(attn_coef=float(attn_coef), linear_coef=float(linear_coef), unit=unit)

    @classmethod
    def from_model_dims(
        cls,
        *,
        dim: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None,
        ffn_hidden_dim: int,
        vocab_size: int,
        tp: int = 1,
        cp: int = 1,
    ) -> CostModel:
        """Analytic training FLOPs (forward + backward) per GPU of a Llama-style decoder (the
        formula: docs/packing.md); norms, RoPE and element-wise ops are ignored (well under 1 %)."""
        sizes = dict(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_hidden_dim=ffn_hidden_dim)
        for name, value in {**sizes, "vocab_size": vocab_size, "tp": tp, "cp": cp}.items():
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"from_model_dims: {name} must be an integer >= 1, got {value!r}")
        n_kv = n_heads if n_kv_heads is None else n_kv_heads
        if not isinstance(n_kv, (int, np.integer)) or n_kv < 1 or n_heads % n_kv != 0:
            raise ValueError(
                f"from_model_dims: n_kv_heads must be >= 1 and divide n_heads={n_heads}, got {n_kv!r}"
            )
        if dim % n_heads != 0:
            raise ValueError(f"from_model_dims: dim={dim} must be divisible by n_heads={n_heads}")
        if n_heads % tp != 0:
            raise ValueError(f"from_model_dims: tp={tp} must divide n_heads={n_heads}")
        head_dim = dim // n_heads
        kv_dim = n_kv * head_dim
        kv_shards = min(tp, n_kv)  # K/V heads beyond the TP degree are replicated, not split
        per_layer = (
            2 * 2 * dim * dim / tp  # wq, wo
            + 2 * 2 * dim * kv_dim / kv_shards  # wk, wv
            + 3 * 2 * dim * ffn_hidden_dim / tp  # w1, w2, w3
            + 2 * dim / tp  # attention diagonal (the "+ d" of d * (d + 1))
        )
        linear_fwd = n_layers * per_layer + 2 * dim * vocab_size / tp
        attn_fwd = n_layers * 2 * dim / tp
        return cls(_FWD_BWD_FACTOR * attn_fwd / cp, _FWD_BWD_FACTOR * linear_fwd / cp, "flops")


def read_profile(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A measured cost profile's ``(lengths, seconds)`` (its JSON layouts: docs/packing.md): at
    least two distinct lengths, every length and time > 0. ``cost_fit.profile_cost_model`` fits
    ``W(d)`` to them with the cost model's one fit."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read cost profile {str(path)!r}: {exc}") from exc
    points = raw.get("points") if isinstance(raw, dict) else raw
    if not isinstance(points, list) or not points:
        raise ValueError(
            f"cost profile {str(path)!r} must be a non-empty list of [length, seconds] pairs "
            "or {'points': [...]}"
        )
    rows = []
    for i, p in enumerate(points):
        if isinstance(p, dict):
            if "length" not in p or "seconds" not in p:
                raise ValueError(f"cost profile point {i} needs 'length' and 'seconds': {p!r}")
            d, t = p["length"], p["seconds"]
        elif isinstance(p, (list, tuple)) and len(p) == 2:
            d, t = p
        else:
            raise ValueError(f"cost profile point {i} must be [length, seconds], got {p!r}")
        if not all(isinstance(v, (int, float)) for v in (d, t)) or d <= 0 or not t > 0:
            raise ValueError(f"cost profile point {i}: length and seconds must be > 0, got {p!r}")
        rows.append((float(d), float(t)))
    d, t = np.asarray(rows).T
    if np.unique(d).size < 2:
        raise ValueError(f"cost profile {str(path)!r} needs >= 2 distinct lengths")
    return d, t


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: the best over all active sets (exact); the
    solver of the cost model's one fit, ``cost_fit.fit_nnls``."""
    n_col = x.shape[1]
    best, best_err = np.zeros(n_col), float(np.sum(y * y))
    for k in range(1, n_col + 1):
        for cols in itertools.combinations(range(n_col), k):
            sub = x[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err:
                best = np.zeros(n_col)
                best[list(cols)] = coef
                best_err = err
    return best
