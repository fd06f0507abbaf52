"""The train spec's dataloader: documents -> packing -> micro-batch tensors, as torchdata nodes
(docs/data.md). Its state carries the data fingerprint, so that a resume under settings that change
which documents each step trains is refused, naming the setting.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torchdata.nodes import BaseNode, Loader, Prefetcher
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.config import JobConfig

from torchtitan_wlb.config import ConfigError
from torchtitan_wlb.cost_fit import CostModelSchedule
from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.data.collate import MicroBatchNode
from torchtitan_wlb.data.documents import DocumentNode
from torchtitan_wlb.data.indexed import (
    INDEXED,
    IndexedCorpus,
    IndexedDocumentNode,
    check_corpus_tokenizer,
)
from torchtitan_wlb.data.sources import TextSource
from torchtitan_wlb.data.tokenizer import tokenizer_record
from torchtitan_wlb.data.wlb_node import WLBPackingNode
from torchtitan_wlb.packing import Packer, PackingConfig, build_packer, packing_config

FINGERPRINT_KEY = "fingerprint"

# The [wlb.advanced] packing knobs, which PackingConfig takes by the same names; each decides which
# documents each step trains (the solver's time limit does not: reaching it stops the run).
PACKING_KNOBS = (
    "adaptive_max_delay_steps",
    "delay_target",
    "balance_target",
    "release_slack",
    "read_ahead_steps",
    "packing_window",
    "solver_node_limit",
)


class WLBDataLoader(BaseDataLoader):
    """A stateful loader over a torchdata node graph, checkpointed per DP rank with
    :func:`data_fingerprint`; ``packer`` lets :meth:`accounting` read pending documents out of a
    state; ``cost_schedule``: the online cost model's, written by the trainer's fitter."""

    def __init__(
        self,
        root: BaseNode,
        dp_rank: int,
        dp_world_size: int,
        *,
        fingerprint: dict[str, Any] | None = None,
        packer: Packer | None = None,
        cost_schedule: CostModelSchedule | None = None,
    ) -> None:
        self.dp_rank = dp_rank
        self.cost_schedule = cost_schedule
        self.dp_world_size = dp_world_size
        self.fingerprint = dict(fingerprint or {"DP degree": dp_world_size})
        self._rank_id = f"dp_rank_{dp_rank}"
        self._root = root
        self._packer = packer
        self._loader = Loader(root, restart_on_stop_iteration=False)

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        return iter(self._loader)

    def state_dict(self) -> dict[str, Any]:
        return {
            self._rank_id: pickle.dumps(self._loader.state_dict()),
            "world_size": self.dp_world_size,
            FINGERPRINT_KEY: json.dumps(self.fingerprint, sort_keys=True),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if state_dict["world_size"] != self.dp_world_size:
            raise ConfigError(
                f"resume refused: the dataloader checkpoint was written with DP degree "
                f"{state_dict['world_size']}, this run has {self.dp_world_size}; the plan needs it"
            )
        saved = state_dict.get(FINGERPRINT_KEY)
        if saved is not None:
            check_fingerprint(json.loads(saved), self.fingerprint, "the checkpoint")
        if self._rank_id not in state_dict:
            raise ValueError(
                f"dataloader checkpoint has no state for {self._rank_id} "
                f"(keys: {sorted(k for k in state_dict if k.startswith('dp_rank_'))})"
            )
        # A fresh Loader: torchdata's (0.11) ignores a loaded state when state_dict() was called
        # before the first iter(), which TorchTitan's checkpointer does (for its load template).
        self._loader = Loader(self._root, restart_on_stop_iteration=False)
        self._loader.load_state_dict(pickle.loads(state_dict[self._rank_id]))

    def accounting(self) -> tuple[list[int], int | None]:
        """``(pending ids, documents produced or None)`` as of the last micro-batch handed out, read
        from the loader's state (what a checkpoint now would restore), not the prefetch thread."""
        state = self._loader.state_dict()
        pending: list[int] = []
        if self._packer is not None:
            name = self._packer.name
            saved = _find_state(state, lambda d: d.get("packer") == name and "step" in d)
            if saved is not None:
                scratch = build_packer(name, self._packer.config, self._packer.cost_model)
                scratch.load_state_dict(saved)
                pending = sorted(scratch.pending().ids.tolist())
        documents = _find_state(state, lambda d: "next_doc_id" in d)
        return pending, None if documents is None else int(documents["next_doc_id"])


def _find_state(state: Any, match: Callable[[dict], bool]) -> dict | None:
    """The first dict in a nested torchdata state (depth first) that ``match`` accepts."""
    if isinstance(state, dict):
        if match(state):
            return state
        state = list(state.values())
    for value in state if isinstance(state, (list, tuple)) else ():
        found = _find_state(value, match)
        if found is not None:
            return found
    return None


def packing_config_from_job(job_config: Any, num_micro_batches: int) -> PackingConfig:
    """The packers' configuration for this job (N micro-batches per step across DP ranks).
    Training bounds the solver by work, not time: every rank must compute the same plan."""
    wlb = job_config.wlb
    return packing_config(
        wlb.packing,
        num_micro_batches,
        job_config.training.seq_len,
        smax=wlb.micro_batch_max_len or None,
        queue_thresholds=wlb.queue_thresholds or None,
        max_delay_steps=wlb.max_delay_steps,
        solver_time_limit_s=wlb.advanced.solver_time_limit_s,
        **{name: getattr(wlb.advanced, name) for name in PACKING_KNOBS},
    )


def data_fingerprint(
    job_config: JobConfig, dp_world_size: int, cost_model: CostModel | None
) -> dict[str, Any]:
    """Every setting that decides which documents each step trains, by its config name, with
    resolved values (``S_max``, ``max_doc_len``) so that spelling a default out is no change."""
    wlb = job_config.wlb
    training = job_config.training
    n = micro_batches_per_step(job_config, dp_world_size)
    fp: dict[str, Any] = {
        "[wlb.advanced] loader": wlb.advanced.loader,
        "[training] dataset": training.dataset,
        "[training] dataset_path": training.dataset_path or "",
        "[model] hf_assets_path (tokenizer)": job_config.model.hf_assets_path or "",
        "[training] seq_len": training.seq_len,
        "DP degree": dp_world_size,
        "[training] global_batch_size (micro-batches per step)": n,
    }
    if wlb.advanced.loader != "documents":
        return fp
    smax = wlb.micro_batch_max_len
    if cost_model is not None:  # resolved, so that spelling the default out is no change
        smax = build_packer(wlb.packing, packing_config_from_job(job_config, n), cost_model).cap
    fp |= {
        "[wlb.advanced] text_field": wlb.advanced.text_field,
        "[wlb] shuffle_seed": wlb.shuffle_seed,
        "[wlb.advanced] max_doc_len": wlb.advanced.max_doc_len or training.seq_len,
        "[wlb] long_doc_policy": wlb.long_doc_policy,
        "[wlb] packing": wlb.packing,
        "[wlb] micro_batch_max_len (S_max)": smax,
        "[wlb] queue_thresholds": list(wlb.queue_thresholds),
        "[wlb] max_delay_steps": wlb.max_delay_steps,
        **{f"[wlb.advanced] {k}": getattr(wlb.advanced, k) for k in PACKING_KNOBS},
    }
    if wlb.cost_model == "online":
        fp["[wlb.online] warmup/window/holdout/interval/apply_lag_steps (cost_model = online)"] = [
            getattr(wlb.online, f"{k}_steps")
            for k in ("warmup", "window", "holdout", "interval", "apply_lag")
        ]
    if wlb.cost_model == "online" and not wlb.cost_profile:
        # Before the cost model's line, so that a refusal names the setting (in checkpoints since).
        fp["[wlb.online] initial_attn_scale"] = wlb.online.initial_attn_scale
    if cost_model is not None:
        fp["cost model W(d) = a*d^2 + b*d (model flavor, TP, CP, [wlb] cost_model)"] = (
            f"a={cost_model.attn_coef:.9g}, b={cost_model.linear_coef:.9g}"
        )
    return fp


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Refuse a resume whose data settings differ from those ``saved`` in ``where``, naming the
    first; settings missing on either side (an older checkpoint) are skipped."""
    changed = [k for k in current if k in saved and saved[k] != current[k]]
    if not changed:
        return
    k = changed[0]
    more = f" (and {len(changed) - 1} more: {', '.join(changed[1:])})" if changed[1:] else ""
    raise ConfigError(
        f"resume refused: {k} was {saved[k]!r} when {where} was written, now {current[k]!r}"
        f"{more}; it changes which documents each step trains. Resume with the old value, or "
        "start a new run in another [job] dump_folder"
    )


def text_source_from_config(job_config: JobConfig) -> TextSource:
    """The document source named by ``[training] dataset`` / ``dataset_path``."""
    training = job_config.training
    return TextSource(
        training.dataset, training.dataset_path or "", job_config.wlb.advanced.text_field
    )


def micro_batches_per_step(job_config: JobConfig, dp_world_size: int) -> int:
    """N: micro-batches per optimizer step across all DP ranks (one packed sequence each)."""
    global_batch = job_config.training.global_batch_size
    return global_batch if global_batch > 0 else dp_world_size


def build_document_node(job_config: JobConfig, tokenizer: Any) -> BaseNode:
    """The document stream of ``[training] dataset``: texts tokenized as they are read, or an
    indexed corpus's lengths (its tokens read by the packing node for this rank's micro-batches)."""
    wlb = job_config.wlb
    if job_config.training.dataset == INDEXED:
        corpus = IndexedCorpus(job_config.training.dataset_path or "")
        check_corpus_tokenizer(corpus, tokenizer_record(job_config.model.hf_assets_path or ""))
        return IndexedDocumentNode(
            corpus,
            max_doc_len=wlb.advanced.max_doc_len or job_config.training.seq_len,
            policy=wlb.long_doc_policy,
            epochs=wlb.epochs,
            shuffle_seed=wlb.shuffle_seed,
            vocab_size=tokenizer.get_vocab_size(),
        )
    return DocumentNode(
        source=text_source_from_config(job_config),
        tokenizer=tokenizer,
        max_doc_len=wlb.advanced.max_doc_len or job_config.training.seq_len,
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
    """TrainSpec.build_dataloader_fn of ``llama3_wlb`` (``cost_model``: bound by the train spec)."""
    wlb = job_config.wlb
    if wlb.advanced.loader == "torchtitan":
        from torchtitan.hf_datasets.text_datasets import build_text_dataloader

        return build_text_dataloader(
            dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=tokenizer, job_config=job_config
        )
    if job_config.training.local_batch_size != 1:
        raise ValueError(
            f"[training] local_batch_size = {job_config.training.local_batch_size} must be 1 with "
            "document packing (set the micro-batches per step with [training] global_batch_size)"
        )
    if cost_model is None:
        raise ValueError("build_wlb_dataloader needs the job's cost model for document packing")
    schedule = None
    if wlb.cost_model == "online":
        schedule = CostModelSchedule(cost_model, wlb.online_fit_config())
    n = micro_batches_per_step(job_config, dp_world_size)
    packer = build_packer(wlb.packing, packing_config_from_job(job_config, n), cost_model)
    documents = build_document_node(job_config, tokenizer)
    packed = WLBPackingNode(
        documents, packer, dp_rank=dp_rank, dp_degree=dp_world_size, schedule=schedule
    )
    root = MicroBatchNode(
        Prefetcher(packed, prefetch_factor=2), reset_positions=wlb.advanced.reset_positions
    )
    fingerprint = data_fingerprint(job_config, dp_world_size, cost_model)
    return WLBDataLoader(
        root, dp_rank, dp_world_size, fingerprint=fingerprint, packer=packer, cost_schedule=schedule
    )
