"""Sampling on the device: greedy, temperature, min-p, top-k and top-p, chosen per request within one batch.

One op samples the whole batch (kernel.sample: a Triton kernel on a GPU, which a decode graph captures;
its torch reference elsewhere): thresholds instead of a sort for the filters, and the exponential trick
(argmax of p / E with E ~ Exp(1) is a sample from p) with E hashed from each row's keys and the token id.
A request with a `seed` keys its noise by (seed, position), so the same seed gives the same tokens whatever
else shares the batch; the other rows key theirs by a per-step seed from torch's generator and their row.

Before any of that, as vLLM orders it: `logit_bias`, then the repetition penalty over the prompt and the
output, then the frequency and presence penalties over the output. The token history comes from the
engine's token pool (row = the request's page-table row, positions [0, end) its known tokens), so counts
are built on the device every step for the penalised rows only, with nothing kept between steps: a
request's tokens enter the pool when its first token is sampled after admission (`load_history`), and
each step writes the token it samples. A batch whose requests set none of these pays nothing."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from minisgl import kernel
from minisgl.core import Req, SamplingParams
from minisgl.kernel import reference as kernel_ref


def _uses_history(p: SamplingParams) -> bool:
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0


def _scan(params: list[SamplingParams]) -> tuple[int, bool, bool]:
    """(the most top logprobs wanted, or -1; whether every row is greedy; whether some row sets a penalty
    or logit_bias), in one pass: this runs every step, and one loop costs less than three."""
    top, greedy, penalised = -1, True, False
    for p in params:
        if p.logprobs and p.top_logprobs > top:
            top = p.top_logprobs
        if greedy and p.temperature != 0.0 and p.top_k != 1:  # not SamplingParams.is_greedy, inlined
            greedy = False
        if not penalised and (
            p.logit_bias or p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
        ):
            penalised = True
    return top, greedy, penalised


@dataclass
class Penalties:
    """A batch's logit_bias and history penalties as device tensors, for the rows that set them."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (batch row, token id, bias) [B]
    rows: torch.Tensor | None = None  # [P] batch rows with a history penalty (None: no such row)
    # [3, P] int64: token-pool row, prompt length, end (the pool row's positions [0, end) are known)
    spans: torch.Tensor | None = None
    max_end: int = 0
    frequency: torch.Tensor | None = None  # [P, 1]; with presence, None when no row sets either
    presence: torch.Tensor | None = None  # [P, 1]
    repetition: torch.Tensor | None = None  # [P, 1], None when no row sets it
    history: list[tuple[int, list[int], int]] | None = None  # (pool row, token ids, end), host side

    @classmethod
    def build(
        cls, reqs: list[Req], positions: list[int], vocab_size: int, device: torch.device
    ) -> Penalties | None:
        """The penalties of a batch whose rows sample at `positions`, or None when no row sets any."""
        params = [r.sampling_params for r in reqs]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        rows = [i for i, p in enumerate(params) if _uses_history(p)]
        if not biased and not rows:
            return None
        pen = cls()
        if biased:
            pen.bias = _bias_tensors([params[i].logit_bias for i in biased], biased, vocab_size, device)
        if rows:
            sel = [params[i] for i in rows]
            ends = [positions[i] for i in rows]
            ints = [rows, [reqs[i].table_idx for i in rows], [reqs[i].prompt_len for i in rows], ends]
            packed = torch.tensor(ints, dtype=torch.int64).to(device, non_blocking=True)
            pen.rows, pen.spans, pen.max_end = packed[0], packed[1:], max(ends)
            pen.history = [(reqs[i].table_idx, reqs[i].token_ids, e) for i, e in zip(rows, ends)]
            floats = [[p.frequency_penalty, p.presence_penalty, p.repetition_penalty] for p in sel]
            freq, pres, rep = torch.tensor(floats, dtype=torch.float32).to(device, non_blocking=True).T
            if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in sel):
                pen.frequency, pen.presence = freq[:, None], pres[:, None]
            if any(p.repetition_penalty != 1.0 for p in sel):
                pen.repetition = rep[:, None]
        return pen

    def load_history(self, token_pool: torch.Tensor) -> None:
        """Write the known tokens of each penalised row into its token-pool row. Called when the rows
        sample their first token since admission (prefill), when the host's token list is exact and the
        pool row holds only what its earlier owners left there; one copy of the prompts per admission."""
        if not self.history:
            return
        tokens = np.concatenate([np.asarray(ids[:end], dtype=np.int32) for _, ids, end in self.history])
        ends = np.array([end for _, _, end in self.history], dtype=np.int64)
        pool_rows = np.repeat(np.array([row for row, _, _ in self.history], dtype=np.int64), ends)
        pos = np.arange(int(ends.sum()), dtype=np.int64) - np.repeat(np.cumsum(ends) - ends, ends)
        dev = token_pool.device
        index = torch.from_numpy(np.stack([pool_rows, pos])).to(dev, non_blocking=True)
        token_pool[index[0], index[1]] = torch.from_numpy(tokens).to(dev, non_blocking=True)

    def apply(self, logits: torch.Tensor, token_pool: torch.Tensor | None) -> torch.Tensor:
        """The processed logits [S, V] float32, a new tensor: the raw ones stay for the logprobs."""
        out = logits.to(torch.float32, copy=True)
        if self.bias is not None:
            rows, ids, values = self.bias
            out.index_put_((rows, ids), values, accumulate=True)
        if self.rows is not None:
            assert token_pool is not None, "history penalties read the token pool"
            out.index_copy_(0, self.rows, self._penalise(out.index_select(0, self.rows), token_pool))
        return out

    def _penalise(self, logits: torch.Tensor, token_pool: torch.Tensor) -> torch.Tensor:
        """Repetition, frequency and presence penalties on the penalised rows' logits [P, V]."""
        p, v = logits.shape
        pool_row, prompt_len, end = self.spans[:, :, None]
        hist = token_pool[pool_row[:, 0], : self.max_end].long()  # [P, max_end]
        pos = torch.arange(self.max_end, device=logits.device)
        known = (pos < end) & (hist < v)  # an id beyond the logits must not index out of bounds
        # masked-out positions count into a spare column v, dropped afterwards: no boolean indexing
        if self.repetition is not None:
            seen = torch.zeros(p, v + 1, dtype=torch.bool, device=logits.device)
            seen.scatter_(1, hist.masked_fill(~known, v), True)
            scale = torch.where(seen[:, :v], self.repetition, 1.0)
            logits = torch.where(logits > 0, logits / scale, logits * scale)
        if self.frequency is not None:
            output = known & (pos >= prompt_len)
            counts = torch.zeros(p, v + 1, dtype=torch.float32, device=logits.device)
            counts.scatter_add_(1, hist.masked_fill(~output, v), output.float())
            counts = counts[:, :v]
            logits = logits - self.frequency * counts - self.presence * (counts > 0)
        return logits


def _bias_tensors(
    biases: list[dict[int, float]], rows: list[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch row, token id, bias) of every logit_bias entry. Ids outside the vocabulary are dropped
    here so that they can never index out of bounds on the device (the API rejects them first)."""
    lens = [len(b) for b in biases]
    ids = np.fromiter(chain.from_iterable(biases), dtype=np.int64, count=sum(lens))
    values = np.fromiter(chain.from_iterable(b.values() for b in biases), dtype=np.float32, count=sum(lens))
    row_of = np.repeat(np.array(rows, dtype=np.int64), lens)
    keep = (ids >= 0) & (ids < vocab_size)
    index = torch.from_numpy(np.stack([row_of[keep], ids[keep]])).to(device, non_blocking=True)
    return index[0], index[1], torch.from_numpy(values[keep]).to(device, non_blocking=True)


def _wrap64(seed: int) -> int:
    """A seed of any size as the signed 64-bit integer with the same low 64 bits."""
    return (seed + 2**63) % 2**64 - 2**63


@dataclass
class SamplingInfo:
    """A batch's sampling inputs on the device: the per-row parameters of a batch that samples (`rows`,
    views of two packed tensors that a decode graph copies into its own), logprobs and penalties."""

    all_greedy: bool
    rows: kernel.SamplingRows | None = None  # None: every row greedy
    packed: tuple[torch.Tensor, torch.Tensor] | None = None  # [3, S] float32, [3, S] int64 behind `rows`
    top_logprobs: int = -1  # -1: no logprobs; 0: only the chosen token's; k: also the top k
    penalties: Penalties | None = None  # logit_bias and history penalties, None when no row sets any

    @property
    def greedy_mask(self) -> torch.Tensor | None:
        """[S] bool, the greedy rows of a batch that samples (None when every row is greedy)."""
        return None if self.rows is None else self.rows.temperature == 0

    @property
    def top_k(self) -> torch.Tensor | None:
        """[S] each row's top-k (the vocabulary size where unlimited)."""
        return None if self.rows is None else self.rows.top_k

    @classmethod
    def build(
        cls, reqs: list[Req], positions: list[int], vocab_size: int, device: torch.device
    ) -> SamplingInfo:
        """The sampling inputs of a batch whose rows sample at `positions` (a seeded row's noise depends on
        its seed and position alone)."""
        params = [r.sampling_params for r in reqs]
        top_logprobs, all_greedy, penalised = _scan(params)
        penalties = Penalties.build(reqs, positions, vocab_size, device) if penalised else None
        if all_greedy:
            # all_greedy: the argmax of the raw logits (inside the decode graph) is every row's token;
            # a penalised greedy row needs the argmax of its processed logits instead
            return cls(all_greedy=penalties is None, top_logprobs=top_logprobs, penalties=penalties)
        floats, ints, has_top_k, has_top_p = _pack(params, positions, vocab_size)
        f, i = _aligned_rows(floats, torch.float32, device), _aligned_rows(ints, torch.int64, device)
        return cls(
            all_greedy=False,
            rows=rows_of(f, i, None, has_top_k, has_top_p),
            packed=(f, i),
            top_logprobs=top_logprobs,
            penalties=penalties,
        )


def _aligned_rows(rows: list[list], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """rows as a [len(rows), n] view on device whose rows all start 16-byte aligned (the row stride is n
    rounded up to 4 elements). Triton specialises a kernel on whether each pointer argument is 16-byte
    aligned: unaligned rows at some batch sizes would compile the sampling kernels anew, for seconds, the
    first time such a batch samples."""
    n = len(rows[0])
    pad = [0] * (-n % 4)
    return torch.tensor([r + pad for r in rows], dtype=dtype).to(device, non_blocking=True)[:, :n]


def _pack(params: list[SamplingParams], positions: list[int], vocab_size: int):
    """([temperature, top_p, min_p], [top_k, seed, counter] as lists, whether a sampled row sets top-k,
    top-p), in one pass (this runs every step). A greedy row gets temperature 0; a seeded row's counter is
    its position."""
    temps, top_ps, min_ps, ks, seeds, counters = [], [], [], [], [], []
    has_top_k = has_top_p = False
    for i, (p, pos) in enumerate(zip(params, positions)):
        greedy = p.temperature == 0.0 or p.top_k == 1  # SamplingParams.is_greedy, inlined
        temps.append(0.0 if greedy else float(p.temperature))
        top_ps.append(float(p.top_p))
        min_ps.append(float(p.min_p))
        # a top_k beyond the vocabulary is no limit (and must not overflow the int64 tensor)
        ks.append(p.top_k if 0 < p.top_k < vocab_size else vocab_size)
        has_top_k = has_top_k or (not greedy and 0 < p.top_k < vocab_size)
        has_top_p = has_top_p or (not greedy and p.top_p < 1.0)
        seeded = p.seed is not None and not greedy
        seeds.append(_wrap64(p.seed) if seeded else 0)
        counters.append(pos if seeded else kernel_ref.UNSEEDED + i)
    return [temps, top_ps, min_ps], [ks, seeds, counters], has_top_k, has_top_p


def rows_of(
    floats: torch.Tensor,
    ints: torch.Tensor,
    step_seed: torch.Tensor | None,
    has_top_k: bool = True,
    has_top_p: bool = True,
) -> kernel.SamplingRows:
    """SamplingRows viewing packed [3, S] float32 (temperature, top_p, min_p) and [3, S] int64 (top_k, seed,
    counter) tensors; step_seed None: drawn when the batch samples."""
    return kernel.SamplingRows(*floats.unbind(0), *ints.unbind(0), step_seed, has_top_k, has_top_p)


def speculative_sample(p: torch.Tensor, q: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's check of proposals drawn from a draft distribution, one per row: the row's
    token [R] int32 for the target's distributions p [R, V], the draft's q [R, V] and proposals [R], each
    d ~ q. With u ~ U(0, 1), d is kept when u q(d) < p(d) (probability min(1, p(d) / q(d))); otherwise the
    token is a draw from the residual max(p - q, 0), renormalised, which is 0 at a rejected d (only
    p(d) < q(d) can reject), so the token equals d exactly when d is kept. Its distribution is p:
    P(x) = q(x) min(1, p(x) / q(x)) + (1 - sum_y min(p(y), q(y))) r(x) = min(p, q)(x) + max(p - q, 0)(x),
    and d is kept with probability sum_x min(p(x), q(x)). u and the residual's exponential noise come from
    torch's generator on the device; nothing synchronises with the host."""
    d = proposals.long()[:, None]
    kept = torch.rand_like(p[:, 0]) * q.gather(1, d)[:, 0] < p.gather(1, d)[:, 0]
    residual = (p - q).clamp_min(0.0)
    # no residual mass (p == q up to rounding, which rejects only where p(d) = q(d) = 0): draw from p
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    # a draw from the residual: argmax of r / E, E ~ Exp(1), over its support (0 / 0 is no winner)
    noise = torch.empty_like(residual).exponential_()
    other = torch.where(residual > 0, residual / noise, -1.0).argmax(dim=-1)
    return torch.where(kept, d[:, 0], other).to(torch.int32)


def draw_step_seed(device: torch.device) -> torch.Tensor:
    """[1] int64 on the device: the seed of this step's unseeded rows, from torch's (CPU) generator, so that
    torch.manual_seed makes unseeded sampling reproducible."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64).to(device, non_blocking=True)


class Sampler:
    """Picks each row's next token from its logits; reads token histories from the engine's token pool."""

    def __init__(
        self, device: torch.device, token_pool: torch.Tensor | None = None, fused: bool = True
    ) -> None:
        self.device = device
        self.token_pool = token_pool  # [rows, max_seq_len] int32; only penalised batches read it
        self.fused = fused  # kernel.sample (Triton on a GPU); False: always the torch reference

    def load_history(self, info: SamplingInfo) -> None:
        """For a batch whose rows sample their first token since admission (a prefill batch): put the
        penalised rows' known tokens into the token pool, where the penalties read them."""
        if info.penalties is not None:
            assert self.token_pool is not None, "history penalties need the token pool"
            info.penalties.load_history(self.token_pool)

    def sample(self, logits: torch.Tensor, info: SamplingInfo, drawn: tuple | None = None) -> torch.Tensor:
        """logits [S, V] -> token ids [S] (int32), on the device, with no host synchronisation. `drawn`:
        the rows of a verify step that check a proposal drawn from a draft distribution (Batch.draft_probs),
        whose tokens come from `speculative_sample` instead."""
        if info.all_greedy:
            return kernel.argmax(logits)
        if info.penalties is not None:
            logits = info.penalties.apply(logits, self.token_pool)
            if info.rows is None:  # every row greedy, some of them penalised or biased
                return kernel.argmax(logits)
        rows = info.rows._replace(step_seed=draw_step_seed(logits.device))
        tokens = (kernel.sample if self.fused else kernel_ref.sample)(logits, rows)
        if drawn is not None:
            at, proposals, q = drawn
            p = kernel_ref.probabilities(logits, rows).index_select(0, at)
            tokens.index_copy_(0, at, speculative_sample(p, q, proposals))
        return tokens

    def probs(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        """Each row's processed distribution [S, V] float32, what `sample` draws a sampled row from: after
        logit_bias and penalties, at its temperature, over what min-p, top-k and top-p keep."""
        assert info.rows is not None, "a batch of greedy rows draws from no distribution"
        if info.penalties is not None:
            logits = info.penalties.apply(logits, self.token_pool)
        return kernel_ref.probabilities(logits, info.rows)

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
