"""Vectorised document-masked causal attention for CPU (and any device without a varlen kernel).

Segments are grouped by their (query, key) lengths rounded up to a geometric grid, one masked SDPA
per group: a loop over documents would cost a kernel chain each, padding to the longest
``segments * max_len**2`` (docs/context_parallel.md). Autograd flows through plain tensor ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MIN_BUCKET = 16
QUERY_BLOCK = 256  # query rows per dense block: bounds the masked (wasted) part of the work
STEPS_PER_OCTAVE_LOG2 = 2  # 2**2 = 4 grid points per octave: at most 25 % padding per dimension
# Upper bound on the score-matrix elements (n * heads * P_q * P_k) handled in one SDPA call; bounds the
# temporary memory of the dense batch (scores, probabilities and their gradients).
MAX_SCORE_ELEMENTS = 1 << 24


def bucket_length(lengths: Tensor) -> Tensor:
    """Round lengths up to the bucket grid (``MIN_BUCKET``, then 4 points per power of two)."""
    clamped = lengths.clamp(min=1).to(torch.int64)
    octave = torch.floor(torch.log2(clamped.to(torch.float64))).to(torch.int64)
    granule = torch.pow(2, (octave - STEPS_PER_OCTAVE_LOG2).clamp(min=0))
    return ((clamped + granule - 1) // granule * granule).clamp(min=MIN_BUCKET)


def cpu_document_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float
) -> Tensor:
    """:func:`torchtitan_wlb.attention.document_attention` (arguments validated there) by bucketed
    dense SDPA; query rows that see no key return zeros, as flash-attention's do."""
    total_q, n_heads, _ = q.shape
    total_k, n_kv_heads, _ = k.shape
    out_dim = v.shape[-1]
    if total_q == 0:
        return q.new_zeros((0, n_heads, out_dim)) + 0.0 * q.sum()
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int64)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int64)
    len_q = cu_q[1:] - cu_q[:-1]
    len_k = cu_k[1:] - cu_k[:-1]

    # Query blocks of QUERY_BLOCK rows, each a bottom-right causal segment whose keys end at its
    # last query's diagonal: dense work follows the causal pairs instead of l_q * l_k.
    n_blocks = torch.where((len_q > 0) & (len_k > 0), (len_q + QUERY_BLOCK - 1) // QUERY_BLOCK, 0)
    total_blocks = int(n_blocks.sum())
    seg = torch.repeat_interleave(torch.arange(len(len_q), device=q.device), n_blocks)
    first_block = torch.cumsum(n_blocks, 0) - n_blocks
    offset = (torch.arange(total_blocks, device=q.device) - first_block[seg]) * QUERY_BLOCK
    blk_lq = torch.clamp(len_q[seg] - offset, max=QUERY_BLOCK)
    blk_lk = len_k[seg] - len_q[seg] + offset + blk_lq
    keep = blk_lk > 0  # blocks whose queries all precede the keys see nothing: zeros
    blk_q0 = (cu_q[:-1][seg] + offset)[keep]
    blk_k0 = cu_k[:-1][seg][keep]
    blk_lq, blk_lk = blk_lq[keep], blk_lk[keep]
    if blk_lq.numel() == 0:
        return q.new_zeros((total_q, n_heads, out_dim)) + 0.0 * (q.sum() + k.sum() + v.sum())

    pad_q = bucket_length(blk_lq)
    pad_k = bucket_length(blk_lk)
    stride_k = int(pad_k.max()) + 1
    key = pad_q * stride_k + pad_k
    order = torch.argsort(key, stable=True)
    group_keys, group_counts = torch.unique_consecutive(key[order], return_counts=True)

    gqa = n_heads != n_kv_heads
    parts: list[tuple[Tensor, Tensor]] = []  # (query rows written, their outputs) per call
    ends = torch.cumsum(group_counts, 0).tolist()  # each group's end in ``order``
    for group_key, count, end in zip(group_keys.tolist(), group_counts.tolist(), ends, strict=True):
        p_q, p_k = divmod(group_key, stride_k)
        per_call = max(1, MAX_SCORE_ELEMENTS // (n_heads * p_q * p_k))
        for sub in range(end - count, end, per_call):
            blocks = order[sub : min(sub + per_call, end)]
            parts.append(
                _dense_group(
                    q,
                    k,
                    v,
                    blk_q0[blocks],
                    blk_lq[blocks],
                    blk_k0[blocks],
                    blk_lk[blocks],
                    p_q,
                    p_k,
                    scale,
                    gqa,
                )
            )
    dest, values = zip(*parts, strict=True)
    out = q.new_zeros((total_q, n_heads, out_dim))
    return out.index_copy(0, torch.cat(dest), torch.cat(values))


def _dense_group(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_start: Tensor,
    len_q: Tensor,
    k_start: Tensor,
    len_k: Tensor,
    p_q: int,
    p_k: int,
    scale: float,
    gqa: bool,
) -> tuple[Tensor, Tensor]:
    """Attention of one bucket of blocks: returns (query rows written, their outputs)."""
    q_pos = torch.arange(p_q, device=q.device)
    k_pos = torch.arange(p_k, device=q.device)
    lq = len_q[:, None]
    lk = len_k[:, None]
    # Padded rows/columns point at a real row (clamped); they are masked or discarded below.
    q_rows = (q_start[:, None] + q_pos).clamp(max=q.shape[0] - 1)
    k_rows = (k_start[:, None] + k_pos).clamp(max=k.shape[0] - 1)
    # Bottom-right causal: query j sees keys 0 .. lk - lq + j, and only real keys.
    diag = (lk - lq)[:, :, None] + q_pos[None, :, None]  # [n, p_q, 1]
    allowed = (k_pos[None, None, :] <= diag) & (k_pos[None, None, :] < lk[:, :, None])
    row_sees_key = allowed.any(dim=-1)  # [n, p_q]
    # Rows with no visible key would make softmax NaN: let them see key 0, then drop their output.
    allowed = allowed | (~row_sees_key[:, :, None] & (k_pos == 0)[None, None, :])
    # index_select (backward: index_add) rather than advanced indexing (backward: a sorting
    # index_put with accumulation, several times slower on CPU).
    qb, kb, vb = (_rows(x, r).transpose(1, 2) for x, r in ((q, q_rows), (k, k_rows), (v, k_rows)))
    ob = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=allowed[:, None], scale=scale, enable_gqa=gqa
    ).transpose(1, 2)  # [n, p_q, H, Dv]
    keep = (q_pos[None, :] < lq) & row_sees_key
    return q_rows[keep], ob[keep]


def _rows(x: Tensor, rows: Tensor) -> Tensor:
    """``x[rows]`` for a 2-D index ``[n, p]`` into the token dim of ``x [tokens, heads, dim]``."""
    return x.index_select(0, rows.reshape(-1)).view(*rows.shape, *x.shape[1:])
