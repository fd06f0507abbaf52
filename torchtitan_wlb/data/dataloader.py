"""The train spec's dataloader: documents -> packing -> micro-batch tensors, as torchdata nodes.

    DocumentNode (texts -> tokenized documents, long-document policy)
      -> packing node (one global plan per optimizer step, this DP rank's micro-batches)
      -> Prefetcher (a background thread: packing stays off the training critical path)
      -> MicroBatchNode (one (input_dict, labels) per gradient-accumulation micro-batch)

``[wlb] loader = "torchtitan"`` instead returns TorchTitan's own concatenate-and-chop loader
unchanged (no document boundaries reach the model: full causal attention over each window).

The loader is checkpointed per DP rank, as TorchTitan's ``ParallelAwareDataloader`` does, so
TorchTitan's CheckpointManager saves and restores it with the rest of the training state.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import torch
from torchdata.nodes import BaseNode, Loader, Prefetcher
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.data.collate import MicroBatchNode
from torchtitan_wlb.data.documents import DocumentNode
from torchtitan_wlb.data.packing_node import build_packing_node
from torchtitan_wlb.data.sources import BUILTIN_NAME, TextSource


class WLBDataLoader(BaseDataLoader):
    """A stateful loader over a torchdata node graph, checkpointed per DP rank.

    Args:
        root: the last node of the graph (yields ``(input_dict, labels)``).
        dp_rank, dp_world_size: this rank's position in the data-parallel group; the saved state
            is keyed by DP rank, and restoring under another DP degree is refused (the global
            packing plan depends on it).
    """

    def __init__(self, root: BaseNode, dp_rank: int, dp_world_size: int) -> None:
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._rank_id = f"dp_rank_{dp_rank}"
        self._root = root
        self._loader = Loader(root, restart_on_stop_iteration=False)

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        return iter(self._loader)

    def state_dict(self) -> dict[str, Any]:
        return {
            self._rank_id: pickle.dumps(self._loader.state_dict()),
            "world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self._rank_id not in state_dict:
            raise ValueError(
                f"dataloader checkpoint has no state for {self._rank_id} "
                f"(keys: {sorted(k for k in state_dict if k.startswith('dp_rank_'))})"
            )
        if state_dict["world_size"] != self.dp_world_size:
            raise ValueError(
                f"dataloader checkpoint was written with DP degree {state_dict['world_size']}, "
                f"this run has {self.dp_world_size}: the packing plan depends on it, so resuming "
                "under another DP degree is not supported"
            )
        # A fresh Loader: torchdata's Loader (0.11) ignores a loaded state when state_dict() was
        # called before the first iter() -- which is exactly what TorchTitan's checkpointer does
        # (it asks for the state to build the load template). The old Loader's pre-created
        # iterator would then start from scratch.
        self._loader = Loader(self._root, restart_on_stop_iteration=False)
        self._loader.load_state_dict(pickle.loads(state_dict[self._rank_id]))


def text_source_from_config(job_config: JobConfig) -> TextSource:
    """The document source named by ``[training] dataset`` / ``dataset_path``."""
    kind = job_config.training.dataset
    path = job_config.training.dataset_path or ""
    return TextSource(kind=kind, path=path, text_field=job_config.wlb.text_field)


def micro_batches_per_step(job_config: JobConfig, dp_world_size: int) -> int:
    """N: micro-batches per optimizer step across all DP ranks (one packed sequence each)."""
    global_batch = job_config.training.global_batch_size
    return global_batch if global_batch > 0 else dp_world_size


def build_document_node(job_config: JobConfig, tokenizer: Any) -> DocumentNode:
    wlb = job_config.wlb
    return DocumentNode(
        source=text_source_from_config(job_config),
        tokenizer=tokenizer,
        max_doc_len=wlb.max_doc_len or job_config.training.seq_len,
        policy=wlb.long_doc_policy,
        epochs=wlb.epochs,
    )


def build_wlb_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: Any,
    job_config: JobConfig,
    cost_model: CostModel | None = None,
) -> BaseDataLoader:
    """TrainSpec.build_dataloader_fn of ``llama3_wlb``.

    ``cost_model`` is the workload model the packer balances; the train spec binds the one derived
    from the model flavor (``cost_model_for_job``).
    """
    wlb = job_config.wlb
    if wlb.loader == "torchtitan":
        from torchtitan.hf_datasets.text_datasets import build_text_dataloader

        return build_text_dataloader(
            dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=tokenizer, job_config=job_config
        )
    if job_config.training.local_batch_size != 1:
        raise ValueError(
            f"[training] local_batch_size = {job_config.training.local_batch_size}: with document "
            "packing every micro-batch is one packed sequence, so it must be 1 (set the number of "
            "micro-batches per step with [training] global_batch_size)"
        )
    if cost_model is None:
        raise ValueError("build_wlb_dataloader needs the job's cost model for document packing")
    documents = build_document_node(job_config, tokenizer)
    packed = build_packing_node(
        documents,
        job_config,
        num_micro_batches=micro_batches_per_step(job_config, dp_world_size),
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        cost_model=cost_model,
    )
    root = MicroBatchNode(
        Prefetcher(packed, prefetch_factor=2), reset_positions=wlb.reset_positions
    )
    logger.info(
        f"WLB data pipeline: dataset {job_config.training.dataset!r}, packing {wlb.packing!r}, "
        f"{micro_batches_per_step(job_config, dp_world_size)} micro-batches per step"
        + (" (built-in corpus)" if job_config.training.dataset == BUILTIN_NAME else "")
    )
    return WLBDataLoader(root, dp_rank=dp_rank, dp_world_size=dp_world_size)
