"""The attention metadata the model receives through ``attention_masks``.

The model's attention module does not know whether context parallelism is on: it hands its local
``q, k, v`` and this object to :func:`attention_from_metadata`, which runs plain document attention or
the all-gather-KV context-parallel op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchtitan_wlb.attention.varlen import document_attention

if TYPE_CHECKING:  # cp.op imports this package; only the type is needed here
    from torchtitan_wlb.cp.op import CPAttentionMetadata

__all__ = ["DocumentAttentionMetadata", "attention_from_metadata", "metadata_from_doc_lens"]


@dataclass
class DocumentAttentionMetadata:
    """Describes the local packed sequence of one micro-batch.

    Attributes:
        cu_seqlens: ``int32 [num_docs + 1]`` document boundaries of the local tokens (non-CP case;
            ignored when ``cp`` is set), on the device of the activations for CUDA kernels.
        max_seqlen: longest document in tokens (CUDA kernels size their launch grid with it).
        backend: attention backend, ``"auto" | "cpu" | "flash" | "torch_varlen"``.
        cp: context-parallel metadata of this rank (from ``CPPlan.attention_metadata``); ``None``
            when context parallelism is off.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    backend: str = "auto"
    cp: CPAttentionMetadata | None = None


def metadata_from_doc_lens(
    doc_lens, device: torch.device | str = "cpu", backend: str = "auto"
) -> DocumentAttentionMetadata:
    """Non-CP metadata from a micro-batch's document lengths (NumPy array or sequence of ints)."""
    lens = torch.as_tensor(doc_lens, dtype=torch.int64)
    if lens.dim() != 1 or lens.numel() == 0 or bool((lens < 1).any()):
        raise ValueError(f"doc_lens must be a non-empty 1-D list of lengths >= 1; got {doc_lens}")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return DocumentAttentionMetadata(
        cu_seqlens=cu.to(device), max_seqlen=int(lens.max()), backend=backend
    )


def attention_from_metadata(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: DocumentAttentionMetadata
) -> torch.Tensor:
    """Document-masked causal attention of the local tokens, context parallel if ``meta.cp`` is set.

    ``q: [local_tokens, n_heads, head_dim]``, ``k, v: [local_tokens, n_kv_heads, head_dim]``.
    """
    if meta.cp is not None:
        from torchtitan_wlb.cp.op import cp_attention

        return cp_attention(q, k, v, meta.cp, backend=meta.backend)
    return document_attention(
        q,
        k,
        v,
        meta.cu_seqlens,
        meta.cu_seqlens,
        meta.max_seqlen,
        meta.max_seqlen,
        backend=meta.backend,
    )
