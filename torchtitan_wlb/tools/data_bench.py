"""Data benchmark: what one rank's data node reads and spends per step, by DP degree.

    python -m torchtitan_wlb.tools.data_bench --dataset-path outputs/data_bench/longtail \\
        --make-corpus longtail --dp 1,8 --steps 3 --json
    python -m torchtitan_wlb.tools.data_bench --dataset-path outputs/data_bench/longtail \\
        --dp 1,8,64,512 --context-len 131072 --micro-batches 8 --steps 5 --json

The packing plan is global, so DP rank 0's data node at each DP degree is every rank's cost: it
packs ``micro-batches x DP`` micro-batches a step with "wlb" (the 7B model's analytic cost model)
and keeps its own ``micro-batches``. Two sources of the same documents: the indexed corpus at
``--dataset-path`` (lengths from the index, this rank's tokens from the ``.bin``) and the same
documents as jsonl text (every document read and tokenized by every rank). A corpus smaller than
a step needs is cycled, in a new seeded order each pass (the text in its order). ``--make-corpus``
first writes a corpus of synthetic ASCII text whose documents have the lengths of a generator (or a
lengths file), with ``tools.pretokenize``. Every figure and key: docs/data.md.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from torchtitan_wlb import workloads
from torchtitan_wlb.cost_model import CostModel
from torchtitan_wlb.data.sources import DataError, TextSource
from torchtitan_wlb.models.catalogue import get_model
from torchtitan_wlb.packing import build_packer, packing_config
from torchtitan_wlb.tools import pretokenize
from torchtitan_wlb.tools.cli import ToolParser, json_text, progress

# The data nodes import torchdata and TorchTitan (seconds): imported by ``run``, so that --help
# and a bad argument answer at once.

TEXT_BUDGET_S = 180.0
"""A text-source DP degree is skipped (and the larger ones) when the previous degree's time,
scaled by the DP ratio, predicts more than this many seconds: it grows with DP."""

SHUFFLE_SEED = 0
"""The indexed corpus's order: a seeded permutation per pass (``[wlb] shuffle_seed``)."""


def _counting_document_node() -> type:
    """The text source's document node, counting the characters it reads (the synthetic text is
    ASCII: one byte each)."""
    from torchtitan_wlb.data.documents import DocumentNode

    class CountingDocumentNode(DocumentNode):
        text_bytes = 0

        def _pieces(self, index: int, text: str) -> list[np.ndarray]:
            self.text_bytes += len(text)
            return super()._pieces(index, text)

    return CountingDocumentNode


def make_corpus(prefix: str, lengths: np.ndarray) -> str:
    """Write ``PREFIX.jsonl``: one document of synthetic ASCII words per length (in byte tokens,
    BOS and EOS included); return its path."""
    rng = np.random.default_rng(0)
    longest = int(lengths.max())
    arena = rng.integers(97, 123, size=2 * longest + 1024, dtype=np.uint8)
    arena[rng.random(arena.size) < 0.17] = 32  # spaces: words of about six letters
    text = arena.tobytes().decode("ascii")
    path = f"{prefix}.jsonl"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="ascii") as f:
        for n in np.maximum(lengths - 2, 1).tolist():
            start = int(rng.integers(0, longest + 1024))
            f.write(json.dumps({"text": text[start : start + n]}) + "\n")
    return path


def decode_corpus(corpus: Any, path: str) -> None:
    """The corpus's documents as jsonl text, decoded with the byte tokenizer (BOS/EOS dropped)."""
    record = corpus.record() or {}
    if record.get("tokenizer") != "bytes":
        raise DataError(
            f"{corpus.prefix}: the text comparison decodes the corpus with the built-in byte "
            "tokenizer, and this corpus does not record it (make one with --make-corpus)"
        )
    with open(path, "w", encoding="utf-8") as f:
        for doc in range(corpus.num_docs):
            ids = np.empty(int(corpus.doc_lens[doc]), np.int32)
            corpus.read_into(doc, 0, ids)
            text = ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
            f.write(json.dumps({"text": text}) + "\n")


def run_pretokenize(prefix: str, jsonl: str) -> dict[str, Any]:
    """``tools.pretokenize`` of ``jsonl`` into ``prefix`` with one worker: its figures."""
    args = SimpleNamespace(prefix=prefix, dataset="jsonl", dataset_path=jsonl, text_field="text",
                           hf_assets_path="", max_doc_len=0, long_doc_policy="split",
                           workers=1)  # fmt: skip
    return pretokenize.pretokenize(args)


def _packer(dp: int, args: Any) -> Any:
    cost = CostModel.from_model_dims(**get_model("7B").dims())
    return build_packer(
        "wlb", packing_config("wlb", args.micro_batches * dp, args.context_len), cost
    )


def bench_source(source: Any, dp: int, args: Any, read: Any) -> dict[str, Any]:
    """DP rank 0's data node over ``source`` for ``args.steps`` steps after a first one (which
    also fills the read-ahead); ``read()``: the bytes read so far."""
    from torchtitan_wlb.data.wlb_node import WLBPackingNode

    node = WLBPackingNode(source, _packer(dp, args), dp_rank=0, dp_degree=dp)
    node.reset()
    cpu, wall, plan, read_bytes, docs = [], [], [], [], []
    for _ in progress(range(args.steps + 1), desc=f"DP {dp}", unit="step"):
        bytes0, docs0 = read(), source.next_doc_id
        t0, c0 = time.perf_counter(), time.thread_time()
        step = next(node)
        cpu.append((time.thread_time() - c0) * 1e3)
        wall.append(time.perf_counter() - t0)
        plan.append(float(step["stats"]["pack_ms"]))
        read_bytes.append(read() - bytes0)
        docs.append(source.next_doc_id - docs0)
    steady = slice(1, None)
    return {
        "dp": dp,
        "read_bytes": int(np.mean(read_bytes[steady])),
        "index_bytes": int(4 * np.mean(docs[steady])),
        "docs_per_step": float(np.mean(docs[steady])),
        "cpu_ms": {
            "mean": round(float(np.mean(cpu[steady])), 2),
            "p95": round(float(np.percentile(cpu[steady], 95)), 2),
        },
        "plan_ms": round(float(np.mean(plan[steady])), 2),
        "first_step_cpu_ms": round(cpu[0], 2),
        "wall_s": round(float(sum(wall)), 3),
    }


def bench_indexed(prefix: str, dp: int, args: Any) -> dict[str, Any]:
    from torchtitan_wlb.data.indexed import IndexedCorpus, IndexedDocumentNode

    corpus = IndexedCorpus(prefix)
    source = IndexedDocumentNode(
        corpus, args.context_len, epochs=0, shuffle_seed=SHUFFLE_SEED, vocab_size=None
    )
    return bench_source(source, dp, args, lambda: corpus.read_bytes)


def bench_text(jsonl: str, dp: int, args: Any) -> dict[str, Any]:
    from torchtitan_wlb.data.tokenizer import ByteTokenizer

    source = _counting_document_node()(TextSource("jsonl", jsonl), ByteTokenizer(),
                                       args.context_len, epochs=0)  # fmt: skip
    out = bench_source(source, dp, args, lambda: source.text_bytes)
    out["index_bytes"] = None  # no index: the lengths are known once the text is tokenized
    return out


def run(args: Any) -> dict[str, Any]:
    """Every figure of the JSON object (docs/data.md)."""
    from torchtitan_wlb.data.indexed import IndexedCorpus

    prefix = args.dataset_path
    with tempfile.TemporaryDirectory() as tmp:
        if args.make_corpus:
            spec = args.make_corpus
            if os.path.isfile(spec):
                lengths = workloads.load_lengths(spec)[: args.documents]
            else:
                lengths = workloads.generate(spec, args.documents, args.context_len)
            jsonl = make_corpus(prefix, np.maximum(lengths, 3))
            made = run_pretokenize(prefix, jsonl)
        else:
            jsonl = os.path.join(tmp, "text.jsonl")
            decode_corpus(IndexedCorpus(prefix), jsonl)
            made = run_pretokenize(os.path.join(tmp, "again"), jsonl)
        corpus = IndexedCorpus(prefix)
        indexed, text, skipped = [], [], []
        last: tuple[int, float] | None = None
        for dp in args.dp:
            indexed.append(bench_indexed(prefix, dp, args))
            estimate = None if last is None else last[1] * dp / last[0]
            if estimate is not None and (estimate > TEXT_BUDGET_S or skipped):
                skipped.append({"dp": dp, "estimated_s": round(estimate, 1)})
                continue
            text.append(bench_text(jsonl, dp, args))
            last = (dp, text[-1]["wall_s"])
    return {
        "context_len": args.context_len,
        "micro_batches": args.micro_batches,
        "steps": args.steps,
        "corpus": {
            "prefix": prefix,
            "documents": corpus.num_docs,
            "tokens": int(corpus.doc_lens.sum()),
            "dtype": corpus.dtype.name,
        },  # fmt: skip
        "pretokenize": {
            "tokens_per_s_per_worker": made["tokens_per_s_per_worker"],
            "workers": made["workers"],
            "tokens": made["tokens"],
        },  # fmt: skip
        "indexed": indexed,
        "text": text,
        "text_skipped": skipped,
    }


def _dp_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise ValueError
    return values


def parser() -> ToolParser:
    p = ToolParser.from_doc("torchtitan_wlb.tools.data_bench", __doc__)
    p.add_argument("--dataset-path", required=True, help="PREFIX of the indexed corpus")
    p.add_argument("--dp", type=_dp_list, default=[1, 8, 64, 512],
                   help="DP degrees, comma-separated (default 1,8,64,512)")  # fmt: skip
    p.add_argument("--context-len", type=int, default=131072)
    p.add_argument("--micro-batches", type=int, default=8, help="per DP rank (N)")
    p.add_argument("--steps", type=int, default=5, help="measured steps, after a first one")
    p.add_argument("--make-corpus", default="", metavar="GENERATOR|LENGTHS_FILE",
                   help="first write a synthetic corpus at --dataset-path with these document "
                   f"lengths (generators: {', '.join(workloads.GENERATORS)})")  # fmt: skip
    p.add_argument("--documents", type=int, default=2000, help="documents of --make-corpus")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    for name in ("context_len", "micro_batches", "steps", "documents"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} = {getattr(args, name)} must be >= 1")
    if args.context_len < 2:
        p.error(f"--context-len = {args.context_len} must be >= 2")
    try:
        result = run(args)
    except (DataError, ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json_text(result))
        return 0
    for kind in ("indexed", "text"):
        for r in result[kind]:
            print(f"{kind:8s} DP {r['dp']:4d}: read {r['read_bytes'] / 2**20:9.1f} MiB/step, "
                  f"CPU {r['cpu_ms']['mean']:8.1f} ms (p95 {r['cpu_ms']['p95']:.1f}), "
                  f"plan {r['plan_ms']:.1f} ms, {r['docs_per_step']:.0f} documents")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
