"""The ``llama3_wlb`` model: TorchTitan's Llama 3 with document-masked attention.

Only the attention's inner computation changes (its metadata arrives through ``attention_masks``);
everything else, parallelisation plans included, is TorchTitan's own (subclassed, never copied).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torchtitan.config import JobConfig
from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, parallelize_llama
from torchtitan.models.llama3.model.model import Attention, Transformer, apply_rotary_emb
from torchtitan.tools.logging import logger

import torchtitan_wlb.cp.op  # noqa: F401  (registers the CP ops)
from torchtitan_wlb import cpu_support
from torchtitan_wlb.attention import DocumentAttentionMetadata, attention_from_metadata
from torchtitan_wlb.attention.metadata import uniform_metadata
from torchtitan_wlb.config import ConfigError
from torchtitan_wlb.cost_fit import profile_cost_model
from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.models.catalogue import PAPER_MODELS, ModelSpec, get_model

# TorchTitan's per-op selective activation checkpointing ("op") keeps the outputs of the ops on this
# list and recomputes the rest; it lists its own attention kernels, so ours join them: document
# attention's forward is not rerun by the checkpoint's recompute (its backward op reruns it once).
_op_sac_save_list.update(
    {
        torch.ops.torchtitan_wlb.document_attention.default,
        torch.ops.torchtitan_wlb.cp_attention_fwd.default,
    }
)


@dataclasses.dataclass
class WLBModelArgs(TransformerModelArgs):
    """Llama 3 arguments; ``attn_type`` is fixed to document attention ("wlb")."""

    attn_type: str = "wlb"
    attn_mask_type: str = "block_causal"

    def update_from_config(self, job_config: JobConfig, **kwargs: Any) -> None:
        # Variable-length micro-batches can be longer than training.seq_len (up to S_max), and
        # positions restart per document, so RoPE must cover the longest micro-batch.
        wlb = getattr(job_config, "wlb", None)
        smax = wlb.micro_batch_max_len if wlb is not None else 0
        self.max_seq_len = max(job_config.training.seq_len, smax)

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """TorchTitan's parameter count and FLOPs per token without its attention term, which
        prices every token's attention over the whole ``seq_len``: ``6 N``, ``N`` the parameters
        outside the embedding. The metrics add attention per micro-batch from its documents
        (torchtitan_wlb/mfu.py)."""
        return super().get_nparams_and_flops(model, 0)


class WLBAttention(Attention):
    """TorchTitan's Attention with document attention inside, built as ``"sdpa"`` by TorchTitan's
    ``__init__`` (same parameters and names: checkpoints and TP plans are unchanged)."""

    def __init__(self, model_args: TransformerModelArgs):
        super().__init__(dataclasses.replace(model_args, attn_type="sdpa"))
        self.attn_type = "wlb"

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        attention_masks: DocumentAttentionMetadata | None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bs, seqlen, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis, positions=positions)
        if attention_masks is None:
            # No document boundaries given: every row is one causal document.
            attention_masks = uniform_metadata(bs, seqlen, x.device)
        # [bs, seqlen, heads, dim] -> [bs * seqlen, heads, dim]: the varlen layout; the metadata's
        # cu_seqlens describe all rows back to back.
        q, k, v = (t.reshape(bs * seqlen, -1, self.head_dim) for t in (xq, xk, xv))
        return self.wo(attention_from_metadata(q, k, v, attention_masks).reshape(bs, seqlen, -1))


class WLBTransformer(Transformer):
    """TorchTitan's Llama 3 Transformer whose blocks use :class:`WLBAttention`."""

    def __init__(self, model_args: TransformerModelArgs):
        # TorchTitan's constructor only knows its own attention types; build with "sdpa", then
        # swap the attention modules (meta-device construction makes the swap free).
        super().__init__(dataclasses.replace(model_args, attn_type="sdpa"))
        self.model_args = model_args
        for block in self.layers.values():
            block.attention = WLBAttention(model_args)

    def get_attention_masks(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "llama3_wlb takes document metadata from the data pipeline "
            "(torchtitan_wlb.trainer.WLBTrainer builds it), not from EOS tokens"
        )


def model_args(spec: ModelSpec) -> WLBModelArgs:
    """TorchTitan's Llama 3 arguments for a catalogue model, with ``multiple_of`` and the FFN
    multiplier chosen so that TorchTitan derives the catalogue's SwiGLU width (docs/models.md)."""
    ffn = spec.ffn_hidden_dim
    shape = {k: v for k, v in spec.dims().items() if k != "ffn_hidden_dim"}
    base = int(2 * (4 * spec.dim) / 3)
    multiplier = None if base <= ffn else ffn / base
    return WLBModelArgs(**shape, multiple_of=ffn, ffn_dim_multiplier=multiplier, rope_theta=500000)


FLAVORS: dict[str, str] = {
    "debugmodel": "debugmodel",
    "tiny": "tiny",
    "byte_1B": "byte_1B",
    "8B": "llama3_8B",
    "70B": "llama3_70B",
    **{f"paper_{name}": name for name in PAPER_MODELS},
}
"""Flavor name -> :mod:`~torchtitan_wlb.models.catalogue` model (docs/models.md)."""

llama3_wlb_args: dict[str, WLBModelArgs] = {
    flavor: model_args(get_model(name)) for flavor, name in FLAVORS.items()
}


class _TorchTitanCPView:
    """``parallel_dims`` with ``cp_enabled`` False, for ``parallelize_llama``: it would wrap every
    inner attention in TorchTitan's SDPA/flex CP, which cannot mask documents (our attention does
    its own CP); everything else, FSDP over the dp_shard x cp mesh included, is the real one."""

    cp_enabled = False

    def __init__(self, parallel_dims: Any) -> None:
        self._parallel_dims = parallel_dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parallel_dims, name)


def mark_lengths_dynamic(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a compiled block: its input's token dimension, the positions' and the
    attention metadata's index tensors are marked dynamic before the block runs, so that the first
    compile already serves every packed length and document count (by default torch.compile
    specialises on the first micro-batch's shapes and recompiles for the second). Lengths of 0 or
    1 (e.g. a CP rank that gathers nothing) still get a graph of their own."""
    mark = torch._dynamo.maybe_mark_dynamic
    x = args[0] if args else kwargs.get("x")
    values = list(args[1:]) + list(kwargs.values())
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        mark(x, 1)
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_complex():
            mark(value, 1)  # positions [batch, tokens]
        elif isinstance(value, DocumentAttentionMetadata):
            cp = value.cp
            index = [value.cu_seqlens]
            if cp is not None and hasattr(cp, "op_cus"):
                index += [cp.kv_order, *cp.op_cus]
            for tensor in index:
                if tensor.dim() == 1:
                    mark(tensor, 0)


def wait_for_embedding(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of the tensor-parallel embedding under compile. TP's embedding returns its
    sequence shard while the reduce-scatter is still in flight (an ``AsyncCollectiveTensor``);
    handed that as input, a block compiled by AOTAutograd (torch 2.13) returns its gradient as a
    plain tensor where the embedding's DTensor redistribution expects a DTensor, and the first
    backward fails. A copy waits for the collective: the compiled blocks get a plain tensor."""
    if isinstance(output, AsyncCollectiveTensor):
        return output.clone()
    return output


def parallelize_llama_wlb(model: nn.Module, parallel_dims: Any, job_config: JobConfig) -> nn.Module:
    """TorchTitan's Llama 3 parallelisation (TP, AC, compile, FSDP/HSDP/DDP), our CP, CPU-ready."""
    model = parallelize_llama(model, _TorchTitanCPView(parallel_dims), job_config)
    cpu_support.adapt_fsdp_for_cpu(model)
    if job_config.compile.enable and "model" in job_config.compile.components:
        for block in model.layers.values():
            block.register_forward_pre_hook(mark_lengths_dynamic, with_kwargs=True)
        if parallel_dims.tp_enabled and model.tok_embeddings is not None:
            model.tok_embeddings.register_forward_hook(wait_for_embedding)
    if parallel_dims.cp_enabled:
        logger.info("Per-document context parallelism: attention uses the WLB all-gather-KV op")
    return model


def cost_model_for_job(job_config: JobConfig) -> CostModel:
    """The workload model W(d) of this job by ``[wlb] cost_model`` (docs/configuration.md);
    "online" starts from the profile if one is given, else from the analytic (per-rank) model
    with attention priced at ``[wlb.online] initial_attn_scale`` times its FLOPs
    (docs/cost_model.md)."""
    wlb = job_config.wlb
    if wlb.cost_model == "coefficients":
        return CostModel.from_coefficients(wlb.attn_coef, wlb.linear_coef)
    if wlb.cost_model == "profile" or (wlb.cost_model == "online" and wlb.cost_profile):
        return profile_cost_model(wlb.cost_profile)
    flavor = job_config.model.flavor
    if flavor not in FLAVORS:
        raise ConfigError(
            f"[model] flavor = {flavor!r} is not a llama3_wlb flavor; use one of "
            f"{', '.join(repr(k) for k in FLAVORS)}"
        )
    model = CostModel.from_model_dims(
        **get_model(FLAVORS[flavor]).dims(),
        tp=job_config.parallelism.tensor_parallel_degree,
        cp=job_config.parallelism.context_parallel_degree,
    )
    if wlb.cost_model == "online":  # the starting model: attention priced above its FLOPs
        model = dataclasses.replace(
            model, attn_coef=model.attn_coef * wlb.online.initial_attn_scale
        )
    return model


def pipeline_llama_wlb(
    model: nn.Module, parallel_dims: Any, job_config: JobConfig, *args: Any
) -> Any:
    """TorchTitan's ``pipeline_llm`` (``args`` passed through) with its schedule sized for one
    slot per packed micro-batch: ``N / DP`` micro-batches of size 1 (docs/pipeline.md)."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    dp = parallel_dims.dp_replicate * parallel_dims.dp_shard
    n = job_config.training.global_batch_size
    schedule_config = copy.deepcopy(job_config)
    schedule_config.training.local_batch_size = (n if n > 0 else dp) // dp
    schedule_config.parallelism.pipeline_parallel_microbatch_size = 1
    return pipeline_llm(model, parallel_dims, schedule_config, *args)
