"""The model FLOPs behind the step line's ``tflops`` and ``mfu``: counted per rank from the
micro-batches' document lengths, over the device's peak (docs/getting_started.md, "tflops and MFU").

TorchTitan prices every token's attention over the whole context. Under document masking a token
attends only to the earlier tokens of its own document, so for packed documents shorter than the
context that figure counts work no kernel does (MFU above 100 % on an H100). Here:

- dense: ``6 * N`` per token, ``N`` the parameters outside the embedding (TorchTitan's count);
- attention: ``12 * n_layers * n_heads * head_dim`` per causal (query, key) pair, a document of
  ``d`` tokens holding ``d * (d + 1) / 2`` pairs;
- per rank: under CP the rank's own tokens and pairs by the micro-batch's CP plan; TP and PP split
  each token's FLOPs over their ``tp * pp`` ranks. Summed over every rank of a job, the figures
  are the job's model FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from torchtitan_wlb.cp.plan import CPPlan

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # SXM, and GH200
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("A100", 312.0),
)
"""Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s per GPU, from NVIDIA's datasheets, by a
substring of the device name (``torch.cuda.get_device_name``); the first match counts."""

ATTENTION_FLOPS_PER_PAIR_HEAD_DIM = 12
"""FLOPs per causal (query, key) pair, per head and head dimension, forward and backward: the
forward's two matmuls (scores ``Q K^T`` and output ``P V``) take 2 FLOPs (a multiply and an add) per
pair and head dimension each, the backward's four (``dP``, ``dV``, ``dQ``, ``dK``) twice as many.
A kernel's recomputation of the scores in the backward is not model work and is not counted."""


def table_peak_tflops(device_name: str) -> float | None:
    """The :data:`PEAK_TFLOPS` entry matching ``device_name``; None for a device not in it."""
    return next((tflops for key, tflops in PEAK_TFLOPS if key in device_name), None)


def resolve_peak_flops(
    override_tflops: float, device_name: str, on_cpu: bool
) -> tuple[float | None, str]:
    """``(peak FLOP/s or None, the line saying where it came from)``: ``[wlb.advanced]
    peak_tflops`` if set (> 0), else the table's figure for a GPU; None (MFU not reported) on a
    CPU or a GPU the table lacks."""
    if override_tflops > 0:
        return override_tflops * 1e12, (
            f"Peak FLOPS for MFU: {override_tflops:g} TFLOP/s ([wlb.advanced] peak_tflops)"
        )
    if on_cpu:
        return None, "Peak FLOPS: unknown for CPU, MFU not reported"
    if (tflops := table_peak_tflops(device_name)) is not None:
        return tflops * 1e12, f"Peak FLOPS for MFU: {tflops:g} TFLOP/s ({device_name}, dense bf16)"
    return None, (
        f"Peak FLOPS: unknown for {device_name}, MFU not reported; set [wlb.advanced] "
        "peak_tflops to its dense bf16 TFLOP/s"
    )


def attention_flops_per_pair(model_args: Any) -> int:
    """Forward + backward attention FLOPs of one causal (query, key) pair over every layer and
    head of a Llama-style model (``n_layers``, ``n_heads``, ``dim``); grouped K/V heads do not
    change it (every query head computes its own scores)."""
    head_dim = model_args.dim // model_args.n_heads
    return ATTENTION_FLOPS_PER_PAIR_HEAD_DIM * model_args.n_layers * model_args.n_heads * head_dim


def document_pairs(doc_lens: Any) -> int:
    """Causal (query, key) pairs of documents of ``doc_lens`` tokens: ``sum d * (d + 1) / 2`` (a
    token attends to itself and its document's earlier tokens). Exact (integers)."""
    d = np.asarray(doc_lens, dtype=np.int64)
    return int((d * (d + 1) // 2).sum())


@dataclass
class FlopsCounter:
    """The tokens and causal attention pairs one rank computed since the last logged step: the
    whole micro-batches without CP, the rank's share of them under CP. Integers, exact; FLOPs
    follow from the model's per-token and per-pair figures (:meth:`flops`)."""

    shards: int = 1
    """Ranks that split each token's FLOPs between them: ``tp * pp`` (heads and feed-forward
    columns over TP, layers over PP)."""
    tokens: int = 0
    pairs: int = 0

    def documents(self, doc_lens: Any) -> None:
        """A micro-batch computed whole on this rank (no CP)."""
        self.tokens += int(np.asarray(doc_lens, dtype=np.int64).sum())
        self.pairs += document_pairs(doc_lens)

    def cp_share(self, plan: CPPlan, rank: int, n_docs: int | None = None) -> None:
        """``rank``'s share of a micro-batch under CP, by its plan: the query tokens of its
        segments, each attending to its document's tokens up to itself. ``n_docs``: the first
        documents to count (the rest: padding the sharding added, not the model's work)."""
        mine = plan.slot_owner()[plan.seg_slot] == rank
        if n_docs is not None:
            mine &= plan.seg_doc < n_docs
        q, start = plan.seg_len[mine].astype(np.int64), plan.seg_start[mine].astype(np.int64)
        self.tokens += int(q.sum())
        self.pairs += int((q * start + q * (q + 1) // 2).sum())

    def flops(self, flops_per_token: float, flops_per_pair: float) -> float:
        """This rank's model FLOPs of what was counted."""
        return (flops_per_token * self.tokens + flops_per_pair * self.pairs) / self.shards

    def reset(self) -> None:
        self.tokens = self.pairs = 0
