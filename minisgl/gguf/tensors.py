"""A .gguf file's weights as stored, in Hugging Face's names and row order: each tensor's rows of blocks
viewed in the memory-mapped file (nothing is dequantized or requantized).

llama.cpp's converter permutes the rows of a Llama q/k projection for its interleaved rotary; the rows
are put back in Hugging Face's order here (whole rows of blocks move)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from .names import NOT_WEIGHTS, hf_name
from .reader import field, open_gguf
from .stored import StoredPart


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (transformers' reverse_permute, on rows of any kind)."""
    n = rows.shape[0]
    idx = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)
    return rows[idx]


def iter_gguf(path: str, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, StoredPart]]:
    """(HF name, the tensor as stored: rows of blocks [n, row_bytes], n = 1 for a vector) per tensor."""
    reader = open_gguf(path)
    permute = field(reader, "general.architecture") == "llama"
    for t in reader.tensors:
        if t.name in NOT_WEIGHTS:
            continue
        name = hf_name(t.name)
        shape = [int(s) for s in t.shape]  # GGUF order: the contiguous dim first
        k, n = shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
        rows = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(n, -1))
        if permute and (".q_proj." in name or ".k_proj." in name):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            rows = _unpermute(rows, heads) if n > 1 else _unpermute(rows.view(k, -1), heads).view(1, -1)
        yield name, StoredPart(int(t.tensor_type), rows, n, k)
