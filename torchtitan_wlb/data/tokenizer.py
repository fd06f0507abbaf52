"""Tokenizers: an offline byte-level one (the default) and TorchTitan's Hugging Face one.

Bytes need no download or vocabulary file, encode any text losslessly and keep documents long in
tokens, which makes attention imbalance visible at small scale.
"""

from __future__ import annotations

import hashlib
import os

from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer
from torchtitan.config import JobConfig

from torchtitan_wlb.config import ConfigError

# TorchTitan's JobConfig default for [model] hf_assets_path: not a user choice.
_TORCHTITAN_DEFAULT_ASSETS = "./tests/assets/tokenizer"


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as tokens 0..255, plus BOS (256), EOS (257) and PAD (258); the vocabulary
    size is rounded up to 264, a multiple of 8, for an aligned embedding table."""

    def __init__(self) -> None:
        super().__init__()
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return 264


def build_wlb_tokenizer(job_config: JobConfig) -> BaseTokenizer:
    """The train spec's tokenizer: TorchTitan's HuggingFaceTokenizer for ``[model]
    hf_assets_path``, ByteTokenizer when it is empty or TorchTitan's placeholder default; a path
    without ``tokenizer.json`` is an error, not a silent fallback."""
    path = job_config.model.hf_assets_path
    if path in ("", _TORCHTITAN_DEFAULT_ASSETS):
        return ByteTokenizer()
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ConfigError(
            f"[model] hf_assets_path = {path!r} has no tokenizer.json; point it at a Hugging Face "
            f'tokenizer directory, or leave it unset ("") for the built-in byte tokenizer'
        )
    return HuggingFaceTokenizer(path)


def tokenizer_record(hf_assets_path: str) -> dict[str, str]:
    """What identifies the tokenizer of ``[model] hf_assets_path``: "bytes" for the built-in one,
    else the SHA-256 of its ``tokenizer.json``. A pre-tokenized corpus records it; a run whose
    tokenizer has another record is refused (its ids would mean other text)."""
    if hf_assets_path in ("", _TORCHTITAN_DEFAULT_ASSETS):
        return {"tokenizer": "bytes"}
    with open(os.path.join(hf_assets_path, "tokenizer.json"), "rb") as f:
        return {"tokenizer": "huggingface", "sha256": hashlib.sha256(f.read()).hexdigest()}
