"""GGUF files, one concept per module: `reader` (the gguf package's reader, metadata by key), `names`
(llama.cpp's tensor names -> Hugging Face's), `config` (the HF config from the metadata), `tokenizer`
(the tokenizer from the metadata), `model_dir` (a file as a cached HF model directory: as stored, or
converted to float32), `blocks` (GGML block types and their reference dequantization), `stored` (a weight
kept in its blocks), `tensors` (the file's weights as stored, in HF names and row order).

Loading them into a model is models/stored_weights.py; multiplying by them, kernel/stored.py."""

from __future__ import annotations

from .stored import StoredPart, StoredWeight

__all__ = ["StoredPart", "StoredWeight"]
