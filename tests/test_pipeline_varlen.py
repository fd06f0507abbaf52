"""Variable-length micro-batches through torchtitan-built pipeline schedules (CPU, gloo).

A tiny torchtitan llama3 Transformer, whose attention is document-masked from a per-micro-batch
metadata object and whose RoPE uses per-document ``positions``, is split into stages with
torchtitan's own ``pipeline_module_split`` and scheduled with its ``build_pipeline_schedule`` --
the path the trainer takes. Each step has micro-batches of different lengths (no padding); the
summed loss and every parameter gradient (after the DP sum) must match a single-process run on
the same micro-batches of all DP replicas, over several steps with SGD updates in between.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from torchtitan_wlb.attention import DocumentAttentionMetadata
from torchtitan_wlb.pipeline import (
    IGNORE_INDEX,
    VARLEN_SCHEDULES,
    UnsupportedTorchVersionError,
    VarlenPipelineRunner,
    check_pp_microbatches,
    check_torch_version,
    count_valid_tokens,
    global_valid_tokens,
    token_mean_loss,
)
from torchtitan_wlb.pipeline.varlen import _empty_like_layout

VOCAB = 256
# Micro-batch token counts of each step: different within a step and from step to step.
STEP_LENGTHS = [[37, 64, 5, 100], [90, 12, 50, 33], [64, 64, 7, 120]]
LR = 0.5


# ---------------------------------------------------------------------- model and data
def _doc_causal_mask(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    doc = torch.searchsorted(cu_seqlens[1:].long(), torch.arange(seq_len), right=True)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return (doc[:, None] == doc[None, :]) & causal


def _build_model() -> torch.nn.Module:
    """Tiny llama3 whose attention is document-masked from ``attention_masks``.

    The metadata object is the project's ``DocumentAttentionMetadata`` (what the ``llama3_wlb``
    model receives); the masking itself is a dense reference mask, independent of the attention
    package's kernels.
    """
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Attention, Transformer, apply_rotary_emb

    class DocAttention(Attention):
        def forward(self, x, freqs_cis, attention_masks, positions=None):
            bs, seq_len, _ = x.shape
            # A stage given another micro-batch's metadata fails here, not silently.
            assert isinstance(attention_masks, DocumentAttentionMetadata)
            assert int(attention_masks.cu_seqlens[-1]) == seq_len
            assert positions is not None and positions.shape == (1, seq_len)
            xq = self.wq(x).view(bs, seq_len, -1, self.head_dim)
            xk = self.wk(x).view(bs, seq_len, -1, self.head_dim)
            xv = self.wv(x).view(bs, seq_len, -1, self.head_dim)
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis, positions=positions)
            out = F.scaled_dot_product_attention(
                xq.transpose(1, 2),
                xk.transpose(1, 2),
                xv.transpose(1, 2),
                attn_mask=_doc_causal_mask(attention_masks.cu_seqlens, seq_len),
                enable_gqa=self.enable_gqa,
            )
            return self.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))

    args = TransformerModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=VOCAB,
        multiple_of=32,
        max_seq_len=128,
    )
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    for layer in model.layers.values():
        attention = DocAttention(args)
        attention.load_state_dict(layer.attention.state_dict())
        layer.attention = attention
    return model


def _make_microbatches(step: int, lengths: list[int], replica: int = 0):
    """Packed micro-batches (tokens, labels, kwargs) with 1-4 random documents each."""
    g = torch.Generator().manual_seed(1000 * replica + 10 * step)
    inputs, labels, kwargs = [], [], []
    for length in lengths:
        n_docs = min(length, int(torch.randint(1, 5, (), generator=g)))
        cuts = (torch.randperm(length - 1, generator=g)[: n_docs - 1] + 1).sort().values
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([length])])
        doc_lens = bounds.diff()
        starts = torch.repeat_interleave(bounds[:-1], doc_lens)
        positions = (torch.arange(length) - starts).unsqueeze(0)
        tokens = torch.randint(0, VOCAB, (1, length), generator=g)
        label = torch.randint(0, VOCAB, (1, length), generator=g)
        label[0, bounds[1:] - 1] = IGNORE_INDEX  # last token of each document predicts nothing
        meta = DocumentAttentionMetadata(bounds.to(torch.int32), int(doc_lens.max()), "cpu")
        inputs.append(tokens)
        labels.append(label)
        kwargs.append({"attention_masks": meta, "positions": positions})
    return inputs, labels, kwargs


# ---------------------------------------------------------------------- distributed worker
def _dp_lengths(lengths: list[int], dp_rank: int) -> list[int]:
    """Each DP replica gets other micro-batches: reversed order for odd replicas."""
    return lengths[::-1] if dp_rank % 2 else list(lengths)


def _pp_worker(
    rank: int, world_size: int, init_file: str, schedule_names: tuple[str, ...], dp: int
) -> None:
    """Every schedule of ``schedule_names`` in turn, in one process group (one launch)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    try:
        for schedule_name in schedule_names:
            _check_schedule(rank, world_size, schedule_name, dp)
    finally:
        dist.destroy_process_group()


def _check_schedule(rank: int, world_size: int, schedule_name: str, dp: int) -> None:
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import JobConfig
    from torchtitan.distributed.pipeline_parallel import (
        build_pipeline_schedule,
        generate_llm_fqn_per_model_part,
        pipeline_module_split,
    )

    pp = world_size // dp
    stages_per_rank = 1 if VARLEN_SCHEDULES[schedule_name] == "single" else 2
    check_pp_microbatches(schedule_name, len(STEP_LENGTHS[0]), pp, stages_per_rank)
    n_mb = len(STEP_LENGTHS[0])
    mesh = dist.init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    dp_group = mesh.get_group("dp")
    model = _build_model()
    fqns = generate_llm_fqn_per_model_part(pp * stages_per_rank, 4, 1, 1)
    stages, parts = pipeline_module_split(
        model, mesh["pp"], schedule_name, torch.device("cpu"), fqns
    )
    job = JobConfig()
    job.parallelism.pipeline_parallel_schedule = schedule_name
    job.parallelism.pipeline_parallel_degree = pp
    job.parallelism.pipeline_parallel_microbatch_size = 1
    job.training.local_batch_size = n_mb
    schedule = build_pipeline_schedule(job, stages, cross_entropy_loss)
    if schedule_name == "1F1B":
        # A wrong seq_dim is caught on the step that sets the stages up, on every rank,
        # before any activation is sent.
        bad = VarlenPipelineRunner(schedule, seq_dim=2)
        lengths = _dp_lengths(STEP_LENGTHS[0], dp_rank)
        inputs, labels, kwargs = _make_microbatches(0, lengths, dp_rank)
        with pytest.raises(ValueError, match="seq_dim=2 should equal seq_lens"):
            bad.step(
                inputs if bad.has_first_stage else None,
                kwargs,
                labels if bad.has_last_stage else None,
                lengths,
            )
    runner = VarlenPipelineRunner(
        schedule, verify_seq_lens=schedule_name != "1F1B", time_actions=True
    )
    assert runner.has_first_stage == (pp_rank == 0)
    # A V schedule's last stage is on the first rank, next to its first.
    v_shaped = VARLEN_SCHEDULES[schedule_name] == "v"
    assert runner.has_last_stage == (pp_rank == (0 if v_shaped else pp - 1))

    # Bad input is rejected on every rank before any communication.
    with pytest.raises(ValueError, match="seq_lens has 3 entries"):
        runner.step(None, None, None, [5, 6, 7])
    if runner.verify_seq_lens:
        # Ranks disagreeing on the plan: every rank raises, no activation is sent.
        lengths = STEP_LENGTHS[0] if pp_rank == 0 else STEP_LENGTHS[1]
        inputs, labels, kwargs = _make_microbatches(0, lengths)
        with pytest.raises(ValueError, match="passed different seq_lens"):
            runner.step(inputs, kwargs, labels, lengths)

    pp_opt = torch.optim.SGD([p for m in parts for p in m.parameters()], lr=LR)
    ref_opt = torch.optim.SGD(model.parameters(), lr=LR)
    resized_total = 0
    for step, step_lengths in enumerate(STEP_LENGTHS):
        # Every rank builds every DP replica's micro-batches, for the reference.
        replicas = [_make_microbatches(step, _dp_lengths(step_lengths, r), r) for r in range(dp)]
        lengths = _dp_lengths(step_lengths, dp_rank)
        inputs, labels, kwargs = replicas[dp_rank]
        n_tokens = global_valid_tokens(count_valid_tokens(labels), mesh["dp"])
        assert int(n_tokens) == sum(int(count_valid_tokens(r[1])) for r in replicas)

        # Reference: the whole model in this process, all replicas' micro-batches.
        ref_opt.zero_grad()
        loss_fn = token_mean_loss(cross_entropy_loss, n_tokens)
        ref_loss = torch.zeros(())
        for r, (r_inputs, r_labels, r_kwargs) in enumerate(replicas):
            for tokens, label, kw in zip(r_inputs, r_labels, r_kwargs, strict=True):
                loss = loss_fn(model(tokens, **kw), label)
                loss.backward()
                if r == dp_rank:
                    ref_loss += loss.detach()

        # Pipelined, then the DP gradient reduction (a plain sum, as FSDP with divide
        # factor 1).
        pp_opt.zero_grad()
        losses: list[torch.Tensor] = []
        stats = runner.step(
            inputs if runner.has_first_stage else None,
            kwargs,
            labels if runner.has_last_stage else None,
            seq_lens=lengths,
            global_valid_tokens=n_tokens,
            losses=losses,
        )
        resized_total += stats.buffers_resized
        _check_action_times(runner, n_mb)
        for part in parts:
            for param in part.parameters():
                dist.all_reduce(param.grad, group=dp_group)
        if runner.has_last_stage:
            assert len(losses) == n_mb
            torch.testing.assert_close(torch.stack(losses).sum(), ref_loss)
        else:
            assert losses == []

        ref_params = dict(model.named_parameters())
        n_checked = 0
        for part in parts:
            for name, param in part.named_parameters():
                assert param.grad is not None, f"step {step}: no grad for {name}"
                torch.testing.assert_close(
                    param.grad,
                    ref_params[name].grad,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, n=name, s=step: f"step {s} rank {rank} {n}: {m}",
                )
                n_checked += 1
        assert n_checked > 0
        pp_opt.step()
        ref_opt.step()
    # Lengths changed every step, so buffers were really re-sized (the first stage holds
    # gradient buffers, the last one activation buffers).
    assert resized_total > 0


def _check_action_times(runner: VarlenPipelineRunner, n_mb: int) -> None:
    """Per-action timing: every micro-batch's forward and backward on every local stage, and the
    timing wrappers are gone after the step."""
    times = runner.last_action_times
    assert times is not None
    assert times.stage_indices == [int(s.stage_index) for s in runner.stages]
    for fwd, bwd in zip(times.fwd_s, times.bwd_s, strict=True):
        assert len(fwd) == len(bwd) == n_mb
        assert all(t > 0 for t in fwd) and all(t > 0 for t in bwd)
    for fwd, bwd in zip(times.fwd_device_s, times.bwd_device_s, strict=True):
        assert len(fwd) == len(bwd) == n_mb
        assert all(t > 0 for t in fwd) and all(t > 0 for t in bwd)
    assert set(times.to_dict()) == {"stages", "fwd_s", "bwd_s", "fwd_device_s", "bwd_device_s"}
    for stage in runner.stages:
        assert "forward_one_chunk" not in vars(stage)
        assert "backward_one_chunk" not in vars(stage)
    assert "_maybe_compute_loss" not in vars(runner.schedule)


def _spawn(*schedule_names: str, dp: int = 1, pp: int = 2) -> None:
    # Ranks start from a fork server that imported torchtitan once: importing it in every
    # spawned rank costs several CPU seconds each on the shared 2-core machine, and forking the
    # pytest process itself would copy whatever threads other tests left running.
    multiprocessing.set_forkserver_preload(
        [
            "torch",
            "torchtitan.models.llama3.model.model",
            "torchtitan_wlb.attention",
            "torchtitan_wlb.pipeline",
            "torchtitan.distributed.pipeline_parallel",
        ]
    )
    world_size = dp * pp
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        mp.start_processes(
            _pp_worker,
            args=(world_size, init_file, schedule_names, dp),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )


@pytest.mark.slow
def test_dp2_pp2_1f1b_varlen_matches_single_process():
    """4 ranks: 2 pipelines (1F1B) with different micro-batches, token mean over both."""
    _spawn("1F1B", dp=2)


@pytest.mark.slow
def test_pp2_schedules_varlen_match_single_process():
    """2 ranks, one launch, each schedule in turn: GPipe; the looped ones with 2 virtual stages
    per rank (Interleaved1F1B, LoopedBFS, and InterleavedZeroBubble, whose backward is an
    input-grad and a weight-grad action); the V-shaped ZBVZeroBubble (stages 0 and 3 on rank 0,
    1 and 2 on rank 1, which pass tensors on the rank), also split."""
    _spawn("GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")


# ---------------------------------------------------------------------- single-process units
def test_check_pp_microbatches():
    check_pp_microbatches("1F1B", 4, 2)
    check_pp_microbatches("interleaved1f1b", 6, 2)  # case-insensitive, as torch's names
    check_pp_microbatches("Interleaved1F1B", 3, 4)  # one round
    check_pp_microbatches("GPipe", 1, 4)
    with pytest.raises(ValueError, match="1F1B needs at least pipeline_parallel_degree=4"):
        check_pp_microbatches("1F1B", 3, 4)
    with pytest.raises(ValueError, match="multiple of max"):
        check_pp_microbatches("Interleaved1F1B", 5, 2)
    check_pp_microbatches("ZBVZeroBubble", 1, 2)  # torch drops the actions of absent ones
    check_pp_microbatches("LoopedBFS", 3, 2, stages_per_rank=3)
    check_pp_microbatches("InterleavedZeroBubble", 6, 2)
    with pytest.raises(ValueError, match="InterleavedZeroBubble .* multiple of max"):
        check_pp_microbatches("InterleavedZeroBubble", 5, 2)
    with pytest.raises(ValueError, match="ZBVZeroBubble runs exactly 2 stages per rank"):
        check_pp_microbatches("ZBVZeroBubble", 8, 2, stages_per_rank=3)
    with pytest.raises(ValueError, match="not supported with variable-length"):
        check_pp_microbatches("DualPipeV", 8, 2)
    with pytest.raises(ValueError, match="at least 2 stages per rank"):
        check_pp_microbatches("Interleaved1F1B", 4, 2, stages_per_rank=1)
    with pytest.raises(ValueError, match="exactly 1 stage per rank"):
        check_pp_microbatches("1F1B", 4, 2, stages_per_rank=2)
    with pytest.raises(ValueError, match="pipeline_parallel_degree must be"):
        check_pp_microbatches("1F1B", 4, 1)


def test_version_gate(monkeypatch):
    monkeypatch.delenv("WLB_PP_ALLOW_UNVERIFIED_TORCH", raising=False)
    for ok in ("2.11.0", "2.12.1", "2.13.0+cpu", "2.13.0a0+git1234"):
        check_torch_version(ok)
    for bad in ("2.10.2", "2.14.0", "3.0.0"):
        with pytest.raises(UnsupportedTorchVersionError, match="verified on torch 2.11 to 2.13"):
            check_torch_version(bad)
    with pytest.raises(UnsupportedTorchVersionError, match="cannot parse"):
        check_torch_version("nightly")
    monkeypatch.setenv("WLB_PP_ALLOW_UNVERIFIED_TORCH", "1")
    check_torch_version("2.14.0")


def test_count_and_token_mean_loss():
    labels = [torch.tensor([[1, IGNORE_INDEX, 3]]), torch.tensor([[IGNORE_INDEX, 5]])]
    assert int(count_valid_tokens(labels)) == 3
    assert int(count_valid_tokens(labels[0])) == 2
    assert int(global_valid_tokens(count_valid_tokens(labels))) == 3  # no process group
    with pytest.raises(ValueError, match="empty sequence"):
        count_valid_tokens([])

    def loss_sum(pred, target):
        return F.cross_entropy(pred.flatten(0, 1), target.flatten(0, 1), reduction="sum")

    # Token mean over micro-batches of different lengths == mean over all tokens at once.
    torch.manual_seed(0)
    preds = [torch.randn(1, 3, 8), torch.randn(1, 2, 8)]
    fn = token_mean_loss(loss_sum, count_valid_tokens(labels))
    split = sum(fn(p, t) for p, t in zip(preds, labels, strict=True))
    whole = F.cross_entropy(
        torch.cat(preds, 1).flatten(0, 1), torch.cat(labels, 1).flatten(0, 1), reduction="mean"
    )
    torch.testing.assert_close(split, whole)
    # No valid token anywhere: zero loss, not NaN.
    all_ignored = torch.full((1, 2), IGNORE_INDEX)
    assert float(token_mean_loss(loss_sum, 0)(preds[1], all_ignored)) == 0.0


def test_empty_like_layout_keeps_dimension_order():
    ref = torch.empty(2, 5, 3).transpose(0, 1)  # shape (5, 2, 3), non-contiguous
    out = _empty_like_layout([7, 2, 3], ref)
    assert out.shape == (7, 2, 3)
    assert not out.is_contiguous()
    assert out.transpose(0, 1).is_contiguous()
    assert _empty_like_layout([1, 9, 4], torch.empty(1, 2, 4)).is_contiguous()


def test_resize_leaves_v_schedule_local_buffers_alone():
    """Stages 1 and 2 of a V on one rank: stage 2's activations and stage 1's gradients come from
    the other stage on the rank itself (torch hands the tensor over), so only stage 1's
    activation and stage 2's gradient buffers, received from the other rank, are re-sized."""

    def stage(index: int) -> SimpleNamespace:
        def infos() -> list[tuple[SimpleNamespace]]:
            return [(SimpleNamespace(buffer=torch.empty(1, 8, 4)),) for _ in range(2)]

        return SimpleNamespace(
            stage_index=index, has_backward=True, args_recv_info=infos(), grad_recv_info=infos()
        )

    stages = [stage(1), stage(2)]
    runner = SimpleNamespace(stages=stages, seq_dim=1, _layout_checked=True)
    kept = [stages[1].args_recv_info[1][0].buffer, stages[0].grad_recv_info[1][0].buffer]
    stats = VarlenPipelineRunner._resize_recv_buffers(runner, [8, 5])
    assert stats.buffers_resized == 2 and stats.buffers_reused == 2
    assert stages[0].args_recv_info[1][0].buffer.shape == (1, 5, 4)
    assert stages[1].grad_recv_info[1][0].buffer.shape == (1, 5, 4)
    assert stages[1].args_recv_info[1][0].buffer is kept[0]
    assert stages[0].grad_recv_info[1][0].buffer is kept[1]
