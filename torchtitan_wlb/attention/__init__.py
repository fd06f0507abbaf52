"""Document-masked causal attention over packed sequences (CPU, flash-attn, torch varlen)."""

from torchtitan_wlb.attention.metadata import (
    DocumentAttentionMetadata,
    attention_from_metadata,
    metadata_from_doc_lens,
)
from torchtitan_wlb.attention.varlen import BACKENDS, document_attention, resolve_backend

__all__ = [
    "BACKENDS",
    "DocumentAttentionMetadata",
    "attention_from_metadata",
    "document_attention",
    "metadata_from_doc_lens",
    "resolve_backend",
]
