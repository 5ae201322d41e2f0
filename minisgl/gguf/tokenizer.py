"""The tokenizer a .gguf file holds in its `tokenizer.ggml.*` metadata, read through transformers' GGUF
support and saved as a Hugging Face tokenizer."""

from __future__ import annotations

import os
from typing import Any

from .reader import field


def has_tokenizer(reader: Any) -> bool:
    """Whether the file holds a tokenizer (files written for tests may hold none)."""
    return field(reader, "tokenizer.ggml.model") is not None


def load_tokenizer(gguf_path: str) -> Any:
    """The file's tokenizer as a transformers tokenizer (its vocabulary, merges and chat template)."""
    from transformers import AutoTokenizer

    folder, fname = os.path.split(os.path.abspath(gguf_path))
    return AutoTokenizer.from_pretrained(folder, gguf_file=fname)
