"""Write and read Megatron indexed corpora with megatron-core's own code (a test dependency).

    python tests/megatron_corpora.py DIR

``DIR/input.npz`` holds, per corpus NAME, ``NAME.tokens`` (all tokens), ``NAME.seq_lens`` (tokens
per sequence), ``NAME.doc_seqs`` (sequences per document) and ``NAME.dtype`` (a NumPy dtype name):
each is written to ``DIR/NAME.{bin,idx}`` by megatron-core's ``IndexedDatasetBuilder``, one
``add_item`` per sequence and ``end_document`` per document. ``DIR/input.npz``'s ``read`` (a list of
prefixes) names corpora written by other code: each is read back by megatron-core's
``IndexedDataset`` into ``DIR/read.npz`` (``PREFIX.tokens``, ``.seq_lens``, ``.doc_idx``,
``.dtype``). A separate process because megatron-core imports for about ten seconds.
"""

import sys
import warnings

import numpy as np


def main(folder: str) -> None:
    warnings.simplefilter("ignore")
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    spec = np.load(f"{folder}/input.npz", allow_pickle=False)
    names = sorted({k.split(".")[0] for k in spec.files if k != "read"})
    for name in names:
        dtype = np.dtype(str(spec[f"{name}.dtype"])).type
        builder = IndexedDatasetBuilder(f"{folder}/{name}.bin", dtype=dtype)
        tokens, seq_lens = spec[f"{name}.tokens"], spec[f"{name}.seq_lens"]
        bounds = np.concatenate([[0], np.cumsum(seq_lens)])
        seq = 0
        for count in spec[f"{name}.doc_seqs"].tolist():
            for s in range(seq, seq + count):
                builder.add_item(
                    torch.from_numpy(tokens[bounds[s] : bounds[s + 1]].astype(np.int64))
                )
            seq += count
            builder.end_document()
        builder.finalize(f"{folder}/{name}.idx")
    out = {}
    for prefix in spec["read"].tolist() if "read" in spec.files else []:
        ds = IndexedDataset(prefix, mmap=True)
        seqs = [ds[i] for i in range(len(ds))]
        out[f"{prefix}.tokens"] = np.concatenate(seqs) if seqs else np.zeros(0)
        out[f"{prefix}.seq_lens"] = np.asarray(ds.sequence_lengths)
        out[f"{prefix}.doc_idx"] = np.asarray(ds.document_indices)
        out[f"{prefix}.dtype"] = np.asarray(np.dtype(ds.index.dtype).name)
    np.savez(f"{folder}/read.npz", **out)


if __name__ == "__main__":
    main(sys.argv[1])
