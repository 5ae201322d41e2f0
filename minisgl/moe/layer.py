"""A sparse MoE layer: the router and the stacked expert weights of one decoder layer.

Tensor parallelism shards each expert's intermediate dimension across ranks; expert parallelism (ep_size
ranks of the TP group) places whole experts on each rank instead: E // ep_size each, the remainder one more
on each of the first ranks, as vLLM places them (5 experts over 2: 0-2 and 3-4). With both, rank r holds
the experts of EP rank r // (tp / ep), sharded tp / ep ways. Every rank sees every token (attention is tensor-
parallel, so its output is replicated): dispatch is each rank selecting the tokens routed to its experts,
and the combine is the all-reduce that sums the ranks' partial outputs, as after any row-parallel layer."""

from __future__ import annotations

import re

import torch
from torch import nn

from minisgl import kernel
from minisgl.distributed import all_reduce, get_tp_info
from minisgl.kernel import cpu
from minisgl.layers.context import get_global_ctx

# checkpoint names of each expert's projections (Qwen3-MoE / Mixtral) -> (stacked tensor, part of w13)
_EXPERT_PROJ = {
    "gate_proj": ("w13", 0),
    "w1": ("w13", 0),
    "up_proj": ("w13", 1),
    "w3": ("w13", 1),
    "down_proj": ("w2", 0),
    "w2": ("w2", 0),
}
EXPERT_WEIGHT = re.compile(r"^(?P<module>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}={a} is not divisible by {b}")
    return a // b


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """EP rank `ep_rank`'s experts: (first, count), contiguous; the first E % ep_size ranks hold one more."""
    base, extra = divmod(num_experts, ep_size)
    return ep_rank * base + min(ep_rank, extra), base + (ep_rank < extra)


class Router(nn.Module):
    """The gate: one logit per expert for each token, replicated on every rank."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def load_shard(
        self, name: str, loaded: torch.Tensor, part: int = 0, shard_rank: int | None = None
    ) -> None:
        self.weight.data.copy_(loaded)


class Experts(nn.Module):
    """This rank's experts stacked: w13 [E_local, 2 I_shard, H] (gate | up), w2 [E_local, H, I_shard]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        tp = get_tp_info()
        ep = tp.ep_size
        _divide(tp.size, ep, "the TP size (over the EP size)")
        moe_tp = tp.size // ep
        self.num_experts = num_experts
        if num_experts < ep:
            raise ValueError(f"num_experts={num_experts} is fewer than the EP size {ep}")
        self.expert_start, self.num_local = expert_range(num_experts, ep, tp.rank // moe_tp)
        self.shard = _divide(intermediate_size, moe_tp, "the expert intermediate size (over TP / EP)")
        self.shard_rank = tp.rank % moe_tp
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.shard, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, self.shard), requires_grad=False)
        self.loaded: set[tuple[int, str, int]] = set()  # (expert, tensor, part) seen in the checkpoint
        # GGUF experts read as stored (one rank, a CPU): per expert a StoredWeight of gate | up and of down
        # in place of w13 / w2, which are then never allocated
        self.stored: tuple[list, list] | None = None
        self.stored_desc: torch.Tensor | None = None  # the experts' C descriptors, where it reads every part

    def keep_stored(self, w13: list, w2: list) -> None:
        """Serve every expert from its blocks as stored: w13[e] (gate | up) and w2[e] are StoredWeights."""
        if self.num_local != self.num_experts or self.shard_rank or len(w13) != self.num_experts:
            raise ValueError("stored GGUF experts run on one rank; --weights-format float32 shards them")
        del self.w13, self.w2  # the float Parameters, never touched, so never resident
        self.stored = (w13, w2)
        # the C kernel's view (kernel/cpu moe_stored): per expert the parts of gate, up, down
        parts = [[*w13[e].parts, *w2[e].parts] for e in range(self.num_experts)]
        if all(len(p) == 3 and cpu.stored_type_supported(q.ggml_type) for p in parts for q in p):
            self.stored_desc = cpu.stored_experts([tuple(p) for p in parts])
        self.loaded |= {
            (e, n, p) for e in range(self.num_experts) for n, p in (("w13", 0), ("w13", 1), ("w2", 0))
        }

    def load_expert(self, expert: int, proj: str, loaded: torch.Tensor) -> None:
        """One expert's gate, up or down projection (HF layout [out, in]); other ranks' experts skipped."""
        if proj not in _EXPERT_PROJ or not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor experts.{expert}.{proj} has no place in the MoE layer")
        name, part = _EXPERT_PROJ[proj]
        self.loaded.add((expert, name, part))
        local = expert - self.expert_start
        if not 0 <= local < self.num_local:
            return
        if name == "w13":
            rows = loaded.narrow(0, self.shard_rank * self.shard, self.shard)
            self.w13.data[local].narrow(0, part * self.shard, self.shard).copy_(rows)
        else:
            self.w2.data[local].copy_(loaded.narrow(1, self.shard_rank * self.shard, self.shard))

    def load_shard(
        self, name: str, loaded: torch.Tensor, part: int = 0, shard_rank: int | None = None
    ) -> None:
        """All experts in one tensor (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])."""
        if name not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"checkpoint tensor experts.{name} has no place in the MoE layer")
        for e in range(self.num_experts):
            if name == "down_proj":
                self.load_expert(e, "down_proj", loaded[e])
            else:
                gate, up = loaded[e].chunk(2, dim=0)
                self.load_expert(e, "gate_proj", gate)
                self.load_expert(e, "up_proj", up)

    def missing(self) -> list[str]:
        """The expert projections the checkpoint did not provide."""
        want = {(e, n, p) for e in range(self.num_experts) for n, p in (("w13", 0), ("w13", 1), ("w2", 0))}
        return [f"experts.{e}.{n}[{p}]" for e, n, p in sorted(want - self.loaded)]


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse decoder layer: each token goes to its top_k experts (Qwen3-MoE, Mixtral)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Router(hidden_size, num_experts)
        self.experts = Experts(hidden_size, intermediate_size, num_experts)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module):
        """moe(norm(x + residual)) and the new residual x + residual (a LlamaMLP's contract)."""
        h, residual = norm(x, residual)
        backend = get_global_ctx().moe_backend
        weights, ids = backend.route(kernel.linear(h, self.gate.weight), self.top_k, self.renormalize)
        return all_reduce(backend.experts(h, self.experts, weights, ids)), residual
