"""The Scheduler: decides what runs each step and where the KV goes; the Engine computes.

One `step()` with overlap scheduling: prepare and launch step N, then (while the device computes it)
process the results of step N-1. Decode input tokens come from the device token pool, so step N can be
prepared before step N-1's tokens reach the host. A token computed for a request that finished in the
meantime is discarded, never reported.

A step with rows under a grammar (scheduler/grammar.py) needs, for their token masks, the tokens of step
N-1: the engine's forward of step N is launched first, then step N-1 is processed (its tokens advance the
matchers), then the masks are filled and step N samples. A step with no constrained row runs as before.

This file holds the step and the choice of what runs; each resource and each stage has its own file:
table.py (request slots), cache.py (pages and the prefix cache), prefill.py (the queue, admission,
chunks), decode.py (the running set), retraction.py (decode's pages, retracting when the pool is short),
grammar.py (constrained requests and their masks), verify.py (speculative decoding's verify steps),
intake.py (a request's rules and its Req), batch_builder.py (a step's Batch and its device inputs),
launcher.py (the engine's stream) and output.py (a computed step's StepOutputs)."""

from __future__ import annotations

import time

import torch

from minisgl.core import Batch, FinishReason, Req, SamplingParams
from minisgl.engine import Engine, ForwardOutput
from minisgl.env import ENV
from minisgl.utils import init_logger

from .batch_builder import BatchBuilder
from .cache import CacheManager
from .config import SchedulerConfig
from .decode import DecodeManager
from .grammar import GrammarManager
from .intake import RequestLimits, new_req, validate_request
from .launcher import Launcher
from .output import OutputProcessor, StepOutput
from .pacing import PrefillPacer, attention_ratio
from .prefill import PrefillManager
from .retraction import Retraction
from .speculative import Proposer, StepCosts
from .table import TableManager
from .verify import Verifier

logger = init_logger(__name__)


class Scheduler:
    """One per rank: requests in (`add_request`, `abort_request`), `step()` until `has_work` is False."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.engine = Engine(config)  # a SchedulerConfig is an EngineConfig plus the scheduling options
        self.device = self.engine.device
        self.page_size = config.page_size
        self.max_seq_len = self.engine.max_seq_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.eos_token_ids = set(self.engine.model_config.eos_token_ids) | set(config.extra_eos_token_ids)
        # by default on a GPU only: a CPU step runs in this thread, so overlap would only hold each step's
        # tokens back until the next step has run
        default = not ENV.disable_overlap_scheduling and self.device.type != "cpu"
        self.overlap = default if config.overlap is None else config.overlap
        # the managers, each owning one resource
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
        # the stages of a step: build its batch, launch it, turn its tokens into outputs
        pooling = self.engine.pooling
        self.batches = BatchBuilder(
            self.cache, self.decode, self.grammar, self.device, self.vocab_size, pooling
        )
        self.output = OutputProcessor(self.eos_token_ids, pooling, self._end)
        self.retraction = Retraction(self.cache, self.decode, self.prefill, self._release)
        self.verifier = Verifier(
            config, self.cache, self.batches, self.engine, self.output.emit, self.grammar, self.overlap
        )
        self._in_flight: tuple[Batch, ForwardOutput] | None = None
        self._pending_outputs: list[StepOutput] = []
        self._chunk_left = False  # the last prefill step left a prompt's chunk for later
        # while requests decode, a CPU prefill step takes the prompt tokens that fit in a fraction of a
        # second at the measured pace: a chunk then delays the running streams that long, not a long
        # prompt's whole prefill
        cpu = self.device.type == "cpu"
        self.pacer = PrefillPacer(attention_ratio(self.engine.model_config)) if cpu else None
        self.launcher = Launcher(self.engine, self.pacer)
        self.num_total_pages = self.engine.num_pages
        self.pool_tokens = self.num_total_pages * self.page_size
        self.limits = RequestLimits(self.max_seq_len, self.vocab_size, self.pool_tokens)
        logger.info(
            f"Scheduler ready: cache={config.cache_type}, overlap={self.overlap}, "
            f"max_prefill_length={config.max_prefill_length}"
        )

    # ---- requests in -----------------------------------------------------------------------------
    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest naming the field (`prompt`, `max_tokens`, ...) of a request that cannot run.
        The one set of rules for both the offline path and the service."""
        validate_request(input_ids, params, self.limits)

    def add_request(self, uid: int, input_ids: list[int], params: SamplingParams) -> None:
        """Queue a request after `validate`; `params.max_tokens=None` runs up to the context."""
        if uid in self.reqs:
            raise ValueError(f"request uid {uid} is already in use")
        input_ids = [int(t) for t in input_ids]
        self.validate(input_ids, params)
        req = new_req(uid, input_ids, params, self.limits, self.engine.pooling)
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
        # a step's cost for StepCosts is the wall time of this call: with overlap, a decode step's is
        # only while the previous decode step was in flight (it then waits for it: the steady state); a
        # verify step's from after the drain before it (scheduler/speculative.py)
        self._step_start = time.perf_counter()
        steady = self._in_flight is not None or not self.overlap
        batch = self._schedule()
        out = fwd = None
        timed = batch is not None and self.verifier.times_steps(batch, len(self.decode.running))
        if batch is not None and batch.grammar_rows is not None:
            fwd = self.launcher.launch_forward(batch)  # its masks need the tokens of the step in flight
        elif batch is not None:
            out = self.launcher.launch(batch)
        results, self._pending_outputs = self._pending_outputs, []
        if self._in_flight is not None:
            results += self._process(*self._in_flight)
            self._in_flight = None
        if fwd is not None:
            out = self.launcher.launch_sample(batch, fwd, self.grammar.mask)
        if batch is None and not results and self.grammar.compiling:
            self.grammar.wait(0.05)  # nothing to run until a grammar is compiled: do not spin
        if out is not None:
            if self.overlap and batch.drafts is None:  # a verify step's outcome decides the next step
                self._in_flight = (batch, out)
            else:
                results += self._process(batch, out)
        if timed and (steady or batch.drafts is not None):
            self.verifier.step_costs.add(batch.size, time.perf_counter() - self._step_start)
        return results

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

    def _drain(self) -> bool:
        """Process the step in flight now (before a retraction needs exact host state); False if none."""
        if self._in_flight is None:
            return False
        self._pending_outputs += self._process(*self._in_flight)
        self._in_flight = None
        return True

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
        self.launcher.paced = plan is not None and busy is not None
        if plan is not None:
            self._chunk_left = self.prefill.chunked is not None
            return self.batches.prefill(plan)
        return self._prepare_decode()

    def _prepare_decode(self) -> Batch | None:
        running = self.decode.running
        proposing = self.verifier.wants(len(running)) and self.verifier.proposing(running)
        if proposing and self._drain():  # proposals need every request's latest token on the host
            self._step_start = time.perf_counter()
        reqs = self.decode.decodable()
        if not reqs:
            return None
        if proposing and self.verifier.wants(len(reqs)):
            batch = self.verifier.prepare(reqs)
            if batch is not None:
                return batch
        reqs = self.retraction.give_pages(reqs, self._drain)
        if not reqs:
            return None
        return self.batches.decode_step(reqs)

    # ---- results ---------------------------------------------------------------------------------
    def _process(self, batch: Batch, out: ForwardOutput) -> list[StepOutput]:
        out.wait()  # the only host synchronisation of a step
        tokens = out.next_tokens_host.tolist()
        if batch.drafts is not None:
            return self.verifier.process(batch, tokens, out.logprobs_host)
        return self.output.process(batch, tokens, out)

    def _end(self, req: Req) -> None:
        """A finished request gives back its slot, pages and matcher, and is forgotten."""
        self.decode.remove(req)
        self._release(req)
        self.grammar.release(req)
        self.reqs.pop(req.uid, None)

    def _release(self, req: Req) -> None:
        """Give back a request's pages (its computed KV to the prefix cache) and its slot."""
        self.cache.release(req)
        if self.proposer is not None:
            self.proposer.release(req)  # a draft model's pages
        if req.table_idx >= 0:
            self.table.free(req.table_idx)
            req.table_idx, req.table_len = -1, 0

    def flush_cache(self) -> int | None:
        """Empty the prefix cache, as SGLang's /flush_cache does: only when no request runs or waits
        (a running request holds cached pages). The pages freed, or None when refused."""
        if self.has_work or self.reqs:
            return None
        return self.cache.flush()

    # ---- introspection ---------------------------------------------------------------------------
    @property
    def proposer(self) -> Proposer | None:
        """The speculative proposer (the verifier's), None when speculation is off."""
        return self.verifier.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        self.verifier.proposer = proposer

    @property
    def step_costs(self) -> StepCosts:
        return self.verifier.step_costs

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
            num_retractions=self.retraction.num_retractions,
            last_batch_size=self.launcher.last_batch_size,
            max_batch_size=self.launcher.max_batch_size,
            spec_proposed_tokens=self.verifier.spec_proposed,
            spec_accepted_tokens=self.verifier.spec_accepted,
            spec_verify_steps=self.verifier.spec_steps,
        )
        return s

    def check_integrity(self, full: bool = True) -> None:
        """Call when idle: every page must be free or held by the cache, every slot free (`full`: each
        page checked, not only the counts)."""
        assert not self.has_work, "integrity is checked when idle"
        problem = self.cache.check_integrity(full)
        if problem is None and self.table.num_free != self.table.capacity:
            problem = f"{self.table.capacity - self.table.num_free} request slots still taken"
        if problem is None and self.proposer is not None:
            problem = self.proposer.check_idle()
        if problem is not None:
            logger.error(f"KV INTEGRITY CHECK FAILED: {problem}")
            raise AssertionError(problem)

    def shutdown(self) -> None:
        self._in_flight = None
        self.grammar.shutdown()
        if self.proposer is not None:
            self.proposer.shutdown()
        self.engine.shutdown()
