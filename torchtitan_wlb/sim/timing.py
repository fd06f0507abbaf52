"""Per-layer compute and communication time of packed micro-batches, counted from the model's
dimensions and the hardware profile; a layer costs the *slowest* CP rank (docs/simulator.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_wlb.cp.plan import ATTENTION_TILE, causal_pairs
from torchtitan_wlb.models.catalogue import ModelSpec
from torchtitan_wlb.sim.hardware import HardwareProfile, Layout

BF16_BYTES = 2

# fwd attention seconds for (q_len, kv_len, flops) arrays -> seconds array.
AttentionTimeFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def tile_padded_time_fn(hw: HardwareProfile, tile: int = ATTENTION_TILE) -> AttentionTimeFn:
    """Forward attention time of the simulated kernel: queries padded up to the tile (keys shift
    with them), throughput ``kbar / (kbar + attn_kv_half)`` of ``attn_tflops`` for a mean key loop
    ``kbar``; tiny per-document chunks pay both."""

    def fn(q_len: np.ndarray, kv_len: np.ndarray, flops: np.ndarray) -> np.ndarray:
        q = np.asarray(q_len, dtype=np.float64)
        k = np.asarray(kv_len, dtype=np.float64)
        qp = np.ceil(np.maximum(q, 1.0) / tile) * tile
        padded = causal_pairs(qp, k + (qp - q))
        useful = causal_pairs(q, k)
        scale = np.divide(padded, useful, out=np.ones_like(padded), where=useful > 0)
        kbar = padded / qp
        eff = kbar / (kbar + hw.attn_kv_half)
        return flops * scale / (hw.attn_tflops * 1e12 * eff)

    return fn


@dataclass
class LayerCosts:
    """Seconds of ONE layer per micro-batch on one GPU: ``compute_*`` and ``attn_fwd`` (its
    attention part) [n_mb, cp] per CP rank, ``comm_fwd`` [n_mb] exposed TP + CP communication (the
    backward's is the same), ``local_tokens`` [n_mb, cp]; ``gemm_fwd`` [n_mb, cp] the GEMM part
    of ``compute_fwd`` (None: not counted)."""

    compute_fwd: np.ndarray
    compute_bwd: np.ndarray
    attn_fwd: np.ndarray
    comm_fwd: np.ndarray
    local_tokens: np.ndarray
    gemm_fwd: np.ndarray | None = None


def _collective_seconds(bytes_per_gpu: np.ndarray, group: int, span: int, hw: HardwareProfile):
    """Ring all-gather / reduce-scatter: each GPU moves (g-1)/g of the buffer, plus latency."""
    if group <= 1:
        return np.zeros_like(np.asarray(bytes_per_gpu, dtype=np.float64))
    bw = hw.link_gbps(span) * 1e9
    return (group - 1) / group * bytes_per_gpu / bw + hw.collective_latency_us * 1e-6


def layer_costs(
    model: ModelSpec,
    layout: Layout,
    hw: HardwareProfile,
    seg_mb,
    seg_rank,
    seg_q,
    seg_kv,
    local_tokens,
    attention_time: AttentionTimeFn | None = None,
    gathered_tokens=None,
) -> LayerCosts:
    """One layer's per-GPU costs of micro-batches from their CP attention segments ``seg_*`` (one
    per query chunk of a document on a CP rank: micro-batch, rank, query and key length);
    ``gathered_tokens`` [n_mb]: the tokens whose K/V the all-gather moves (default: all)."""
    local_tokens = np.asarray(local_tokens, dtype=np.float64)
    (n_mb, cp), tp = local_tokens.shape, layout.tp
    time_fn = attention_time or tile_padded_time_fn(hw)
    heads_per_gpu = model.n_heads / tp
    # K and V bytes per token on one GPU (KV heads are replicated when TP > n_kv_heads)
    kv_bytes_per_token = 2.0 * max(model.n_kv_heads / tp, 1.0) * model.head_dim * BF16_BYTES

    flops = 4.0 * model.head_dim * heads_per_gpu * causal_pairs(seg_q, seg_kv)
    seg_time = time_fn(np.asarray(seg_q), np.asarray(seg_kv), flops)
    flat = np.asarray(seg_mb, dtype=np.int64) * cp + np.asarray(seg_rank, dtype=np.int64)
    attn = np.bincount(flat, weights=seg_time, minlength=n_mb * cp).reshape(n_mb, cp)

    gemm = 2.0 * local_tokens * model.params_per_layer / tp / (hw.gemm_tflops * 1e12)
    elem = local_tokens * model.dim * hw.elementwise_bytes_per_token_dim / tp / (hw.hbm_gbps * 1e9)
    compute_bwd = hw.bwd_attn_factor * attn + hw.bwd_gemm_factor * gemm + 2.0 * elem

    # TP (sequence parallel): 2 all-gathers + 2 reduce-scatters of the full-sequence activation of
    # this CP rank; every rank of the TP group moves (t-1)/t of [n, dim].
    act_bytes = local_tokens.max(axis=1) * model.dim * BF16_BYTES
    tp_comm = 4.0 * _collective_seconds(act_bytes, tp, tp, hw) * (1.0 - hw.tp_overlap)
    # CP: all-gather K and V of the whole micro-batch (local KV heads), reduce-scatter in backward.
    gathered = local_tokens.sum(axis=1) if gathered_tokens is None else gathered_tokens
    kv_bytes = np.asarray(gathered, dtype=np.float64) * kv_bytes_per_token
    cp_comm = _collective_seconds(kv_bytes, layout.cp, layout.cp * tp, hw) * (1.0 - hw.cp_overlap)
    comm = tp_comm + cp_comm
    return LayerCosts(attn + gemm + elem, compute_bwd, attn, comm, local_tokens, gemm)


def stage_times(
    model: ModelSpec, layout: Layout, hw: HardwareProfile, chunks: int, costs: LayerCosts
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[n_mb, PP x chunks] forward / backward time per virtual stage (the last with the output
    layer and loss), [n_mb] point-to-point time (a sequence-parallel shard, tp*cp GPUs away)."""
    layers = layers_per_vstage(model.n_layers, layout.pp * chunks)
    fwd = (costs.compute_fwd.max(axis=1) + costs.comm_fwd)[:, None] * layers[None, :]
    bwd = (costs.compute_bwd.max(axis=1) + costs.comm_fwd)[:, None] * layers[None, :]
    n = costs.local_tokens.max(axis=1)
    out_fwd = 2.0 * n * model.dim * model.vocab_size / layout.tp / (hw.gemm_tflops * 1e12)
    fwd[:, -1] += out_fwd
    bwd[:, -1] += hw.bwd_gemm_factor * out_fwd
    if layout.pp == 1:
        return fwd, bwd, np.zeros(n.shape[0])
    p2p_bw = hw.link_gbps(2 * layout.tp * layout.cp) * 1e9
    p2p = n * model.dim * BF16_BYTES / layout.tp / p2p_bw + hw.collective_latency_us * 1e-6
    return fwd, bwd, p2p


def weight_grad_times(
    model: ModelSpec, layout: Layout, hw: HardwareProfile, chunks: int, costs: LayerCosts
) -> np.ndarray:
    """[n_mb, PP x chunks] the weight-gradient part of :func:`stage_times`' backward: half of the
    backward GEMM time (dW = X^T dY costs what dX = dY W^T costs), the output layer's included;
    attention and element-wise backward only produce input gradients. The part a zero-bubble
    schedule's W action runs, off the critical path."""
    if costs.gemm_fwd is None:
        raise ValueError("costs carry no GEMM time (gemm_fwd); build them with layer_costs")
    layers = layers_per_vstage(model.n_layers, layout.pp * chunks)
    half = hw.bwd_gemm_factor / 2.0
    wgt = (half * costs.gemm_fwd.max(axis=1))[:, None] * layers[None, :]
    n = costs.local_tokens.max(axis=1)
    out_fwd = 2.0 * n * model.dim * model.vocab_size / layout.tp / (hw.gemm_tflops * 1e12)
    wgt[:, -1] += half * out_fwd
    return wgt


def layers_per_vstage(n_layers: int, n_vstages: int) -> np.ndarray:
    """The layers split over virtual stages as evenly as possible (extra ones go first)."""
    if n_vstages > n_layers:
        raise ValueError(
            f"{n_vstages} pipeline (virtual) stages need at least as many layers, model has {n_layers}"
        )
    base, extra = divmod(n_layers, n_vstages)
    return base + (np.arange(n_vstages) < extra).astype(np.float64)


def dp_exposed_seconds(model: ModelSpec, layout: Layout, hw: HardwareProfile) -> float:
    """Exposed FSDP time per step: parameter all-gather + gradient reduce-scatter over DP x CP
    (the ranks holding one TP shard), of which ``dp_overlap`` hides behind compute."""
    group = layout.dp * layout.cp
    if group <= 1:
        return 0.0
    stage_params = model.n_params / layout.pp / layout.tp
    nbytes = 2.0 * stage_params * BF16_BYTES  # all-gather + reduce-scatter
    span = layout.tp * layout.cp * (layout.pp if layout.dp > 1 else 1) * layout.dp
    return float(_collective_seconds(np.array(nbytes), group, span, hw)) * (1.0 - hw.dp_overlap)
