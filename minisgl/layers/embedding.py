"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl import kernel
from minisgl.distributed import all_gather_last_dim, all_reduce, get_tp_info
from minisgl.gguf.stored import StoredWeight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.vocab_size = vocab_size
        self.shard = (vocab_size + tp.size - 1) // tp.size
        self.start = tp.rank * self.shard
        self.end = min(vocab_size, self.start + self.shard)
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden_size), requires_grad=False)

    def load_shard(
        self, name: str, loaded: torch.Tensor, part: int = 0, shard_rank: int | None = None
    ) -> None:
        rows = self.end - self.start
        self.weight.data[:rows].copy_(loaded[self.start : self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, StoredWeight):  # one rank only: rows dequantized on lookup
            return kernel.stored.embedding(input_ids, self.weight)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = h W^T over this rank's vocab slice, gathered to the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = kernel.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        return all_gather_last_dim(logits)[..., : self.vocab_size]
