"""The simulator's bridge to the project's packers, CP planner and cost model (no re-implementation).

Adaptive CP and attention timing read one throughput table (the simulated kernel's, or a measured
profile), so attention is timed with the efficiency the planner assumed when it chose.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.cp.plan import causal_pairs
from torchtitan_wlb.packing import LengthStream, build_packer, drive, packing_config
from torchtitan_wlb.packing.placement import dp_order
from torchtitan_wlb.sim import timing
from torchtitan_wlb.sim.config import SimConfig
from torchtitan_wlb.sim.fit import fit
from torchtitan_wlb.sim.records import MicroBatchRecord
from torchtitan_wlb.workloads import cut_stream, cycle_to, split_long


def pack_steps(mode, lengths: np.ndarray, cfg, n_steps: int) -> tuple[list[list[np.ndarray]], dict]:
    """The mode's packer over the stream for ``n_steps``: per step its micro-batches' document
    lengths, and the averaged packer stats. Documents are split at the context length (the
    loader's default), or the stream cut every context length (``mode.stream_cut``); a short stream
    is repeated, reshuffled with ``cfg.seed``."""
    need = int((n_steps + cfg.max_delay_steps + 2) * cfg.n_global * cfg.context_len * 1.3)
    rng = np.random.default_rng(cfg.seed)
    if mode.stream_cut:
        docs = cut_stream(cycle_to(lengths, need, rng), cfg.context_len)
    else:
        docs = cycle_to(split_long(lengths, cfg.context_len), need, rng)
    # Knobs the simulator has no setting for keep the [wlb] defaults. No outlier delay: no queues.
    no_queues = mode.packer.startswith("wlb") and not mode.outlier_delay
    config = packing_config(mode.packer, cfg.n_global, cfg.context_len, max_wait=cfg.max_delay_steps,
                            smax=cfg.smax if mode.variable_length else None,
                            queue_thresholds=() if no_queues else cfg.queue_thresholds)  # fmt: skip
    cost_model = cost_model_for(cfg)
    packer = build_packer(mode.packer, config, cost_model)
    steps: list[list[np.ndarray]] = []
    stats_acc: dict[str, list[float]] = {}
    # A window of a training run's stream: its end is not the end of the data (no flush).
    for plan in drive(packer, LengthStream(docs, end_of_data=False), n_steps):
        mbs = [np.asarray(x, dtype=np.int64) for x in plan.doc_lens]
        # Deal the micro-batches to DP ranks as the data loader does (contiguous for "original").
        loads = np.array([float(cost_model.doc_cost(x).sum()) for x in mbs])
        order = dp_order(loads, cfg.layout.dp, balanced=mode.packer != "original")
        steps.append([mbs[j] for j in order])
        for k, v in plan.stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                stats_acc.setdefault(k, []).append(float(v))
    stats = {k: float(np.mean(v)) for k, v in stats_acc.items()}
    return steps, stats


@dataclass
class CPShards:
    """Attention segments of micro-batches under one CP strategy: ``seg_*`` [n_seg] as
    ``timing.layer_costs`` takes them; per micro-batch its CP ranks' tokens, the tokens whose K/V
    are all-gathered, and whether its plan is per-document / hybrid."""

    seg_mb: np.ndarray
    seg_rank: np.ndarray
    seg_q: np.ndarray
    seg_kv: np.ndarray
    local_tokens: np.ndarray
    chose_per_document: np.ndarray
    gathered_tokens: np.ndarray | None = None
    chose_hybrid: np.ndarray | None = None


def cp_shards(micro_batches: list[np.ndarray], cfg, strategy: str,
              candidates: tuple[str, ...] = ("per_sequence", "per_document")) -> CPShards:  # fmt: skip
    """Every micro-batch's segments from the CP planner; "adaptive" chooses among ``candidates``
    with the planner profile and the simulated CP group's link bandwidth."""
    from torchtitan_wlb.cp.adaptive import build_cp_plan

    c = cfg.layout.cp
    mbs, ranks, qs, kvs = [], [], [], []
    local = np.zeros((len(micro_batches), c), dtype=np.int64)
    gathered = np.zeros(len(micro_batches), dtype=np.int64)
    chose_doc = np.zeros(len(micro_batches), dtype=bool)
    chose_hybrid = np.zeros(len(micro_batches), dtype=bool)
    profile = None
    if strategy == "adaptive":  # the measured table if given, else the simulated kernel's
        hw = cfg.hardware
        profile = _measured_profile(cfg.cp_profile) if cfg.cp_profile else simulated_cp_profile(hw)
    bandwidth = cfg.hardware.link_gbps(c * cfg.layout.tp)
    if profile is not None:
        # The planner prices compute with the profile's query heads and bytes with its KV heads;
        # scale the bandwidth so that compute : bytes is the model's (GQA moves fewer bytes).
        m = cfg.model
        bandwidth *= (m.n_heads / m.n_kv_heads) * (profile.n_kv_heads / profile.n_heads)
    for i, lens in enumerate(micro_batches):
        if int(np.sum(lens)) < c:  # an empty micro-batch (a packer may leave one): no work
            continue
        plan = build_cp_plan(lens, c, strategy, profile=profile, bandwidth_gbps=bandwidth,
                             candidates=candidates)  # fmt: skip
        keep = plan.seg_len > 0
        q = plan.seg_len[keep]
        ranks.append(plan.slot_owner()[plan.seg_slot[keep]])
        qs.append(q)
        kvs.append(plan.seg_start[keep] + q)
        mbs.append(np.full(q.size, i, dtype=np.int64))
        local[i] = plan.local_lens
        gathered[i] = plan.gathered_len
        chose_doc[i] = plan.strategy == "per_document"
        chose_hybrid[i] = plan.strategy == "hybrid"
    empty = np.zeros(0, dtype=np.int64)
    segs = (np.concatenate([empty, *x]) for x in (mbs, ranks, qs, kvs))
    return CPShards(*segs, local_tokens=local, chose_per_document=chose_doc,
                    gathered_tokens=gathered, chose_hybrid=chose_hybrid)  # fmt: skip


def shard_costs(shards: CPShards, cfg: SimConfig) -> timing.LayerCosts:
    segs = (shards.seg_mb, shards.seg_rank, shards.seg_q, shards.seg_kv, shards.local_tokens)
    return timing.layer_costs(cfg.model, cfg.layout, cfg.hardware, *segs,
                              attention_time=attention_time_fn(cfg),
                              gathered_tokens=shards.gathered_tokens)  # fmt: skip


@lru_cache(maxsize=8)
def simulated_cp_profile(hw):
    """The simulated kernel (``timing.tile_padded_time_fn``) as a CP throughput table, so that
    adaptive selection judges with the simulated GPU's efficiency, not the packaged CPU table's."""
    from torchtitan_wlb.cp.profile import CPProfile, attention_flops

    grid = np.unique(np.round(2.0 ** np.arange(3, 18.01, 0.25)).astype(np.int64))
    q, kv = np.meshgrid(grid, grid, indexing="ij")
    fn, tile, head_dim = timing.tile_padded_time_fn(hw), timing.TILE, 128
    valid = q <= kv
    kv_v = np.where(valid, kv, q)  # cells with q > kv are never looked up (NaN in the table)
    fwd_flops = 4.0 * head_dim * causal_pairs(q, kv_v)
    seconds = fn(q, kv_v, fwd_flops) * (1.0 + hw.bwd_attn_factor)
    tflops = np.where(valid, attention_flops(*_padded(q, kv_v, tile), 1, head_dim) / seconds / 1e12,
                      np.nan)  # fmt: skip
    return CPProfile(lengths=tuple(int(x) for x in grid), tile=tile, device=f"simulated-{hw.name}",
                     tflops=tuple(tuple(float(x) for x in row) for row in tflops),
                     backend="simulated", n_heads=1, n_kv_heads=1, head_dim=head_dim,
                     dtype="bfloat16")  # fmt: skip


def _padded(q: np.ndarray, kv: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray]:
    pq = -(-q // tile) * tile
    return pq, np.maximum(-(-kv // tile) * tile, pq)


@lru_cache(maxsize=8)
def _measured_profile(path: str):
    from torchtitan_wlb.cp.profile import resolve_profile

    return resolve_profile(path)


def attention_time_fn(cfg) -> timing.AttentionTimeFn:
    """Forward attention time: the kernel model, or a measured CP profile's forward + backward
    time over (1 + bwd_attn_factor), so that the profile's total is reproduced."""
    if not cfg.cp_profile:
        return timing.tile_padded_time_fn(cfg.hardware)
    from torchtitan_wlb.cp.profile import attention_flops

    table = _measured_profile(cfg.cp_profile)
    hw = cfg.hardware

    def fn(q_len: np.ndarray, kv_len: np.ndarray, flops: np.ndarray) -> np.ndarray:
        q, kv = np.asarray(q_len, dtype=np.int64), np.asarray(kv_len, dtype=np.int64)
        # flops (the model's, per GPU) over the unpadded count gives heads x head_dim scaling.
        per_pair = np.divide(flops, 4.0 * causal_pairs(q, kv), out=np.zeros(q.shape), where=q > 0)
        padded = attention_flops(*_padded(q, kv, table.tile), 1, 1)
        total = padded * per_pair / (table.lookup_tflops(q, kv) * 1e12)
        return np.where(q > 0, total / (1.0 + hw.bwd_attn_factor), 0.0)

    return fn


def profiling_micro_batches(context_len: int, cp: int, n_points: int = 24) -> list[np.ndarray]:
    """Micro-batches an offline profile would time: each filled to the context length with
    documents of ONE length (geometric up to the context), so the fit resolves the attention term."""
    lens = np.unique(np.geomspace(max(2 * cp, 128), context_len, n_points).astype(np.int64))
    out = []
    for d in lens:
        k, rem = divmod(context_len, int(d))
        mb = np.full(k, d, dtype=np.int64)
        out.append(np.append(mb, rem) if rem >= 2 * cp else mb)
    return out


def cost_model_for(cfg) -> CostModel:
    m, lay = cfg.model, cfg.layout
    if cfg.cost_model == "analytic":
        return CostModel.from_model_dims(**m.dims(), tp=lay.tp, cp=lay.cp)
    return _profiled_cost_model(m, lay, cfg.hardware, cfg.context_len, cfg.cp_profile)


@lru_cache(maxsize=32)
def _profiled_cost_model(model, layout, hw, context_len: int, cp_profile: str | None) -> CostModel:
    """W(d) = a d^2 + b d fitted to the simulated time of profiling micro-batches (per-document
    CP): an offline profile of the simulated GPUs."""
    cfg = SimConfig(model=model, layout=layout, context_len=context_len, hardware=hw,
                    schedule="1f1b", v=1, cost_model="analytic", cp_profile=cp_profile)  # fmt: skip
    mbs = profiling_micro_batches(context_len, layout.cp)
    shards = cp_shards(mbs, cfg, "per_document")
    costs = shard_costs(shards, cfg)
    fwd, bwd, _ = timing.stage_times(model, layout, hw, 1, costs)
    seconds = (fwd + bwd).sum(axis=1)
    records = [MicroBatchRecord(mb, float(s)) for mb, s in zip(mbs, seconds, strict=True)]
    return fit(records, overhead=False).cost_model()
