"""The attention metadata the model receives through ``attention_masks``, with or without context
parallelism (``cp`` is built on this package, which knows only a protocol of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from torchtitan_wlb.attention.ops import document_attention_op, max_seqlens_tensor
from torchtitan_wlb.attention.varlen import document_attention


class ContextParallelAttention(Protocol):
    """One rank's context-parallel attention, carried by the metadata (implemented by the CP op's
    ``CPAttentionMetadata``)."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str
    ) -> torch.Tensor:
        """Document-masked causal attention of this rank's local ``q, k, v`` over the CP group."""


@dataclass
class DocumentAttentionMetadata:
    """Describes the local packed sequence of one micro-batch."""

    # int32 [num_docs + 1] document boundaries of the local tokens, on the activations' device
    # (ignored when cp is set)
    cu_seqlens: torch.Tensor
    max_seqlen: int  # longest document in tokens (CUDA kernels size their launch grid with it)
    backend: str = "auto"  # attention backend, "auto" | "cpu" | "flash" | "torch_varlen"
    # this rank's CP metadata (cp.local.build_cp_attention_metadata); None without CP
    cp: ContextParallelAttention | None = None
    # max_seqlen as the host tensor the attention op takes (built here, outside any compiled
    # region, so that a compiled model never specialises on it)
    # (an argument only for dataclasses.replace, which FSDP applies to forward inputs)
    max_seqlens: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_seqlens is None:
            self.max_seqlens = max_seqlens_tensor(self.max_seqlen, self.max_seqlen)


def metadata_from_doc_lens(
    doc_lens, device: torch.device | str = "cpu", backend: str = "auto"
) -> DocumentAttentionMetadata:
    """Non-CP metadata from a micro-batch's document lengths (NumPy array or sequence of ints)."""
    lens = torch.as_tensor(doc_lens, dtype=torch.int64)
    if lens.dim() != 1 or lens.numel() == 0 or bool((lens < 1).any()):
        raise ValueError(f"doc_lens must be a non-empty 1-D list of lengths >= 1; got {doc_lens}")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return DocumentAttentionMetadata(cu.to(device), int(lens.max()), backend)


def attention_from_metadata(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: DocumentAttentionMetadata
) -> torch.Tensor:
    """Document-masked causal attention of the local ``[tokens, heads, head_dim]`` q, k, v,
    context parallel if ``meta.cp`` is set."""
    if meta.cp is not None:
        return meta.cp.attend(q, k, v, backend=meta.backend)
    cu = meta.cu_seqlens
    if torch.compiler.is_compiling():
        # Traced: the custom op, opaque to the tracer (its backward reruns the forward).
        scale = 1.0 / math.sqrt(q.shape[-1])
        return document_attention_op(q, k, v, cu, cu, meta.max_seqlens, scale, meta.backend)
    # Eager: autograd through the kernel itself, which keeps what its backward needs instead of
    # rerunning the forward (a third more attention time on CPU).
    return document_attention(
        q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, backend=meta.backend
    )


def uniform_metadata(batch: int, seqlen: int, device: torch.device) -> DocumentAttentionMetadata:
    """Each of ``batch`` rows one causal document of ``seqlen`` tokens, from shapes alone (no
    check of values: this is built inside a model that may be being compiled)."""
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen
    return DocumentAttentionMetadata(cu, seqlen)
