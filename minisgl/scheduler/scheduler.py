"""The Scheduler: decides what runs each step and where the KV goes; the Engine computes.

One `step()` with overlap scheduling: prepare and launch step N, then (while the device computes it)
process the results of step N-1. Decode input tokens come from the device token pool, so step N can be
prepared before step N-1's tokens reach the host. A token computed for a request that finished in the
meantime is discarded, never reported.

A step with rows under a grammar (scheduler/grammar.py) needs, for their token masks, the tokens of step
N-1: the engine's forward of step N is launched first, then step N-1 is processed (its tokens advance the
matchers), then the masks are filled and step N samples. A step with no constrained row runs as before."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from minisgl.core import Batch, FinishReason, InvalidRequest, Phase, Req, SamplingParams
from minisgl.engine import Engine, ForwardOutput, Logits
from minisgl.env import ENV
from minisgl.utils import init_logger
from minisgl.utils.device import create_stream, current_stream, use_stream

from .batch_builder import BatchBuilder
from .cache import CacheManager
from .config import SchedulerConfig
from .decode import DecodeManager
from .grammar import GrammarManager
from .output import OutputProcessor, StepOutput
from .pacing import PrefillPacer, attention_ratio
from .prefill import PrefillManager, pages_for
from .speculative import SpecState, StepCosts, create_proposer
from .table import TableManager

logger = init_logger(__name__)


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
        self.batches = BatchBuilder(
            self.cache, self.decode, self.grammar, self.device, self.vocab_size, self.engine.pooling
        )
        self.output = OutputProcessor(self.eos_token_ids, self.engine.pooling, self._end)
        # the engine computes on this stream; batches are prepared on the current one
        self.stream = create_stream(self.device)
        self._in_flight: tuple[Batch, ForwardOutput] | None = None
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
        if batch is not None and batch.grammar_rows is not None:
            fwd = self._launch_forward(batch)  # its masks need the tokens of the step in flight
        elif batch is not None and self._times_steps(batch):
            start = time.perf_counter()
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
            return self.batches.prefill(plan)
        return self._prepare_decode()

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
        return self.batches.decode_step(reqs)

    def _prepare_verify(self, reqs: list[Req]) -> Batch | None:
        """A verify step: each request's proposals in rows after its last token (scheduler/speculative.py).
        None when no request has a proposal or the pool cannot hold them (a plain decode step then)."""
        max_k = self.config.num_speculative_tokens
        rooms = []
        for r in reqs:
            if r.spec is None:
                r.spec = SpecState()
            # no proposals under a grammar (the masks follow the matcher one token a step), nor beyond the
            # request's last position
            room = r.max_total_len - r.device_len - 1
            rooms.append(room if r.grammar is None and room > 0 and r.spec.ready() else 0)
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
        self.batches.to_device(batch, positions, out_loc, [p + 1 for p in positions], spec_parts=writes)
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

    # ---- results ---------------------------------------------------------------------------------
    def _process(self, batch: Batch, out: ForwardOutput) -> list[StepOutput]:
        out.wait()  # the only host synchronisation of a step
        tokens = out.next_tokens_host.tolist()
        if batch.drafts is not None:
            return self._process_verify(batch, tokens, out.logprobs_host)
        return self.output.process(batch, tokens, out)

    def _end(self, req: Req) -> None:
        """A finished request gives back its slot, pages and matcher, and is forgotten."""
        self.decode.remove(req)
        self._release(req)
        self.grammar.release(req)
        self.reqs.pop(req.uid, None)

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
                res = self.output.emit(req, tokens[row], row, logprobs)
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
