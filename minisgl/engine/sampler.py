"""Sampling on the device: greedy, temperature, top-k and top-p, chosen per request within one batch.

Random draws use the exponential trick (argmax of p / E with E ~ Exp(1) is a sample from p), so a request
with a `seed` draws its noise from its own generator keyed by (seed, position): the same seed gives the
same tokens whatever else shares the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl import kernel
from minisgl.core import Req


@dataclass
class SamplingInfo:
    all_greedy: bool
    greedy_mask: torch.Tensor | None = None  # [S] bool
    temperatures: torch.Tensor | None = None  # [S, 1]
    top_k: torch.Tensor | None = None  # [S] (vocab size where unlimited), None when nobody limits
    top_p: torch.Tensor | None = None  # [S], None when nobody limits
    seeded: list[tuple[int, int, int]] | None = None  # (row, seed, position)
    top_logprobs: int = -1  # -1: no logprobs; 0: only the chosen token's; k: also the top k

    @classmethod
    def build(
        cls, reqs: list[Req], positions: list[int], vocab_size: int, device: torch.device
    ) -> SamplingInfo:
        params = [r.sampling_params for r in reqs]
        want = [p.top_logprobs if p.logprobs else -1 for p in params]
        top_logprobs = max(want) if want else -1
        if all(p.is_greedy for p in params):
            return cls(all_greedy=True, top_logprobs=top_logprobs)
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        info = cls(
            all_greedy=False,
            greedy_mask=torch.tensor(greedy, dtype=torch.bool).to(device, non_blocking=True),
            temperatures=torch.tensor(temps, dtype=torch.float32).to(device, non_blocking=True)[:, None],
            top_logprobs=top_logprobs,
        )
        if any(p.top_k > 0 for p in params):
            ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
            info.top_k = torch.tensor(ks, dtype=torch.int64).to(device, non_blocking=True)
        if any(p.top_p < 1.0 for p in params):
            info.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(
                device, non_blocking=True
            )
        seeded = [
            (i, p.seed, pos)
            for i, (p, pos) in enumerate(zip(params, positions))
            if p.seed is not None and not p.is_greedy
        ]
        info.seeded = seeded or None
        return info


def _filter_probs(
    probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Zero out the tokens outside each row's top-k and top-p (the most likely token always stays)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    if top_k is not None:  # top-k first, then top-p over what is left (renormalised), as vLLM does
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        sorted_p = sorted_p.masked_fill(rank >= top_k[:, None], 0.0)
    if top_p is not None:
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the strictly more likely tokens
        drop = before >= top_p[:, None] * sorted_p.sum(dim=-1, keepdim=True)
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sample(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        """logits [S, V] -> token ids [S] (int32), on the device, with no host synchronisation
        (except to draw seeded noise, one generator per seeded request)."""
        if info.all_greedy:
            return kernel.argmax(logits)
        probs = torch.softmax(logits.float() / info.temperatures, dim=-1)
        if info.top_k is not None or info.top_p is not None:
            probs = _filter_probs(probs, info.top_k, info.top_p)
        noise = torch.empty_like(probs).exponential_()
        for row, seed, pos in info.seeded or ():
            gen = torch.Generator(device=probs.device).manual_seed((seed * 1_000_003 + pos) % (2**63))
            noise[row] = torch.empty_like(noise[row]).exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        greedy = logits.argmax(dim=-1)
        return torch.where(info.greedy_mask, greedy, sampled).to(torch.int32)

    @staticmethod
    def logprobs(
        logits: torch.Tensor, ids: torch.Tensor, top: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probabilities under the model's raw distribution: of the chosen ids, and the top `top`."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(-1, ids.long()[:, None]).squeeze(-1)
        if top <= 0:
            return chosen, None, None
        vals, idx = logp.topk(top, dim=-1)
        return chosen, vals, idx.to(torch.int32)
