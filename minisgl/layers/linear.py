"""Tensor-parallel linear layers. Column-parallel layers shard the output dim, row-parallel ones the
input dim and all-reduce; merged layers (QKV, gate|up) hold several HF weights in one matrix so each
layer runs two large GEMMs instead of five."""

from __future__ import annotations

import torch
from torch import nn

from minisgl import kernel
from minisgl.distributed import all_reduce, get_tp_info


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}={a} is not divisible by the TP size {b}")
    return a // b


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (outputs) split across ranks; the output stays sharded.

    `output_sizes` lists the logical sub-matrices (one for a plain linear, q/k/v or gate/up for merged
    ones); each is sharded separately so rank r holds shard r of every part."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        shard_sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.input_size = input_size
        self.shard_sizes = shard_sizes or [_divide(s, tp.size, "output size") for s in output_sizes]
        self.offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def load_shard(
        self, name: str, loaded: torch.Tensor, part: int = 0, shard_rank: int | None = None
    ) -> None:
        """Copy HF weight `loaded` (the whole logical part) into this rank's slice of part `part`."""
        param = self.weight if name == "weight" else self.bias
        size = self.shard_sizes[part]
        rank = self.tp_rank if shard_rank is None else shard_rank
        src = loaded.narrow(0, rank * size, size)
        param.data.narrow(0, self.offsets[part], size).copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel.linear(x, self.weight, self.bias)

    def forward_prenorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The projection of a pre-norm block: h = x + residual (x when None), returns (self(norm(h)), h);
        the add and the RMSNorm run inside the projection's kernel at decode batch size 1."""
        return kernel.add_rms_norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix. KV heads are replicated when there are fewer than ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = get_tp_info()
        self.num_heads = _divide(num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        if num_kv_heads >= tp.size:
            _divide(num_kv_heads, tp.size, "num_key_value_heads")
        else:
            _divide(tp.size, num_kv_heads, "TP size over num_key_value_heads")
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, [], bias=bias, shard_sizes=[q, kv, kv])

    def load_shard(
        self, name: str, loaded: torch.Tensor, part: int = 0, shard_rank: int | None = None
    ) -> None:
        rank = self.tp_rank if part == 0 else self.tp_rank // self.kv_replicas
        super().load_shard(name, loaded, part, rank)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (inputs) split across ranks, then all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.input_shard = _divide(input_size, tp.size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_shard), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def load_shard(
        self, name: str, loaded: torch.Tensor, part: int = 0, shard_rank: int | None = None
    ) -> None:
        if name == "bias":  # added once, on the sum
            self.bias.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        self.weight.data.copy_(loaded.narrow(1, self.tp_rank * self.input_shard, self.input_shard))

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """gated: x is [gate | up] of a gated MLP and the input is silu(gate) * up (kernel.silu_and_mul)."""
        if gated:
            return all_reduce(kernel.silu_and_mul_linear(x, self.weight, self.bias))
        return all_reduce(kernel.linear(x, self.weight, self.bias))
