"""Draft-model speculation (`--speculative draft --speculative-draft-model PATH`): a small model that shares
the target's tokenizer proposes k tokens per request, k decode steps of its own engine.

The draft runs in an Engine of its own on the target's device, with the same attention backend and batch
machinery (Batch, attention metadata, graphs) but its own KV pool, page table and token pool. Its page
table and token pool rows are the target's (`Req.table_idx`): a running request owns the same row in
both. Per request the draft keeps how many of the request's tokens have K/V in its pool
(`DraftSeq.cached`); before proposing it extends over the tokens it has not seen (the prompt at first,
in chunks of at most --max-prefill-length tokens a step, then the accepted tokens and the target's token
after each verify step), samples the first proposal at the last of them, and runs k - 1 decode steps for
the rest, each reading its input from the token pool where the step before wrote it (one host
synchronisation per `propose`). The K/V of rejected proposals is overwritten by the next extension; the
pages past the valid K/V go back to the draft's free list then, and all of them when the request
finishes, is aborted or is retracted (`release`).

What the draft proposes, by the check the verify step makes (scheduler/speculative.py); the output is the
target's whatever the proposals are:
- a greedy request: the draft's argmax (after the request's logit_bias and penalties, which the draft
  applies as the target does), kept when it is the target's argmax.
- a sampled request without a seed: a draw from the draft's processed distribution q (the request's
  temperature, min-p, top-k, top-p, penalties and bias applied to the draft's logits), whose q over the
  target's vocabulary the verify step reads (`draft_probs`) to keep d with probability min(1, p(d) / q(d)).
  It is kept with probability sum min(p, q), where the draft's argmax, kept only when the target's own
  draw equals it, would be kept with probability p(argmax q). Under a grammar, which cuts the proposals
  where it rejects them (a cut that would bias that check), the draft's argmax instead.
- a sampled request with a seed: the draft's draw under the request's parameters with the very noise the
  target's draw of that position uses (the sampler keys a seeded row's noise by seed and position), kept
  when the target's draw x equals it, so x is the token without speculation: d and x are one noise pushed
  through q and p, and agree whenever the two distributions are close where the noise points."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from minisgl.core import Batch, Phase, Req, SamplingParams
from minisgl.engine import Engine, EngineConfig, SamplingInfo
from minisgl.kvcache import KVPool
from minisgl.layers.context import set_global_ctx
from minisgl.models import ModelConfig
from minisgl.models.resolve import resolve_model_path
from minisgl.utils import init_logger
from minisgl.utils.device import is_cuda
from minisgl.utils.hf import load_hf_config, load_tokenizer

from .prefill import pages_for
from .speculative import Proposer

if TYPE_CHECKING:
    from .config import SchedulerConfig

logger = init_logger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class DraftSeq:
    """One request's state in the draft engine (on `Req.spec.proposer["draft"]`)."""

    row: int  # page-table and token-pool row: the request's target row
    pages: list[int] = field(default_factory=list)
    cached: int = 0  # positions [0, cached) hold valid K/V in the draft's pool
    base: int = 0  # the request's token count when it last proposed: proposal i sits at position base + i
    proposed: list[int] = field(default_factory=list)  # those proposals (K/V written for all but the last)
    k: int = 0  # proposals asked for in the current `propose`
    draws: bool = False  # the proposals are draws from the draft's q (`draws_from_q`)
    # then the q of each proposal, [target vocab] float32, until the verify step has read them
    probs: list[torch.Tensor] = field(default_factory=list)


def _has_tokenizer(model_dir: str) -> bool:
    return any(os.path.exists(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES)


def check_vocab(target_dir: str, draft_dir: str, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft whose tokens are not the target's (ValueError naming the difference). The models'
    vocabulary sizes must be equal, or their tokenizers equal and inside both (checkpoints of one family
    pad their embeddings differently)."""
    tokenizers = _has_tokenizer(target_dir) and _has_tokenizer(draft_dir)
    if tokenizers:
        target_tok, draft_tok = load_tokenizer(target_dir).get_vocab(), load_tokenizer(draft_dir).get_vocab()
        if target_tok != draft_tok:
            differ = len(set(target_tok.items()) ^ set(draft_tok.items()))
            raise ValueError(
                f"the draft model {draft_dir} does not share the target's tokenizer ({len(draft_tok)} "
                f"tokens against {len(target_tok)}, {differ} (token, id) pairs differ): speculation "
                "needs a draft with the target's vocabulary"
            )
        if max(target_tok.values()) < min(target_vocab, draft_vocab):
            return
    if target_vocab != draft_vocab:
        raise ValueError(
            f"the draft model {draft_dir} has a vocabulary of {draft_vocab} tokens, the target "
            f"{target_vocab}: speculation needs a draft with the target's vocabulary"
        )


def _draft_pages(target: Engine, draft_dir: str, cfg: ModelConfig) -> int:
    """The draft pool's pages: as many tokens as the target's pool, or on a GPU what the memory left after
    the target holds (the draft's weights and 1 GiB for activations aside)."""
    num = target.num_pages
    if not is_cuda(target.device):
        return num
    free, _ = torch.cuda.mem_get_info(target.device)
    weights = sum(
        os.path.getsize(os.path.join(draft_dir, f))
        for f in os.listdir(draft_dir)
        if f.endswith(".safetensors")
    )
    heads = cfg.num_kv_heads
    per_page = KVPool.bytes_per_page(
        cfg.num_layers, target.config.page_size, heads, cfg.head_dim, target.dtype
    )
    fit = int((free - weights - (1 << 30)) // per_page)
    if fit < 2 or fit * target.config.page_size < target.max_seq_len // 8:
        raise ValueError(
            f"the draft model's KV pool would hold only {max(fit, 0)} pages in the GPU memory the target "
            "leaves: lower --mem-fraction to leave the draft room"
        )
    return min(num, fit)


def draft_engine_config(config: SchedulerConfig, target: Engine) -> EngineConfig:
    """The draft engine's options: the target's (device, dtype, attention backend, page size) with the
    draft model, its own pool size, and decode graphs only up to the batches that speculate."""
    assert config.speculative_draft_model is not None
    draft_dir = resolve_model_path(config.speculative_draft_model, config.weights_format)
    cfg = ModelConfig.from_hf(load_hf_config(draft_dir))
    check_vocab(target.model_dir, draft_dir, target.model_config.vocab_size, cfg.vocab_size)
    own = {f.name: getattr(config, f.name) for f in dataclasses.fields(EngineConfig)}
    graphs = config.cuda_graph_max_bs  # as the target's; on CUDA only up to the batches that speculate
    if graphs != 0 and is_cuda(target.device):
        graphs = min(graphs or config.speculative_max_batch, config.speculative_max_batch)
    own.update(
        model_path=draft_dir,
        num_pages=_draft_pages(target, draft_dir, cfg),
        cuda_graph_max_bs=graphs,
        cuda_graph_max_prefill=0,  # the draft's extensions are short and of any length: eager
        pooling="last",
    )
    return EngineConfig(**own)


@dataclass
class _GreedyRow:
    """What SamplingInfo reads of a request, with its parameters made greedy (bias and penalties kept)."""

    sampling_params: SamplingParams
    table_idx: int
    prompt_len: int
    token_ids: list[int]


def draws_from_q(req: Req) -> bool:
    """Whether the draft draws req's proposals from its own processed distribution q, for the verify step's
    speculative_sample: a sampled request with neither a seed (it must give its plain-path tokens) nor a
    grammar (its proposals are cut where the grammar rejects them, which would bias a drawn one's check)."""
    p = req.sampling_params
    return not p.is_greedy and p.seed is None and req.grammar is None


def _draft_row(req: Req) -> Req | _GreedyRow:
    """req as the draft samples it: as the target does when it draws from q or its noise is keyed by its
    seed (the draft draws with the target's noise), else greedy."""
    p = req.sampling_params
    if p.is_greedy or p.seed is not None or draws_from_q(req):
        return req
    return _GreedyRow(dataclasses.replace(p, temperature=0.0), req.table_idx, req.prompt_len, req.token_ids)


class DraftProposer(Proposer):
    """Proposals from a draft model's decode steps (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, target: Engine) -> None:
        if config.tp_size > 1:
            raise ValueError("--speculative draft runs with one rank (--tp-size 1)")
        self.engine = Engine(draft_engine_config(config, target))
        set_global_ctx(target.ctx)  # the draft's engine made its own Context the current one
        self.page_size = config.page_size
        self.max_prefill = config.max_prefill_length
        self.max_seq_len = self.engine.max_seq_len
        self.target_vocab = target.model_config.vocab_size
        self.draft_vocab = self.engine.model_config.vocab_size
        self.free_pages = list(range(self.engine.num_pages))
        self.num_pages = self.engine.num_pages
        logger.info(
            f"Draft model {self.engine.model_config.architecture} from {self.engine.model_dir}: "
            f"{self.num_pages} pages of {self.page_size} tokens"
        )

    @classmethod
    def create(cls, config: SchedulerConfig, target: Engine) -> Proposer:
        return cls(config, target)

    # ---- proposing -------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        seqs = [self._prepare(r, k) if k > 0 else None for r, k in zip(reqs, ks)]
        active = [(r, s) for r, s in zip(reqs, seqs) if s is not None]
        if not active:
            return [[] for _ in reqs]
        self._extend([r for r, _ in active], [s for _, s in active])
        for step in range(1, max(s.k for _, s in active)):
            self._decode([(r, s) for r, s in active if s.k > step], step)
        # the proposals are in the token pool at positions n .. n + k - 1 of each row: one read
        rows = np.repeat([s.row for _, s in active], [s.k for _, s in active])
        pos = np.concatenate([np.arange(len(r.token_ids), len(r.token_ids) + s.k) for r, s in active])
        index = torch.from_numpy(np.stack([rows, pos])).to(self.engine.device)
        flat = self.engine.token_pool[index[0], index[1]].tolist()  # the host synchronisation of a step
        out: list[list[int]] = []
        for s in seqs:
            if s is None:
                out.append([])
                continue
            d, flat = flat[: s.k], flat[s.k :]
            if max(d) >= self.target_vocab:  # a padding id of a larger draft vocabulary: stop before it
                d = d[: next(i for i, t in enumerate(d) if t >= self.target_vocab)]
            s.proposed = d
            out.append(d)
        return out

    def _prepare(self, req: Req, k: int) -> DraftSeq | None:
        """req's draft state, its K/V cut back to what still holds, pages for k proposals; None when the
        pool or the draft's context cannot hold them."""
        assert req.spec is not None and req.table_idx >= 0
        seq = req.spec.proposer.get("draft")
        if seq is None or seq.row != req.table_idx:
            self.release(req)
            seq = req.spec.proposer["draft"] = DraftSeq(req.table_idx)
        toks, n = req.token_ids, len(req.token_ids)
        valid = seq.base
        for i, d in enumerate(seq.proposed[:-1]):  # proposals whose K/V was written, while the target agreed
            if valid >= n or toks[valid] != d:
                break
            valid += 1
        # the last token is always extended over: its position samples the first proposal
        seq.cached = min(seq.cached, valid, n - 1)
        seq.base, seq.proposed, seq.k = n, [], min(k, self.max_seq_len - n)
        seq.draws, seq.probs = draws_from_q(req), []
        keep = pages_for(seq.cached, self.page_size)
        self.free_pages += seq.pages[keep:]
        del seq.pages[keep:]
        if seq.k <= 0:
            return None
        need = pages_for(n + seq.k - 1, self.page_size) - len(seq.pages)
        if need > len(self.free_pages):
            return None
        seq.pages += self.free_pages[len(self.free_pages) - need :]
        del self.free_pages[len(self.free_pages) - need :]
        return seq

    def _slots(self, seq: DraftSeq, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        ps = self.page_size
        return np.asarray(seq.pages, dtype=np.int64)[pos // ps] * ps + pos % ps

    def _extend(self, reqs: list[Req], seqs: list[DraftSeq]) -> None:
        """Extension steps over each request's unseen tokens, at most max_prefill tokens a step; the step
        that reaches a request's last token samples its first proposal into the token pool."""
        pending = list(range(len(reqs)))
        while pending:
            budget, chosen, takes = self.max_prefill, [], []
            for i in pending:
                take = min(len(reqs[i].token_ids) - seqs[i].cached, budget)
                if take == 0:
                    break
                chosen.append(i)
                takes.append(take)
                budget -= take
            self._run(*self._extend_batch([reqs[i] for i in chosen], [seqs[i] for i in chosen], takes))
            pending = [i for i in pending if seqs[i].cached < len(reqs[i].token_ids)]

    def _extend_batch(
        self, reqs: list[Req], seqs: list[DraftSeq], takes: list[int]
    ) -> tuple[Batch, list[DraftSeq]]:
        """The step and the requests whose first proposal it samples."""
        starts = [s.cached for s in seqs]
        ends = [s + t for s, t in zip(starts, takes)]
        sample = [e == len(r.token_ids) for r, e in zip(reqs, ends)]
        batch = Batch(reqs, Phase.PREFILL, starts, takes, sample)
        ids = np.concatenate(
            [np.asarray(r.token_ids[s:e], dtype=np.int64) for r, s, e in zip(reqs, starts, ends)]
        )
        if self.draft_vocab < self.target_vocab:  # ids the draft lacks (padding): any of its own
            np.minimum(ids, self.draft_vocab - 1, out=ids)
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])
        slots = np.concatenate([self._slots(q, s, e) for q, s, e in zip(seqs, starts, ends)])
        rows = np.repeat([q.row for q in seqs], takes)
        last = np.cumsum(takes) - 1
        picked = [i for i, s in enumerate(sample) if s]
        dev = self.engine.device

        def put(a) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a), dtype=torch.int32).to(dev)

        batch.input_ids, batch.positions, batch.out_loc = put(ids), put(positions), put(slots)
        batch.table_idx, batch.seq_lens_t = put([q.row for q in seqs]), put(ends)
        batch.pt_writes = (put(rows), batch.positions, batch.out_loc)
        batch.logits_idx = put(last[picked]).long()
        batch.sample_table_idx = put([seqs[i].row for i in picked])
        batch.sample_pos = put([ends[i] for i in picked])
        batch.sampling_info = self._sampling([reqs[i] for i in picked], [ends[i] for i in picked])
        for s, e in zip(seqs, ends):
            s.cached = e
        return batch, [seqs[i] for i in picked]

    def _decode(self, active: list[tuple[Req, DraftSeq]], step: int) -> None:
        """Decode step `step` (1..k-1): each request's input is proposal `step`, at position n + step - 1,
        and its token (proposal step + 1) goes into the token pool after it."""
        dev = self.engine.device
        positions = [len(r.token_ids) + step - 1 for r, _ in active]
        slots = [int(self._slots(s, p, p + 1)[0]) for (_, s), p in zip(active, positions)]
        reqs = [r for r, _ in active]
        batch = Batch(reqs, Phase.DECODE, positions, [1] * len(reqs), [True] * len(reqs))
        batch.positions = torch.tensor(positions, dtype=torch.int32).to(dev)
        batch.out_loc = torch.tensor(slots, dtype=torch.int32).to(dev)
        batch.table_idx = torch.tensor([s.row for _, s in active], dtype=torch.int32).to(dev)
        batch.seq_lens_t = batch.positions + 1
        batch.sample_table_idx, batch.sample_pos = batch.table_idx, batch.seq_lens_t
        batch.sampling_info = self._sampling(reqs, [p + 1 for p in positions])
        self._run(batch, [s for _, s in active])
        for (_, s), p in zip(active, positions):
            s.cached = p + 1

    def _run(self, batch: Batch, seqs: list[DraftSeq]) -> None:
        """Run a draft step whose sampled rows propose for `seqs`, in order; keep the q of each proposal
        drawn from q (`DraftSeq.probs`)."""
        fwd = self.engine.forward(batch)
        self.engine.sample(batch, fwd)
        drawing = [i for i, s in enumerate(seqs) if s.draws]
        if not drawing:
            return
        q = self.engine.sampler.probs(fwd.logits, batch.sampling_info)
        if len(drawing) < len(seqs):
            q = q[drawing]
        for i, row in zip(drawing, self._over_target_vocab(q).unbind(0)):
            seqs[i].probs.append(row)

    def _over_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """q [n, draft vocab] as a distribution over the target's ids. A proposal the target lacks is cut
        off (`propose`, which the target then samples itself), so a kept one is a draw from q over the
        target's ids, renormalised; ids the draft lacks have no mass."""
        extra = self.target_vocab - self.draft_vocab
        if extra > 0:
            return torch.nn.functional.pad(q, (0, extra))
        if extra < 0:
            q = q[:, : self.target_vocab]
            return q / q.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
        return q

    def _sampling(self, reqs: list[Req], positions: list[int]) -> SamplingInfo:
        """How the draft samples the tokens of `positions` (their indices in the requests' tokens, as the
        target's rows key their noise), no logprobs."""
        rows = [_draft_row(r) for r in reqs]
        info = SamplingInfo.build(rows, positions, self.draft_vocab, self.engine.device)  # type: ignore[arg-type]
        info.top_logprobs = -1
        return info

    def draft_probs(self, req: Req) -> list[torch.Tensor] | None:
        seq = req.spec.proposer.get("draft")
        return seq.probs if seq is not None and seq.draws else None

    def on_accept(self, req: Req, accepted: int) -> None:
        seq = req.spec.proposer.get("draft")
        if seq is not None:
            seq.probs = []  # read by the verify step

    # ---- bookkeeping -----------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        seq = req.spec.proposer.pop("draft", None) if req.spec is not None else None
        if seq is not None:
            self.free_pages += seq.pages
            seq.pages = []

    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def check_idle(self) -> str | None:
        free = len(set(self.free_pages))
        if free != self.num_pages or len(self.free_pages) != free:
            return f"the draft model's pool has {self.num_pages - free} pages still taken (or a page freed twice)"
        return None

    def shutdown(self) -> None:
        self.engine.shutdown()
