"""The training configurations the simulator compares: the paper's three systems and their parts."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_wlb.config import MODE_PRESETS
from torchtitan_wlb.cp.adaptive import ADAPTIVE_CANDIDATES

PAPER_CP_CANDIDATES = ("per_sequence", "per_document")  # WLB-LLM's adaptive sharding


@dataclass(frozen=True)
class ModeSpec:
    """One way to pack and shard a step.

    Attributes:
        name: Mode name used on the command line and in the JSON output.
        packer: Packer name of torchtitan_wlb.packing ("original", "fixed_greedy", "solver", "wlb",
            "wlb_paper").
        cp_strategy: CP sharding plan of torchtitan_wlb.cp.plan ("per_sequence", "per_document",
            "hybrid", "adaptive").
        outlier_delay: For the "wlb" packers: whether outlier documents wait in queues (True) or the
            packer only varies micro-batch lengths within the step (False).
        variable_length: Whether micro-batches may exceed the context length up to S_max.
        description: One line for tables and plots.
        cp_candidates: For "adaptive": the strategies it chooses among. The paper's modes keep
            its two (per-sequence, per-document); the ``*hybrid*`` modes add hybrid.
        stream_cut: Model TorchTitan's loader: the document stream is concatenated and cut every
            context length, so a document straddling a sequence boundary continues, as a separate
            document, at the start of the next sequence, and every sequence is full
            (``lengths.cut_stream``). False: whole documents (split only above the context length)
            packed by the mode's packer, as the project's data path does.
    """

    name: str
    packer: str
    cp_strategy: str
    outlier_delay: bool = True
    variable_length: bool = False
    description: str = ""
    stream_cut: bool = False
    cp_candidates: tuple[str, ...] = PAPER_CP_CANDIDATES


_P = MODE_PRESETS  # the paper's three systems, as the trainer's [wlb] mode presets define them
# TorchTitan's own loader (torchtitan.hf_datasets.text_datasets) cuts the token stream every context
# length, so documents straddling a boundary are cut and every sequence is full. The paper's baseline
# keeps documents whole (its Table 2 imbalance of the original packing is what whole-document
# next-fit gives on a paper-like workload; the cut stream gives less), so the *_torchtitan modes are
# labelled alternatives, not the Plain-4D of the paper's figures.
MODES: dict[str, ModeSpec] = {m.name: m for m in (
    ModeSpec("plain_4d", *_P["plain_4d"], description="Plain-4D: original packing + per-sequence CP"),
    ModeSpec("fixed_4d", *_P["fixed_4d"],
             description="Fixed-4D: fixed-length greedy packing + fixed CP sharding"),
    ModeSpec("wlb", *_P["wlb"], variable_length=True,
             description="WLB-LLM: variable-length packing with outlier delay + adaptive CP"),
    ModeSpec("per_doc_cp", "original", "per_document",
             description="per-document CP only (original packing)"),
    ModeSpec("adaptive_cp", "original", "adaptive", description="adaptive CP only (original packing)"),
    ModeSpec("hybrid_cp", "original", "hybrid",
             description="hybrid CP only (original packing): short documents whole on one rank"),
    ModeSpec("wlb_hybrid", "wlb", "adaptive", variable_length=True,
             cp_candidates=ADAPTIVE_CANDIDATES,
             description="WLB-LLM with adaptive CP choosing among per-sequence, per-document, hybrid"),
    ModeSpec("varlen_packing", "wlb", "per_sequence", variable_length=True,
             description="variable-length packing with outlier delay only"),
    ModeSpec("varlen_no_delay", "wlb", "per_sequence", outlier_delay=False, variable_length=True,
             description="variable-length packing without outlier delay"),
    ModeSpec("wlb_no_delay", "wlb", "adaptive", outlier_delay=False, variable_length=True,
             description="WLB-LLM without outlier delay"),
    ModeSpec("wlb_paper", "wlb_paper", "adaptive", variable_length=True,
             description="WLB-LLM with the paper's Algorithm 1 as published"),
    ModeSpec("plain_4d_torchtitan", "original", "per_sequence", stream_cut=True,
             description="Plain-4D with TorchTitan's loader (stream cut at the context length)"),
    ModeSpec("per_doc_cp_torchtitan", "original", "per_document", stream_cut=True,
             description="per-document CP only, TorchTitan's loader"),
    ModeSpec("adaptive_cp_torchtitan", "original", "adaptive", stream_cut=True,
             description="adaptive CP only, TorchTitan's loader"),
)}  # fmt: skip

REQUIRED_MODES = ("plain_4d", "fixed_4d", "wlb")


def get_mode(name: str) -> ModeSpec:
    """A mode by name, with a clear error listing the accepted names."""
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; accepted: {', '.join(MODES)}")
    return MODES[name]
