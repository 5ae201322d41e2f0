"""The scheduler process's IO loop: requests in over ZMQ, one scheduling step, tokens out.

Only rank 0 talks to the tokenizer side. Every loop iteration it forwards what it received (possibly
nothing) verbatim to the other ranks over PUB/SUB, and every rank applies the same messages before the
same step, so all ranks make identical decisions. Idle ranks block on their socket; busy ranks only poll.
The fan-out is an ipc socket within node 0; ranks on other nodes subscribe over TCP (the port goes to
them over torch.distributed), and since their own launcher cannot see node 0's processes, an idle rank 0
sends an empty batch every HEARTBEAT seconds and a last one on its way out: a rank that hears nothing
for `silence_timeout` seconds stops with an error.
A message that fails (a request the scheduler refuses, or anything raised while adding it) becomes an
error reply for its uid; the loop goes on.
This module is the service's: the offline path (LLM) never imports it.
"""

from __future__ import annotations

import time
from typing import Any

from minisgl.core import FinishReason, InvalidRequest
from minisgl.distributed import broadcast_object
from minisgl.env import ENV
from minisgl.message import (
    AbortMsg,
    BackendMsg,
    BatchBackendMsg,
    DetokenizeMsg,
    FlushCacheMsg,
    StatsMsg,
    TokenBatch,
    UserMsg,
    dumps,
    loads,
)
from minisgl.scheduler import Scheduler, StepOutput
from minisgl.utils import init_logger

from .zmq_queue import ZmqPubQueue, ZmqPullQueue, ZmqPushQueue, ZmqSubQueue

logger = init_logger(__name__)

STATS_INTERVAL = 0.5  # seconds between statistics updates to the API server while busy
ABORT_MEMORY = 600.0  # seconds an abort for a not-yet-seen uid is remembered (N tokenizers can reorder)
HEARTBEAT = 1.0  # seconds between an idle rank 0's empty batches when ranks run on other nodes


class SchedulerIO:
    """Drives one Scheduler from ZMQ messages. Rank 0 binds `backend_addr` (PULL) and the broadcast
    address (PUB); it pushes results to `detokenizer_addr`. Other ranks only subscribe."""

    def __init__(
        self,
        scheduler: Scheduler,
        backend_addr: str,
        detokenizer_addr: str,
        broadcast_addr: str,
        rank: int = 0,
        world_size: int = 1,
        tcp_host: str | None = None,
        same_node: bool = True,
        silence_timeout: float = 120.0,
    ) -> None:
        """`tcp_host`: node 0's address when ranks run on other nodes (None: one node); `same_node`:
        whether this rank runs on node 0 (it then subscribes over ipc)."""
        self.scheduler = scheduler
        self.rank, self.world_size = rank, world_size
        self.recv: ZmqPullQueue[BackendMsg] | None = None
        self.send: ZmqPushQueue[Any] | None = None
        self.pub: ZmqPubQueue[BatchBackendMsg] | None = None
        self.sub: ZmqSubQueue[BatchBackendMsg] | None = None
        self.multi_node, self.silence_timeout = tcp_host is not None, silence_timeout
        if rank == 0:
            self.recv = ZmqPullQueue(backend_addr, create=True, decoder=loads)
            self.send = ZmqPushQueue(detokenizer_addr, create=False, encoder=dumps)
            if world_size > 1:
                self.pub = ZmqPubQueue(broadcast_addr, encoder=dumps)
            if self.pub is not None and tcp_host is not None:
                broadcast_object(f"tcp://{tcp_host}:{self.pub.bind_tcp()}")
        else:
            remote = broadcast_object() if tcp_host is not None else None
            self.sub = ZmqSubQueue(broadcast_addr if same_node else remote, decoder=loads)
        self.live: set[int] = set()  # uids added and not finished
        self.arrived: dict[int, float] = {}  # uids added whose first token is not out yet: when added
        self.early_aborts: dict[int, float] = {}  # aborts that arrived before their request
        self.outbox = TokenBatch()  # rows produced outside step(): errors, aborts
        self.idle_checked = True
        self.last_stats = 0.0
        self.counters = {
            "integrity_checks": 0,
            "integrity_failures": 0,
            "aborted_requests": 0,
            "rejected_requests": 0,
            "cache_flushes": 0,
            "first_token_seconds_sum": 0.0,  # from a request's arrival here to its first token
            "first_token_count": 0,
        }

    def wait_for_ranks(self, timeout: float = 600.0) -> None:
        """Rank 0: return once every other rank subscribed (a message sent earlier would be lost)."""
        if self.pub is not None:
            self.pub.wait_for_subscribers(self.world_size - 1, timeout)

    # ---- the loop --------------------------------------------------------------------------------
    def run_forever(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        for msg in self._receive(blocking=not self.scheduler.has_work):
            self._apply(msg)
        batch, self.outbox = self.outbox, TokenBatch()
        if self.scheduler.has_work:
            self.idle_checked = False
            arrived = self.arrived
            for out in self.scheduler.step():
                if out.finished:
                    self.live.discard(out.uid)
                if arrived and (t := arrived.pop(out.uid, None)) is not None:
                    self.counters["first_token_seconds_sum"] += time.perf_counter() - t
                    self.counters["first_token_count"] += 1
                _append(batch, out)
        if self.send is not None and len(batch):
            self.send.put(batch)  # one message per step, whatever the batch size
        if not self.scheduler.has_work and not self.idle_checked:
            self.idle_checked = True
            self._check_integrity()
            self._send_stats()
        elif time.monotonic() - self.last_stats > STATS_INTERVAL:
            self._send_stats()

    def _receive(self, blocking: bool) -> list[BackendMsg]:
        if self.sub is not None:  # rank > 0: exactly one batch per iteration, in rank 0's order
            batch = self.sub.get(self.silence_timeout if self.multi_node else None)
            if batch is None:
                raise RuntimeError(
                    f"rank {self.rank}: nothing from rank 0 for {self.silence_timeout:.0f} s; node 0 is gone"
                )
            assert isinstance(batch, BatchBackendMsg)
            if batch.stop:
                raise SystemExit(0)  # rank 0 stopped: so does this rank (and its node's launcher)
            return batch.msgs
        assert self.recv is not None
        msgs: list[BackendMsg] = []
        if blocking:  # with ranks on other nodes, an idle rank 0 still sends an (empty) batch now and then
            first = self.recv.get(HEARTBEAT if self.multi_node else None)
            msgs = [first] if first is not None else []
        msgs += self.recv.get_all()
        if self.pub is not None:
            self.pub.put(BatchBackendMsg(msgs))  # even when empty: the other ranks step in lockstep
        return msgs

    def _apply(self, msg: BackendMsg) -> None:
        try:
            if isinstance(msg, UserMsg):
                self._add(msg)
            elif isinstance(msg, AbortMsg):
                self._abort(msg.uid)
            elif isinstance(msg, FlushCacheMsg):
                self._flush_cache()
            else:
                raise TypeError(f"the scheduler cannot handle {type(msg).__name__}")
        except Exception as e:  # a message must not take the scheduler down
            logger.exception(f"handling a {type(msg).__name__} failed")
            uid = getattr(msg, "uid", None)
            if isinstance(uid, int) and uid not in self.live:
                error = f"the request failed in the scheduler: {type(e).__name__}: {e}"
                self.outbox.add(
                    DetokenizeMsg(uid, finished=True, finish_reason=FinishReason.ERROR, error=error)
                )

    def _add(self, msg: UserMsg) -> None:
        if self.early_aborts.pop(msg.uid, None) is not None:  # its client is already gone
            self.outbox.add(DetokenizeMsg(msg.uid, finished=True, finish_reason=FinishReason.ABORT))
            return
        try:
            self._admit(msg)
        except ValueError as e:  # the same on every rank: each one skips the request
            self.counters["rejected_requests"] += 1
            param = getattr(e, "param", None)  # an InvalidRequest names the field
            error = DetokenizeMsg(
                msg.uid, finished=True, finish_reason=FinishReason.ERROR, error=str(e), error_param=param
            )
            self.outbox.add(error)
            return
        self.live.add(msg.uid)
        self.arrived[msg.uid] = time.perf_counter()

    def _admit(self, msg: UserMsg) -> None:
        """Add the request to the scheduler; with `max_tokens_auto` a max_tokens too large for the context
        becomes "up to the context" instead of an error."""
        input_ids = msg.input_ids.tolist()
        try:
            self.scheduler.add_request(msg.uid, input_ids, msg.sampling_params)
        except InvalidRequest as e:
            if not (msg.max_tokens_auto and e.param == "max_tokens"):
                raise
            msg.sampling_params.max_tokens = None  # max_tokens was only a ceiling: run up to the context
            self.scheduler.add_request(msg.uid, input_ids, msg.sampling_params)

    def _abort(self, uid: int) -> None:
        self.arrived.pop(uid, None)
        if uid in self.live:
            self.live.discard(uid)
            self.scheduler.abort_request(uid)
            self.counters["aborted_requests"] += 1
            # the detokenizer frees its state for this uid on a finished message
            self.outbox.add(DetokenizeMsg(uid, finished=True, finish_reason=FinishReason.ABORT))
            return
        now = time.monotonic()  # finished already, or its request is still on the way
        self.early_aborts[uid] = now
        if len(self.early_aborts) > 1024:
            self.early_aborts = {u: t for u, t in self.early_aborts.items() if now - t < ABORT_MEMORY}

    def _flush_cache(self) -> None:
        freed = self.scheduler.flush_cache()
        if freed is None:
            logger.warning("Cache not flushed: requests are running or waiting")
            return
        self.counters["cache_flushes"] += 1
        if self.rank == 0:
            logger.info(f"Cache flushed: {freed} pages freed")
        self._send_stats()  # the API server's gauges show the empty cache at once

    def _check_integrity(self) -> None:
        """Idle: every KV page must be free or held by the prefix cache. A leak is logged loudly; with
        MINISGL_STRICT_INTEGRITY=1 it also stops the service, and every page is checked, not only the
        counts (on a GPU's pool of a million pages that took ~100 ms, which a request arriving just then
        waited for)."""
        self.counters["integrity_checks"] += 1
        try:
            self.scheduler.check_integrity(full=ENV.check_integrity)
        except AssertionError as e:
            self.counters["integrity_failures"] += 1
            logger.error(f"!!! KV INTEGRITY CHECK FAILED on rank {self.rank}: {e} !!!")
            if ENV.check_integrity:
                raise

    def _send_stats(self) -> None:
        self.last_stats = time.monotonic()
        if self.send is None:
            return
        stats = {k: float(v) for k, v in self.scheduler.stats().items() if isinstance(v, (int, float))}
        stats.update({k: float(v) for k, v in self.counters.items()})
        self.send.put(StatsMsg(stats))

    def stop(self) -> None:
        if self.pub is not None:  # the ranks on other nodes stop with this one
            self.pub.put(BatchBackendMsg(stop=True))
            self.pub.stop(linger=1.0 if self.multi_node else 0.0)
        for q in (self.recv, self.send, self.sub):
            if q is not None:
                q.stop()


def _append(batch: TokenBatch, out: StepOutput) -> None:
    """One step output as a row of the batch's columns (no object per token on the way out)."""
    i = len(batch.uids)
    batch.uids.append(out.uid)
    batch.token_ids.append(out.token_id)
    if out.finished:
        batch.finish[i] = out.finish_reason or ""
    if out.logprob is not None:
        batch.logprobs[i] = (out.logprob, out.top_logprobs)
    if out.cached_tokens:
        batch.cached_tokens[i] = out.cached_tokens
    if out.error is not None:
        batch.errors[i] = (out.error, out.error_param)
    if (extras := out.extras()) is not None:
        batch.extras[i] = extras
