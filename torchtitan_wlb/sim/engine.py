"""The 4D step simulator: packed micro-batches -> CP shards -> per-layer times -> pipeline timeline,
with the project's own packers, CP planner and cost model (docs/simulator.md)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.cp.adaptive import build_cp_plan
from torchtitan_wlb.cp.plan import ATTENTION_TILE, causal_pairs
from torchtitan_wlb.cp.profile import CPProfile, attention_flops, resolve_profile
from torchtitan_wlb.packing import LengthStream, build_packer, drive, packing_config
from torchtitan_wlb.packing.placement import dp_order
from torchtitan_wlb.sim import timing
from torchtitan_wlb.sim.config import ModeSpec, SimConfig
from torchtitan_wlb.sim.fit import fit_coefficients
from torchtitan_wlb.sim.timeline import Schedule, build_schedule, simulate_pipeline
from torchtitan_wlb.workloads import cut_stream, cycle_to, split_long


def pack_steps(mode, lengths: np.ndarray, cfg, n_steps: int) -> tuple[list[list[np.ndarray]], dict]:
    """The mode's packer over the stream (repeated, reshuffled, if short) for ``n_steps``: per step
    its micro-batches' document lengths, and the averaged packer stats."""
    need = int((n_steps + cfg.max_delay_steps + 2) * cfg.n_global * cfg.context_len * 1.3)
    rng = np.random.default_rng(cfg.seed)
    if mode.stream_cut:
        docs = cut_stream(cycle_to(lengths, need, rng), cfg.context_len)
    else:
        docs = cycle_to(split_long(lengths, cfg.context_len), need, rng)
    # Knobs the simulator has no setting for keep the [wlb] defaults. No outlier delay: no queues.
    no_queues = mode.packer.startswith("wlb") and not mode.outlier_delay
    config = packing_config(
        mode.packer,
        cfg.n_global,
        cfg.context_len,
        max_delay_steps=cfg.max_delay_steps,
        smax=cfg.smax if mode.variable_length else None,
        queue_thresholds=() if no_queues else cfg.queue_thresholds,
    )
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
    gathered_tokens: np.ndarray
    chose_hybrid: np.ndarray


def cp_shards(
    micro_batches: list[np.ndarray],
    cfg,
    strategy: str,
    candidates: tuple[str, ...] = ("per_sequence", "per_document"),
) -> CPShards:
    """Every micro-batch's segments from the CP planner; "adaptive" chooses among ``candidates``
    with the planner profile and the simulated CP group's link bandwidth."""
    c, n = cfg.layout.cp, len(micro_batches)
    segs: list[list[np.ndarray]] = [[np.zeros(0, dtype=np.int64)] for _ in range(4)]
    local, gathered = np.zeros((n, c), dtype=np.int64), np.zeros(n, dtype=np.int64)
    chosen = np.full(n, "", dtype=object)
    bandwidth, profile = cfg.hardware.link_gbps(c * cfg.layout.tp), None
    if strategy == "adaptive":  # the measured table if given, else the simulated kernel's
        hw, m = cfg.hardware, cfg.model
        profile = _measured_profile(cfg.cp_profile) if cfg.cp_profile else simulated_cp_profile(hw)
        # The planner prices compute with the profile's query heads and bytes with its KV heads;
        # scale the bandwidth so that compute : bytes is the model's (GQA moves fewer bytes).
        bandwidth *= (m.n_heads / m.n_kv_heads) * (profile.n_kv_heads / profile.n_heads)
    for i, lens in enumerate(micro_batches):
        if int(np.sum(lens)) < c:  # an empty micro-batch (a packer may leave one): no work
            continue
        plan = build_cp_plan(
            lens, c, strategy, profile=profile, bandwidth_gbps=bandwidth, candidates=candidates
        )
        keep = plan.seg_len > 0
        q = plan.seg_len[keep]
        parts = (
            np.full(q.size, i),
            plan.slot_owner()[plan.seg_slot[keep]],
            q,
            plan.seg_start[keep] + q,
        )
        for acc, part in zip(segs, parts, strict=True):
            acc.append(part)
        local[i], gathered[i], chosen[i] = plan.local_lens, plan.gathered_len, plan.strategy
    mb, rank, q, kv = (np.concatenate(x).astype(np.int64) for x in segs)
    return CPShards(mb, rank, q, kv, local, chosen == "per_document", gathered, chosen == "hybrid")


def shard_costs(shards: CPShards, cfg: SimConfig) -> timing.LayerCosts:
    segs = (shards.seg_mb, shards.seg_rank, shards.seg_q, shards.seg_kv, shards.local_tokens)
    return timing.layer_costs(
        cfg.model,
        cfg.layout,
        cfg.hardware,
        *segs,
        attention_time=attention_time_fn(cfg),
        gathered_tokens=shards.gathered_tokens,
    )


@lru_cache(maxsize=8)
def simulated_cp_profile(hw):
    """The simulated kernel (``timing.tile_padded_time_fn``) as a CP throughput table, so that
    adaptive selection judges with the simulated GPU's efficiency, not the packaged CPU table's."""
    grid = np.unique(np.round(2.0 ** np.arange(3, 18.01, 0.25)).astype(np.int64))
    q, kv = np.meshgrid(grid, grid, indexing="ij")
    fn, tile, head_dim = timing.tile_padded_time_fn(hw), ATTENTION_TILE, 128
    valid = q <= kv
    kv_v = np.where(valid, kv, q)  # cells with q > kv are never looked up (NaN in the table)
    seconds = fn(q, kv_v, 4.0 * head_dim * causal_pairs(q, kv_v)) * (1.0 + hw.bwd_attn_factor)
    pq = -(-q // tile) * tile  # the table's FLOPs are the tile-padded ones
    padded_flops = attention_flops(pq, np.maximum(-(-kv_v // tile) * tile, pq), 1, head_dim)
    tflops = np.where(valid, padded_flops / seconds / 1e12, np.nan)
    return CPProfile(
        lengths=tuple(int(x) for x in grid),
        tile=tile,
        device=f"simulated-{hw.name}",
        tflops=tuple(tuple(float(x) for x in row) for row in tflops),
        backend="simulated",
        n_heads=1,
        n_kv_heads=1,
        head_dim=head_dim,
        dtype="bfloat16",
    )


_measured_profile = lru_cache(maxsize=8)(resolve_profile)


def attention_time_fn(cfg) -> timing.AttentionTimeFn:
    """Forward attention time: the kernel model, or a measured CP profile's forward + backward
    time over (1 + bwd_attn_factor), so that the profile's total is reproduced."""
    if not cfg.cp_profile:
        return timing.tile_padded_time_fn(cfg.hardware)
    table, hw = _measured_profile(cfg.cp_profile), cfg.hardware

    def fn(q_len: np.ndarray, kv_len: np.ndarray, flops: np.ndarray) -> np.ndarray:
        q, kv = np.asarray(q_len, dtype=np.int64), np.asarray(kv_len, dtype=np.int64)
        # The model's FLOPs (per GPU) over the table's: its heads x head_dim over the profile's.
        per_table = 4.0 * causal_pairs(q, kv) * table.n_heads * table.head_dim
        scale = np.divide(flops, per_table, out=np.zeros(q.shape), where=q > 0)
        return table.segment_seconds(q, kv) * scale / (1.0 + hw.bwd_attn_factor)

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
    cfg = SimConfig(
        model=model,
        layout=layout,
        context_len=context_len,
        hardware=hw,
        schedule="1f1b",
        v=1,
        cost_model="analytic",
        cp_profile=cp_profile,
    )
    mbs = profiling_micro_batches(context_len, layout.cp)
    costs = shard_costs(cp_shards(mbs, cfg, "per_document"), cfg)
    fwd, bwd, _ = timing.stage_times(model, layout, hw, 1, costs)
    a, b, _ = fit_coefficients(mbs, (fwd + bwd).sum(axis=1), overhead=False)
    return CostModel.from_coefficients(float(a), float(b), unit="seconds")


@dataclass
class ModeResult:
    """What one mode's simulation produced, per timed step: step time, tokens, max / mean
    micro-batch latency, idle share of the slowest replica's pipeline; ``rank_compute_s`` [steps,
    dp, pp, cp] each GPU's compute, ``mb_rank_compute_s`` [steps, N, cp] each micro-batch's on each
    CP rank (the paper's Figure 4 heat map); ``gantt`` the first step's slowest timeline."""

    mode: ModeSpec
    step_time_s: np.ndarray
    tokens: np.ndarray
    imbalance: np.ndarray
    bubble_fraction: np.ndarray
    rank_compute_s: np.ndarray
    mb_rank_compute_s: np.ndarray
    gantt: tuple[Schedule, np.ndarray, np.ndarray]
    per_document_share: float
    pack_stats: dict
    hybrid_share: float = 0.0

    @property
    def seconds_per_token(self) -> float:
        return float(self.step_time_s.sum() / self.tokens.sum())

    def summary(self) -> dict:
        # Slowest GPU's compute over the mean GPU's, per step (the paper's 1.44 on its 8K-GPU job).
        per_step = self.rank_compute_s.reshape(self.rank_compute_s.shape[0], -1)
        gpu_imbalance = per_step.max(axis=1) / per_step.mean(axis=1)
        return {
            "step_time_s": float(self.step_time_s.mean()),
            "imbalance": float(self.imbalance.mean()),
            "bubble_fraction": float(self.bubble_fraction.mean()),
            "tokens_per_step": float(self.tokens.mean()),
            "tokens_per_s": float(1.0 / self.seconds_per_token),
            "gpu_latency_max_over_mean": float(gpu_imbalance.mean()),
            "packer": self.mode.packer,
            "cp_strategy": self.mode.cp_strategy,
            "per_document_share": self.per_document_share,
            "hybrid_share": self.hybrid_share,
        }


def simulate_mode(mode: ModeSpec, lengths, cfg: SimConfig, pack=pack_steps) -> ModeResult:
    """Simulate ``cfg.steps`` timed steps of one mode; ``pack`` (as ``pack_steps``) packs the stream
    into steps (a diagnostic may rearrange the mode's packer's output)."""
    steps, stats = pack(mode, lengths, cfg, cfg.warmup_steps + cfg.steps)
    steps = steps[cfg.warmup_steps : cfg.warmup_steps + cfg.steps]
    n_steps, n = len(steps), cfg.n_global
    if n_steps == 0 or any(len(s) != n for s in steps):
        raise ValueError(
            f"packer {mode.packer!r} produced {[len(s) for s in steps]} micro-batches per step, "
            f"expected {n} for {cfg.steps} steps (is the document stream long enough?)"
        )
    flat = [np.asarray(mb, dtype=np.int64) for s in steps for mb in s]
    shards = cp_shards(flat, cfg, mode.cp_strategy, mode.cp_candidates)
    costs = shard_costs(shards, cfg)
    model, lay, hw = cfg.model, cfg.layout, cfg.hardware
    fwd, bwd, p2p = timing.stage_times(model, lay, hw, cfg.chunks, costs)
    dp, m, n_v = lay.dp, cfg.m, fwd.shape[1]
    # [steps * N, V] -> [steps, dp, m, V] -> [steps * dp, V, m]
    f, b = (
        x.reshape(n_steps, dp, m, n_v).transpose(0, 1, 3, 2).reshape(-1, n_v, m) for x in (fwd, bwd)
    )
    schedule = build_schedule(lay.pp, m, cfg.chunks)
    res = simulate_pipeline(schedule, f, b, p2p.reshape(n_steps * dp, m))
    makespan = res.makespan.reshape(n_steps, dp)
    slowest = makespan.argmax(axis=1)
    step_time = makespan.max(axis=1) + timing.dp_exposed_seconds(model, lay, hw)
    bubble = res.bubble_fraction.reshape(n_steps, dp)[np.arange(n_steps), slowest]

    mb_latency = (fwd + bwd).sum(axis=1).reshape(n_steps, n)
    imbalance = mb_latency.max(axis=1) / mb_latency.mean(axis=1)

    # Per-GPU compute (no waiting): [steps, dp, pp, cp]; virtual stage i runs on rank i % pp.
    layers = timing.layers_per_vstage(model.n_layers, n_v).reshape(cfg.chunks, lay.pp).sum(axis=0)
    per_layer = (costs.compute_fwd + costs.compute_bwd).reshape(n_steps, dp, m, lay.cp)
    rank_compute = per_layer.sum(axis=2)[:, :, None, :] * layers[None, None, :, None]

    tokens = np.array([sum(int(mb.sum()) for mb in s) for s in steps], dtype=np.float64)
    first = int(slowest[0])
    gantt = (schedule, res.start[first].copy(), res.end[first].copy())
    return ModeResult(
        mode,
        step_time,
        tokens,
        imbalance,
        bubble,
        rank_compute,
        per_layer.reshape(n_steps, n, lay.cp) * model.n_layers,
        gantt,
        float(shards.chose_per_document.mean()),
        stats,
        float(shards.chose_hybrid.mean()),
    )


def speedup(baseline: ModeResult, other: ModeResult) -> float:
    """Throughput ratio other / baseline (time per token)."""
    return baseline.seconds_per_token / other.seconds_per_token
