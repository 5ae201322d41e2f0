"""The Scheduler: decides what runs each step and where the KV goes; the Engine computes.

One `step()` with overlap scheduling: prepare and launch step N, then (while the device computes it)
process the results of step N-1. Decode input tokens come from the device token pool, so step N can be
prepared before step N-1's tokens reach the host. A token computed for a request that finished in the
meantime is discarded, never reported.

A step with rows under a grammar (scheduler/grammar.py) needs, for their token masks, the tokens of step
N-1: the engine's forward of step N is launched first, then step N-1 is processed (its tokens advance the
matchers), then the masks are filled and step N samples. A step with no constrained row runs as before."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minisgl.core import Batch, FinishReason, InvalidRequest, Phase, PromptLogprobs, Req, SamplingParams
from minisgl.engine import DECODE_INPUTS, Engine, ForwardOutput, Logits, SamplingInfo
from minisgl.env import ENV
from minisgl.utils import init_logger
from minisgl.utils.device import HostRing, create_stream, current_stream, use_stream

from .cache import CacheManager
from .config import SchedulerConfig
from .decode import DecodeManager
from .grammar import GrammarManager
from .pacing import PrefillPacer, attention_ratio
from .prefill import PrefillManager, PrefillPlan, pages_for
from .speculative import SpecState, StepCosts, create_proposer
from .table import TableManager

logger = init_logger(__name__)


@dataclass
class StepOutput:
    uid: int
    token_id: int
    finished: bool
    finish_reason: FinishReason | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    cached_tokens: int = 0  # the request's prompt tokens found in the prefix cache (Req.cached_prompt_len)
    error: str | None = None  # why a request ended with FinishReason.ERROR (token_id -1: no token)
    error_param: str | None = None  # the field at fault, when the client's (InvalidRequest.param)
    prompt_logprobs: PromptLogprobs | None = None  # with the first token (SamplingParams.prompt_logprobs)
    embedding: list[float] | None = None  # an embedding request's pooled, L2-normalised vector

    def extras(self) -> dict[str, Any] | None:
        """The once-per-request payloads as plain data (the messages carry them): `prompt_logprobs` (a
        PromptLogprobs' fields) and `embedding`."""
        out: dict[str, Any] = {}
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = dataclasses.asdict(self.prompt_logprobs)
        if self.embedding is not None:
            out["embedding"] = self.embedding
        return out or None


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.engine = Engine(config)  # a SchedulerConfig is an EngineConfig plus the scheduling options
        self.device = self.engine.device
        self.page_size = config.page_size
        self.max_seq_len = self.engine.max_seq_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.eos_token_ids = set(self.engine.model_config.eos_token_ids) | set(config.extra_eos_token_ids)
        self.overlap = (not ENV.disable_overlap_scheduling) if config.overlap is None else config.overlap
        self.table = TableManager(config.max_running_req)
        self.cache = CacheManager(self.engine.num_pages, self.page_size, config.cache_type)
        self.prefill = PrefillManager(self.cache, self.table, config.max_prefill_length, config.reserve_ratio)
        self.decode = DecodeManager()
        self.grammar = GrammarManager(
            self.engine.model_dir,
            self.vocab_size,
            lambda: sorted(self.eos_token_ids),  # read at the first compilation: the LLM adds the tokenizer's
            self.device,
            blocking=config.tp_info.size > 1,
            timeout=config.grammar_compile_timeout,
            cache_bytes=config.grammar_cache_mb << 20,
        )
        self.reqs: dict[int, Req] = {}
        # the engine computes on this stream; batches are prepared on the current one
        self.stream = create_stream(self.device)
        self._in_flight: tuple[Batch, ForwardOutput] | None = None
        self._staging = HostRing(self.device)  # pinned buffers for the per-step host -> device copy
        self._pending_outputs: list[StepOutput] = []
        self._chunk_left = False  # the last prefill step left a prompt's chunk for later
        # while requests decode, a CPU prefill step takes the prompt tokens that fit in a fraction of a
        # second at the measured pace: a chunk then delays the running streams that long, not a long
        # prompt's whole prefill
        cpu = self.device.type == "cpu"
        self.pacer = PrefillPacer(attention_ratio(self.engine.model_config)) if cpu else None
        self._paced = False  # the batch being launched is a prefill step the pacer sized
        self.num_retractions = 0
        self.proposer = None  # speculative decoding (scheduler/speculative.py), None when off
        if config.speculative is not None:
            self.proposer = create_proposer(
                config.speculative, config.speculative_ngram_min, config.speculative_ngram_max
            )
            # a verify step has up to k + 1 rows for each of at most speculative_max_batch requests
            self.engine.capture_verify_graphs(
                config.speculative_max_batch * (config.num_speculative_tokens + 1)
            )
        self.spec_proposed = self.spec_accepted = self.spec_steps = 0
        self.step_costs = StepCosts()  # a lone request's steps by rows: what its k is chosen from
        self.last_batch_size = 0
        self.max_batch_size = 0
        self.num_total_pages = self.engine.num_pages
        self.pool_tokens = self.num_total_pages * self.page_size
        logger.info(
            f"Scheduler ready: cache={config.cache_type}, overlap={self.overlap}, "
            f"max_prefill_length={config.max_prefill_length}"
        )

    # ---- requests in -----------------------------------------------------------------------------
    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest naming the field (`prompt`, `max_tokens`, ...) of a request that cannot run.
        The one set of rules for both the offline path and the service."""
        params.validate()
        n, max_len = len(input_ids), self.max_seq_len
        if n == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        if n >= max_len:
            raise InvalidRequest(
                f"the prompt has {n} tokens; the maximum sequence length is {max_len} "
                "(prompt + at least one generated token)",
                "prompt",
            )
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequest(f"'logit_bias' token ids must be in [0, {self.vocab_size})", "logit_bias")
        if n >= self.pool_tokens:
            raise InvalidRequest(
                f"the prompt has {n} tokens but the KV pool holds only {self.pool_tokens}", "prompt"
            )
        if params.prompt_logprobs is not None and params.prompt_logprobs_start >= n:
            raise InvalidRequest(
                f"'prompt_logprobs_start' is {params.prompt_logprobs_start}; the prompt has {n} tokens",
                "prompt_logprobs_start",
            )
        if params.max_tokens is not None and n + params.max_tokens > max_len:
            raise InvalidRequest(
                f"the prompt has {n} tokens and 'max_tokens' is {params.max_tokens}: together more than "
                f"the maximum sequence length {max_len}; lower 'max_tokens' or shorten the prompt "
                "(with no 'max_tokens' the output runs up to the context)",
                "max_tokens",
            )

    def add_request(self, uid: int, input_ids: list[int], params: SamplingParams) -> None:
        """Queue a request after `validate`; `params.max_tokens=None` runs up to the context."""
        if uid in self.reqs:
            raise ValueError(f"request uid {uid} is already in use")
        input_ids = [int(t) for t in input_ids]
        self.validate(input_ids, params)
        req = Req(uid=uid, token_ids=input_ids, sampling_params=params)
        max_tokens = self.max_seq_len if params.max_tokens is None else params.max_tokens
        # a request alone must always fit in the pool, or retraction could not make progress
        req.max_total_len = min(len(input_ids) + max_tokens, self.max_seq_len, self.pool_tokens)
        if params.embed and self.engine.pooling != "last":
            req.embed_from = 0  # every position is pooled (mean), or the first (cls): none from the cache
        self.reqs[uid] = req
        if params.grammar is not None:
            self.grammar.add(req)  # joins the prefill queue once its grammar is compiled
        else:
            self.prefill.add(req)

    def abort_request(self, uid: int) -> bool:
        """Drop a request in any state; its slot and KV are returned at once. False if unknown."""
        req = self.reqs.get(uid)
        if req is None:
            return False
        if self.grammar.remove(uid):
            pass  # still compiling: holds nothing yet
        elif self.prefill.remove(uid) is None:
            if self.prefill.chunked is req:
                self.prefill.chunked = None
            elif req in self.decode.running:
                self.decode.remove(req)
            self._release(req)
        req.finished, req.finish_reason = True, FinishReason.ABORT
        self.grammar.release(req)
        self.reqs.pop(uid, None)
        logger.info(f"Aborted request {uid}")
        return True

    # ---- the step --------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(
            self.prefill.waiting
            or self.prefill.chunked
            or self.decode.running
            or self._in_flight
            or self._pending_outputs
            or self.grammar.compiling
        )

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one step; returns the tokens that became known (the previous step's with overlap)."""
        if self.grammar.compiling:
            self._admit_compiled()
        batch = self._schedule()
        out = fwd = None
        start = time.perf_counter()
        if batch is not None and batch.grammar_rows is not None:
            fwd = self._launch_forward(batch)  # its masks need the tokens of the step in flight
        elif batch is not None and self._times_steps(batch):
            out = self._launch(batch)
            out.wait()  # the step's cost (it is processed now or at the next step's drain anyway)
            self.step_costs.add(batch.size, time.perf_counter() - start)
        elif batch is not None:
            out = self._launch(batch)
        results, self._pending_outputs = self._pending_outputs, []
        if self._in_flight is not None:
            results += self._process(*self._in_flight)
            self._in_flight = None
        if fwd is not None:
            out = self._launch_sample(batch, fwd)
            if self._times_steps(batch):  # nothing was in flight: speculation drains before a decode step
                out.wait()
                self.step_costs.add(batch.size, time.perf_counter() - start)
        if batch is None and not results and self.grammar.compiling:
            self.grammar.wait(0.05)  # nothing to run until a grammar is compiled: do not spin
        if out is not None:
            if self.overlap and batch.drafts is None:  # a verify step's outcome decides the next step
                self._in_flight = (batch, out)
            else:
                results += self._process(batch, out)
        return results

    def _times_steps(self, batch: Batch) -> bool:
        """A decode or verify step while speculation is possible: its cost by rows chooses k (StepCosts).
        Not with several ranks: each would time its own steps, and they must all choose the same k."""
        return (
            self.proposer is not None
            and self.config.tp_info.size == 1
            and batch.is_decode
            and len(self.decode.running) <= self.config.speculative_max_batch
        )

    def _launch(self, batch: Batch) -> ForwardOutput:
        return self._on_engine_stream(batch, self.engine.forward_batch)

    def _launch_forward(self, batch: Batch) -> Logits:
        return self._on_engine_stream(batch, self.engine.forward)

    def _on_engine_stream(self, batch: Batch, run: Callable[[Batch], Any]) -> Any:
        """Launch `run(batch)` on the engine's stream, after what the current stream prepared."""
        size = batch.size if batch.drafts is None else batch.drafts.count(-1)  # requests, not rows
        self.last_batch_size = size
        self.max_batch_size = max(self.max_batch_size, size)
        self.stream.wait_stream(current_stream(self.device))
        paced, self._paced = self._paced, False
        start = time.perf_counter()
        with use_stream(self.stream):
            out = run(batch)
        if paced and self.pacer is not None:  # a CPU step runs as it is called: its time is the step's
            chunks = list(zip(batch.extend_lens, batch.prefix_lens))
            self.pacer.measured(time.perf_counter() - start, chunks)
        return out

    def _launch_sample(self, batch: Batch, fwd: Logits) -> ForwardOutput:
        """Sample a batch with constrained rows, the matchers up to date: their masks, then the engine."""
        with use_stream(self.stream):
            return self.engine.sample(batch, fwd, self.grammar.mask(batch))

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is compiled; end those whose grammar failed with an error."""
        ready, failed = self.grammar.ready()
        for req in ready:
            self.prefill.add(req)
        for req, error, param in failed:
            req.finished, req.finish_reason = True, FinishReason.ERROR
            self.reqs.pop(req.uid, None)
            out = StepOutput(req.uid, -1, True, FinishReason.ERROR, error=error, error_param=param)
            self._pending_outputs.append(out)

    def _drain(self) -> None:
        """Process the step in flight now (before a retraction needs exact host state)."""
        if self._in_flight is not None:
            self._pending_outputs += self._process(*self._in_flight)
            self._in_flight = None

    # ---- scheduling ------------------------------------------------------------------------------
    def _schedule(self) -> Batch | None:
        # a long prompt's chunks take turns with the running requests' decode steps: the prompt delays
        # their streams by one chunk at a time, not by its whole prefill (a 6,400-token prompt held every
        # stream of a CPU service for 15 s)
        if self._chunk_left and self.decode.running:
            self._chunk_left = False
            batch = self._prepare_decode()
            if batch is not None:
                return batch
        busy = None
        if self.pacer is not None and self.decode.running:
            chunked = self.prefill.chunked
            busy = self.pacer.budget(chunked.cached_len if chunked is not None else 0)
        plan = self.prefill.schedule(self.decode.running, busy)
        self._paced = plan is not None and busy is not None  # its time measures the pace
        if plan is not None:
            self._chunk_left = self.prefill.chunked is not None
            return self._prepare_prefill(plan)
        return self._prepare_decode()

    def _prepare_prefill(self, plan: PrefillPlan) -> Batch:
        sample_mask = [
            p + e == len(r.token_ids) for r, p, e in zip(plan.reqs, plan.prefix_lens, plan.extend_lens)
        ]
        batch = Batch(plan.reqs, Phase.PREFILL, plan.prefix_lens, plan.extend_lens, sample_mask)
        # per-token parts as tensors (a prefill step can hold thousands of tokens)
        positions, input_ids, out_loc, pt_rows, pt_pos, pt_slots = [], [], [], [], [], []
        for req, prefix, extend in zip(plan.reqs, plan.prefix_lens, plan.extend_lens):
            end = prefix + extend
            positions.append(torch.arange(prefix, end, dtype=torch.int32))
            input_ids.append(np.asarray(req.token_ids[prefix:end], dtype=np.int32))
            slots = self.cache.slots_of(req.pages, end)
            out_loc.append(slots[prefix:])
            # the page-table row also needs the cached prefix when the request was just admitted
            start = req.table_len
            pt_rows.append(torch.full((end - start,), req.table_idx, dtype=torch.int32))
            pt_pos.append(torch.arange(start, end, dtype=torch.int32))
            pt_slots.append(slots[start:])
            req.table_len = end
        self._prompt_rows(batch)
        self._embed_rows(batch)
        ends = torch.tensor(plan.extend_lens).cumsum(0) - 1
        sampled = [i for i, s in enumerate(sample_mask) if s]
        prefill_parts = (
            torch.cat(pt_rows),
            torch.cat(pt_pos),
            torch.cat(pt_slots),
            [plan.reqs[i].table_idx for i in sampled],
            ends[sampled].to(torch.int32),
            torch.from_numpy(np.concatenate(input_ids)),
        )
        self._to_device(
            batch,
            torch.cat(positions),
            torch.cat(out_loc),
            [plan.prefix_lens[i] + plan.extend_lens[i] for i in sampled],
            prefill_parts,
        )
        for req, prefix, extend, s in zip(plan.reqs, plan.prefix_lens, plan.extend_lens, sample_mask):
            req.cached_len = prefix + extend
            req.device_len = req.cached_len + 1 if s else req.cached_len
            if s:
                self.decode.add(req)
        return batch

    def _prompt_rows(self, batch: Batch) -> None:
        """The rows of this prefill whose logits give prompt log-probabilities, and their targets (one small
        extra copy to the device: only batches that ask for them pay it)."""
        rows: list[range] = []
        targets: list[int] = []
        counts: list[int] = []
        offset = 0
        for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            want = req.prompt_lp_rows
            lo, hi = max(prefix, want.start), min(prefix + extend, want.stop)
            counts.append(max(0, hi - lo))
            if hi > lo:
                rows.append(range(offset + lo - prefix, offset + hi - prefix))
                targets += req.token_ids[lo + 1 : hi + 1]
                req.prompt_lp_next = hi + 1
            offset += extend
        if not rows:
            return
        flat = torch.cat([torch.arange(r.start, r.stop) for r in rows])
        batch.prompt_rows = flat.to(self.device, non_blocking=True)
        batch.prompt_targets = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
        batch.prompt_top = max(r.sampling_params.prompt_logprobs or 0 for r in batch.reqs)
        batch.prompt_counts = counts

    def _embed_rows(self, batch: Batch) -> None:
        """The rows of this prefill that embedding requests pool (all for mean, the first for cls, the last
        for last), summed per request by the engine."""
        rows: list[torch.Tensor] = []
        seg: list[int] = []
        reqs: list[int] = []
        offset = 0
        for i, (req, prefix, extend) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
            if req.sampling_params.embed:
                pooling = self.engine.pooling
                lo, hi = offset, offset + extend  # mean: every row of the chunk
                if pooling == "cls":
                    hi = offset + 1 if prefix == 0 else offset
                elif pooling == "last":
                    lo = offset + extend - 1 if prefix + extend == req.prompt_len else hi
                if hi > lo:
                    rows.append(torch.arange(lo, hi))
                    seg += [len(reqs)] * (hi - lo)
                    reqs.append(i)
            offset += extend
        if reqs:
            batch.embed_rows = torch.cat(rows).to(self.device, non_blocking=True)
            batch.embed_seg = torch.tensor(seg, dtype=torch.int64).to(self.device, non_blocking=True)
            batch.embed_reqs = reqs

    def _prepare_decode(self) -> Batch | None:
        if self.proposer is not None and 0 < len(self.decode.running) <= self.config.speculative_max_batch:
            self._drain()  # proposals need every request's latest token on the host
        reqs = self.decode.decodable()
        if not reqs:
            return None
        if self.proposer is not None and len(reqs) <= self.config.speculative_max_batch:
            batch = self._prepare_verify(reqs)
            if batch is not None:
                return batch
        ps = self.page_size
        while True:  # every request needs a page when its next position starts one
            short = [r for r in reqs if r.cached_len // ps >= len(r.pages)]
            pages = self.cache.alloc(len(short))
            if pages is not None:
                for r, p in zip(short, pages):
                    r.pages.append(p)
                break
            if self._in_flight is not None:
                self._drain()  # finished requests may free pages; host state becomes exact
                reqs = self.decode.decodable()
            else:
                self._retract(self.decode.newest(reqs))
                reqs = self.decode.decodable()
            if not reqs:
                return None
        # longest context first: attention kernels start their programs in batch order, and a last wave
        # of short programs leaves less of the GPU idle at the end of the step than one of random lengths
        reqs.sort(key=lambda r: r.cached_len, reverse=True)
        positions = [r.cached_len for r in reqs]
        out_loc = [r.pages[p // ps] * ps + p % ps for r, p in zip(reqs, positions)]
        batch = Batch(reqs, Phase.DECODE, positions, [1] * len(reqs), [True] * len(reqs))
        for r in reqs:
            r.table_len = r.cached_len + 1
        self._to_device(batch, positions, out_loc, [p + 1 for p in positions])
        for r in reqs:
            r.cached_len += 1
            r.device_len += 1
        return batch

    def _prepare_verify(self, reqs: list[Req]) -> Batch | None:
        """A verify step: each request's proposals in rows after its last token (scheduler/speculative.py).
        None when no request has a proposal or the pool cannot hold them (a plain decode step then)."""
        max_k = self.config.num_speculative_tokens
        rooms = []
        for r in reqs:
            if r.spec is None:
                r.spec = SpecState()
            room = r.max_total_len - r.device_len - 1  # no proposals beyond the request's last position
            rooms.append(room if room > 0 and r.spec.ready() else 0)
        if self.config.tp_info.size > 1:
            ks = [min(r.spec.k(max_k), room) for r, room in zip(reqs, rooms)]
        else:  # the k of the most expected tokens per second of the step
            k = self.step_costs.best_k([r.spec.hit for r, m in zip(reqs, rooms) if m], len(reqs), max_k)
            if k == 0:
                for r, m in zip(reqs, rooms):
                    if m:
                        r.spec.pause()
            ks = [min(k or 0, room) for room in rooms]
        drafts = [d[:k] for d, k in zip(self.proposer.propose(reqs, ks), ks)] if any(ks) else []
        # under a grammar, only the proposals it accepts (the matchers are exact: the step was drained)
        drafts = [d if r.grammar is None else self.grammar.allowed_drafts(r, d) for r, d in zip(reqs, drafts)]
        if not any(drafts):
            return None
        ps = self.page_size
        need = [pages_for(r.cached_len + len(d) + 1, ps) - len(r.pages) for r, d in zip(reqs, drafts)]
        pages = self.cache.alloc(sum(n for n in need if n > 0))
        if pages is None:
            return None  # no room for proposals: decode (which may retract) instead
        for r, n in zip(reqs, need):
            if n > 0:
                r.pages += pages[:n]
                del pages[:n]
        order = sorted(range(len(reqs)), key=lambda i: reqs[i].cached_len, reverse=True)
        rows: list[Req] = []
        positions: list[int] = []
        row_drafts: list[int] = []
        for i in order:
            r, d = reqs[i], drafts[i]
            rows += [r] * (len(d) + 1)
            positions += range(r.cached_len, r.cached_len + len(d) + 1)
            row_drafts += [*d, -1]
            r.table_len = r.cached_len + len(d) + 1
        n = len(rows)
        out_loc = [r.pages[p // ps] * ps + p % ps for r, p in zip(rows, positions)]
        batch = Batch(rows, Phase.DECODE, positions, [1] * n, [True] * n)
        batch.drafts = row_drafts
        # proposal i goes into the token pool at the position after its row, where row i + 1 reads it;
        # a request's last row writes nothing (into the unused dummy row)
        dummy = self.engine.dummy_row
        has = [t >= 0 for t in row_drafts]
        writes = (
            [r.table_idx if h else dummy for r, h in zip(rows, has)],
            [p + 1 if h else 0 for p, h in zip(positions, has)],
            [t if h else 0 for t, h in zip(row_drafts, has)],
        )
        self._to_device(batch, positions, out_loc, [p + 1 for p in positions], spec_parts=writes)
        for r in reqs:  # the base row, as in decode; accepted proposals advance further when processed
            r.cached_len += 1
            r.device_len += 1
        self.spec_steps += 1
        return batch

    def _retract(self, req: Req) -> None:
        """Out of pages: send the newest request back to the queue, keeping its tokens. Its computed KV
        goes to the prefix cache, so resuming recomputes only what was evicted meanwhile."""
        logger.warning(
            f"KV pool full: retracting request {req.uid} ({len(req.token_ids)} tokens) to the queue"
        )
        self.num_retractions += 1
        self.decode.remove(req)
        self._release(req)
        req.cached_len = req.device_len = req.table_len = 0
        self.prefill.add(req, front=True)

    def _release(self, req: Req) -> None:
        self.cache.release(req)
        if req.table_idx >= 0:
            self.table.free(req.table_idx)
            req.table_idx, req.table_len = -1, 0

    def _to_device(
        self,
        batch: Batch,
        positions,
        out_loc,
        sample_pos: list[int],
        prefill_parts: tuple | None = None,
        spec_parts: tuple | None = None,
    ) -> None:
        """Pack the step's integers (lists or int32 tensors) into one pinned buffer, copy it to the device
        in one go, and fill in the batch's device tensors. A prefill batch also brings `prefill_parts`:
        page-table (rows, positions, slots), sample rows, logits rows and input ids. A decode batch starts
        with its per-request rows in the decode graph's order (DECODE_INPUTS), equally long, so they form
        one [4, n] view for the graph runner; its page-table writes are (table_idx, positions, out_loc)
        and its input ids come from the token pool, both done by the engine. A verify step also brings
        `spec_parts`: the token-pool (rows, positions, ids) of its proposals."""
        table_idx = [r.table_idx for r in batch.reqs]
        rows = DECODE_INPUTS.ordered(
            positions=positions, out_loc=out_loc, table_idx=table_idx, seq_lens_t=batch.seq_lens
        )
        parts = [*rows, sample_pos, *(prefill_parts or ()), *(spec_parts or ())]
        # every part starts 16-byte aligned: Triton specialises kernels on pointer alignment, so a
        # part at a varying alignment would recompile kernels step after step
        dev, offsets = self._staging.pack(parts)
        views = [dev[off : off + len(p)] for off, p in zip(offsets, parts)]
        k = len(rows)
        DECODE_INPUTS.assign(batch, views[:k])
        batch.sample_pos = views[k]
        if prefill_parts is None:
            n, m = batch.size, offsets[1]
            batch.graph_inputs = dev[: k * m].view(k, m)[:, :n]
            batch.sample_table_idx = batch.table_idx
            if spec_parts is not None:
                w_rows, w_pos, w_ids = views[k + 1 :]
                batch.draft_writes = (w_rows, w_pos, w_ids)
        else:
            pt_rows, pt_pos, pt_slots, batch.sample_table_idx, lidx_t, batch.input_ids = views[k + 1 :]
            batch.pt_writes = (pt_rows, pt_pos, pt_slots)
            batch.logits_idx = lidx_t.long()
        sampled = [r for r, s in zip(batch.reqs, batch.sample_mask) if s]
        batch.sampling_info = SamplingInfo.build(sampled, sample_pos, self.vocab_size, self.device)
        batch.grammar_rows = self.grammar.rows(sampled)

    # ---- results ---------------------------------------------------------------------------------
    def _process(self, batch: Batch, out: ForwardOutput) -> list[StepOutput]:
        out.wait()  # the only host synchronisation of a step
        tokens = out.next_tokens_host.tolist()
        logprobs = out.logprobs_host
        if batch.drafts is not None:
            return self._process_verify(batch, tokens, logprobs)
        if batch.prompt_counts is not None:
            self._collect_prompt_logprobs(batch, out.prompt_logprobs_host)
        for k, i in enumerate(batch.embed_reqs or []):
            req = batch.reqs[i]
            part = out.embed_host[k]
            req.embedding = part if req.embedding is None else req.embedding + part
        results: list[StepOutput] = []
        j = -1
        for req, sampled in zip(batch.reqs, batch.sample_mask):
            if not sampled:
                continue
            j += 1
            if req.finished:  # finished or aborted after this step was launched: discard
                continue
            results.append(self._emit(req, tokens[j], j, logprobs))
        return results

    def _emit(self, req: Req, token: int, j: int, logprobs: tuple | None) -> StepOutput:
        """Give req its sampled `token` (row j of the step's logprobs); end it if that finishes it."""
        if req.sampling_params.max_tokens == 0:  # an embedding, or only the prompt's log-probabilities
            token, finish, error = -1, FinishReason.LENGTH, None
        else:
            req.token_ids.append(token)
            finish, error = self._grammar_finish(req, token) if req.grammar is not None else (None, None)
            finish = finish or self._finish_reason(req, token)
        res = StepOutput(req.uid, token, finish is not None, finish, cached_tokens=req.cached_prompt_len)
        res.error = error
        if req.prompt_logprobs is not None and len(req.token_ids) <= req.prompt_len + 1:
            res.prompt_logprobs = req.prompt_logprobs  # with the request's first output
        if req.sampling_params.embed and req.embedding is not None:
            res.embedding = self._pooled(req)
        if logprobs is not None and req.sampling_params.logprobs:
            res.logprob = float(logprobs[0][j])
            k = req.sampling_params.top_logprobs
            if k and logprobs[1] is not None:
                res.top_logprobs = list(zip(logprobs[2][j, :k].tolist(), logprobs[1][j, :k].tolist()))
        if finish is not None:
            req.finished, req.finish_reason = True, finish
            self.decode.remove(req)
            self._release(req)
            self.grammar.release(req)
            self.reqs.pop(req.uid, None)
        return res

    def _process_verify(self, batch: Batch, tokens: list[int], logprobs: tuple | None) -> list[StepOutput]:
        """A verify step's rows, request by request: the tokens up to and including the first row whose
        token differs from the proposal it checks (the last row checks none). Each agreeing row makes its
        proposal's KV valid; the pages past the request's valid KV go back to the pool."""
        assert batch.drafts is not None
        drafts, reqs, n = batch.drafts, batch.reqs, len(tokens)
        results: list[StepOutput] = []
        i = 0
        while i < n:
            req, start = reqs[i], i
            while drafts[i] >= 0:  # a request's rows end with the one that checks nothing
                i += 1
            end, i = i, i + 1
            if req.finished:  # aborted since: its rows are discarded
                continue
            accepted = 0
            for row in range(start, end + 1):
                res = self._emit(req, tokens[row], row, logprobs)
                results.append(res)
                if res.finished or tokens[row] != drafts[row]:
                    break
                accepted += 1  # the proposal is the token: its KV (row + 1's input) is valid
                req.cached_len += 1
                req.device_len += 1
            self.spec_proposed += end - start
            self.spec_accepted += accepted
            req.spec.update(end - start, accepted)
            if not req.finished:
                keep = pages_for(req.cached_len, self.page_size)
                self.cache.free(req.pages[keep:])
                del req.pages[keep:]
        return results

    def _pooled(self, req: Req) -> list[float]:
        """An embedding request's vector: its pooled sum (a mean divides by the prompt's length),
        L2-normalised."""
        assert req.embedding is not None
        v = req.embedding / req.prompt_len if self.engine.pooling == "mean" else req.embedding
        return (v / v.norm().clamp_min(1e-12)).tolist()

    def _collect_prompt_logprobs(self, batch: Batch, host: tuple) -> None:
        """Give each request its rows of the step's prompt log-probabilities."""
        token, rank, top_vals, top_ids = host
        start = 0
        for req, n in zip(batch.reqs, batch.prompt_counts or []):
            if n and not req.finished and req.prompt_logprobs is not None:
                k = req.sampling_params.prompt_logprobs or 0
                vals = top_vals[start : start + n, :k] if k else None
                ids = top_ids[start : start + n, :k] if k else None
                req.prompt_logprobs.extend(token[start : start + n], rank[start : start + n], vals, ids)
            start += n

    def _grammar_finish(self, req: Req, token: int) -> tuple[FinishReason | None, str | None]:
        """Advance the request's matcher: STOP once its grammar is complete (and ended by a stop token)."""
        if not req.grammar.accept_token(token):  # the mask allowed only what the matcher accepts
            logger.error(f"request {req.uid}: token {token} was sampled outside its grammar")
            return FinishReason.ERROR, f"token {token} was sampled outside the request's grammar"
        return (FinishReason.STOP, None) if req.grammar.is_terminated() else (None, None)

    def _finish_reason(self, req: Req, token: int) -> FinishReason | None:
        params = req.sampling_params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if len(req.token_ids) >= req.max_total_len:
            return FinishReason.LENGTH
        return None

    def flush_cache(self) -> int | None:
        """Empty the prefix cache, as SGLang's /flush_cache does: only when no request runs or waits
        (a running request holds cached pages). The pages freed, or None when refused."""
        if self.has_work or self.reqs:
            return None
        return self.cache.flush()

    # ---- introspection ---------------------------------------------------------------------------
    def num_free_pages(self) -> int:
        return self.cache.num_free

    def stats(self) -> dict[str, float]:
        s = dict(self.prefill.stats)
        used = self.num_total_pages - self.cache.num_free
        s.update(
            num_running=len(self.decode.running) + (1 if self.prefill.chunked else 0),
            num_waiting=len(self.prefill.waiting) + len(self.grammar.compiling),
            kv_used_pages=used,
            kv_total_pages=self.num_total_pages,
            kv_cached_pages=self.cache.cache.cached_pages,
            num_retractions=self.num_retractions,
            last_batch_size=self.last_batch_size,
            max_batch_size=self.max_batch_size,
            spec_proposed_tokens=self.spec_proposed,
            spec_accepted_tokens=self.spec_accepted,
            spec_verify_steps=self.spec_steps,
        )
        return s

    def check_integrity(self, full: bool = True) -> None:
        """Call when idle: every page must be free or held by the cache, every slot free (`full`: each
        page checked, not only the counts)."""
        assert not self.has_work, "integrity is checked when idle"
        problem = self.cache.check_integrity(full)
        if problem is None and self.table.num_free != self.table.capacity:
            problem = f"{self.table.capacity - self.table.num_free} request slots still taken"
        if problem is not None:
            logger.error(f"KV INTEGRITY CHECK FAILED: {problem}")
            raise AssertionError(problem)

    def shutdown(self) -> None:
        self._in_flight = None
        self.grammar.shutdown()
        self.engine.shutdown()
