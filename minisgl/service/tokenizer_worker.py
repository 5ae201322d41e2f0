"""The tokenizer / detokenizer worker process.

Roles: "both" (`--num-tokenizer 0`: one process tokenizes requests and detokenizes replies), "tokenizer"
(one of N; the API server's PUSH spreads requests over them) and "detokenizer" (the single one that every
scheduler reply goes through).

A request never takes the worker down: whatever goes wrong while handling one message becomes an error
reply for its uid. Tokenizing a large prompt must not stall the other requests' streams: in "both" the
prompts are tokenized by a thread of their own (the Hugging Face tokenizer releases the GIL while it
encodes, and the chat template yields it every few ms), which sends its results to the scheduler and,
through this process's own socket, to the detokenizer, exactly as a separate tokenizer process does.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections import deque
from typing import Any

import torch

from minisgl.core import FinishReason, InvalidRequest
from minisgl.grammar import check_grammar
from minisgl.message import (
    AbortMsg,
    DetokenizeMsg,
    DetokenizeStartMsg,
    FlushCacheMsg,
    ReplyBatch,
    StatsMsg,
    TokenBatch,
    TokenizeMsg,
    UserMsg,
    UserReply,
    dumps,
    loads,
)
from minisgl.tokenizer import DetokenizeManager, TokenizeManager
from minisgl.utils import init_logger
from minisgl.utils.hf import load_tokenizer

from .zmq_queue import ZmqPullQueue, ZmqPushQueue

ROLES = ("both", "tokenizer", "detokenizer")
INT32_MAX = 2**31 - 1  # the prompt travels as an int32 tensor

logger = init_logger(__name__)


def model_vocab_size(model_path: str, tokenizer: Any) -> int:
    """The model's vocabulary (config.json), which token ids are checked against before they are narrowed
    to int32; the tokenizer's size where there is no config."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
        vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        if isinstance(vocab, int) and vocab > 0:
            return min(vocab, INT32_MAX)
    except (OSError, ValueError):
        pass
    return min(len(tokenizer), INT32_MAX)


class PromptTokenizer:
    """Tokenizes requests: the UserMsg goes to the scheduler, the DetokenizeStartMsg (or the request's error)
    to the detokenizer. Owns its two sockets, so only one thread may use it."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        backend_addr: str,
        detokenizer_addr: str,
        allow_special: bool = False,
    ) -> None:
        self.mgr = TokenizeManager(tokenizer, allow_special_in_content=allow_special)
        self.vocab_size = vocab_size
        self.send_backend: ZmqPushQueue[Any] = ZmqPushQueue(backend_addr, create=False, encoder=dumps)
        self.send_detokenizer: ZmqPushQueue[Any] = ZmqPushQueue(detokenizer_addr, create=False, encoder=dumps)
        self._last: tuple[Any, list[int]] | None = None  # the n choices of a prompt are tokenized once

    def handle(self, msg: TokenizeMsg) -> None:
        try:
            self._tokenize(msg)
        except Exception as e:  # noqa: BLE001 - a bad prompt must not take the worker down, only fail itself
            if isinstance(e, InvalidRequest):
                text, param = str(e), e.param
            else:
                text, param = f"cannot tokenize: {e}", "prompt"
            error = DetokenizeMsg(
                msg.uid, finished=True, finish_reason=FinishReason.ERROR, error=text, error_param=param
            )
            self.send_detokenizer.put(TokenBatch.of([error]))

    def _ids(self, msg: TokenizeMsg) -> list[int]:
        key = (msg.text, msg.messages, msg.input_ids, msg.tools, msg.chat_template_kwargs)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        ids = self.mgr.tokenize(msg)
        self._last = (key, ids)
        return ids

    def _check_ids(self, ids: list[int], param: str, what: str) -> None:
        # before the int32 tensor: an id beyond it would raise there, or wrap
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise InvalidRequest(f"{what} must be in [0, {self.vocab_size})", param)

    def _tokenize(self, msg: TokenizeMsg) -> None:
        # the constraint's type, size and syntax (the scheduler's compile processes parse it with xgrammar)
        check_grammar(msg.sampling_params, parse=False)
        input_ids = self._ids(msg)
        if not input_ids:
            raise InvalidRequest("the prompt is empty after tokenization", "prompt")
        self._check_ids(input_ids, "prompt", "prompt token ids")
        self._check_ids(msg.sampling_params.stop_token_ids, "stop_token_ids", "'stop_token_ids'")
        ids = torch.tensor(input_ids, dtype=torch.int32)
        start = DetokenizeStartMsg(
            uid=msg.uid,
            prompt_len=len(input_ids),
            prompt_tail=input_ids[-8:],
            stop=msg.stop,
            stop_token_ids=list(msg.sampling_params.stop_token_ids),
            logprobs=msg.sampling_params.logprobs,
        )
        # the detokenizer keeps tokens that outrun their start message until it arrives
        self.send_detokenizer.put(start)
        self.send_backend.put(UserMsg(msg.uid, ids, msg.sampling_params, max_tokens_auto=msg.max_tokens_auto))

    def stop(self) -> None:
        self.send_backend.stop()
        self.send_detokenizer.stop()


class TokenizeThread(threading.Thread):
    """A PromptTokenizer in a thread of its own, fed through a queue (`put`; None stops it)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, backend_addr: str, detokenizer_addr: str, allow_special: bool
    ) -> None:
        super().__init__(name="minisgl-tokenize", daemon=True)
        self.args = (tokenizer, vocab_size, backend_addr, detokenizer_addr, allow_special)
        self.inbox: queue.Queue[TokenizeMsg | None] = queue.Queue()

    def put(self, msg: TokenizeMsg | None) -> None:
        self.inbox.put(msg)

    def run(self) -> None:
        tokenizer = PromptTokenizer(*self.args)  # its sockets are made and used in this thread only
        try:
            while (msg := self.inbox.get()) is not None:
                tokenizer.handle(msg)
        finally:
            tokenizer.stop()


class TokenizerWorker:
    """Owns the sockets of one worker and routes every message it receives."""

    def __init__(
        self,
        role: str,
        tokenizer: Any,
        recv_addr: str,
        recv_create: bool,
        backend_addr: str,
        frontend_addrs: list[str] | None,
        detokenizer_addr: str | None,
        vocab_size: int = INT32_MAX,
        stream_interval: int = 1,
        allow_special: bool = False,  # special tokens typed in user content stay special
    ) -> None:
        assert role in ROLES, role
        self.role = role
        self.detokenize_mgr = DetokenizeManager(tokenizer, stream_interval)
        self.recv: ZmqPullQueue[Any] = ZmqPullQueue(recv_addr, create=recv_create, decoder=loads)
        self.send_backend: ZmqPushQueue[Any] = ZmqPushQueue(backend_addr, create=False, encoder=dumps)
        self.send_frontends: list[ZmqPushQueue[Any]] = []  # one per API server
        self.tokenizer: PromptTokenizer | None = None  # "tokenizer": prompts are tokenized inline
        self.thread: TokenizeThread | None = None  # "both": by a thread, between the replies
        self.pending: deque[TokenizeMsg] = deque()  # "tokenizer": prompts received, not yet tokenized
        if role in ("both", "detokenizer"):
            assert frontend_addrs
            self.send_frontends = [ZmqPushQueue(a, create=False, encoder=dumps) for a in frontend_addrs]
        if role == "tokenizer":
            assert detokenizer_addr is not None
            self.tokenizer = PromptTokenizer(
                tokenizer, vocab_size, backend_addr, detokenizer_addr, allow_special
            )
        if role == "both":  # the thread sends its detokenizer messages to this process's own socket
            self.thread = TokenizeThread(tokenizer, vocab_size, backend_addr, recv_addr, allow_special)
            self.thread.start()

    def run_forever(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        """Take every waiting message (block for one unless a prompt is pending) and handle them; a
        tokenizer tokenizes one prompt per round, so an abort or the next request never waits long."""
        msgs = [] if self.pending else [self.recv.get()]
        msgs += self.recv.get_all()
        if self.tokenizer is not None:
            self.pending.extend(m for m in msgs if isinstance(m, TokenizeMsg))
            msgs = [m for m in msgs if not isinstance(m, TokenizeMsg)]
            if self.pending:
                msgs.append(self.pending.popleft())
        self.handle([m for m in msgs if m is not None])

    def handle(self, msgs: list[Any]) -> None:
        """Handle every message; the replies of all of them go out as one ReplyBatch."""
        out = ReplyBatch()
        for msg in msgs:
            try:
                self._handle_one(msg, out)
            except Exception as e:  # noqa: BLE001 - one message must not take the worker down (logged)
                for reply in self._failed(msg, e):
                    out.add(reply)
        if len(out):
            assert self.send_frontends
            for send, part in zip(self.send_frontends, out.split(len(self.send_frontends))):
                if len(part):
                    send.put(part)

    def _handle_one(self, msg: Any, out: ReplyBatch) -> None:
        if isinstance(msg, TokenizeMsg):
            if self.thread is not None:
                self.thread.put(msg)
            else:
                assert self.tokenizer is not None, f"the {self.role} worker does not tokenize"
                self.tokenizer.handle(msg)
        elif isinstance(msg, (AbortMsg, FlushCacheMsg)):
            self.send_backend.put(msg)
        elif isinstance(msg, DetokenizeStartMsg):
            replies, stopped = self.detokenize_mgr.start(msg)
            for reply in replies:
                out.add(reply)
            self._abort_stopped(stopped)
        elif isinstance(msg, TokenBatch):
            replies, stopped = self.detokenize_mgr.feed_batch(msg)
            out.extend(replies)
            self._abort_stopped(stopped)
        elif isinstance(msg, StatsMsg):
            assert self.send_frontends
            for send in self.send_frontends:  # every API server reports them
                send.put(msg)
        else:
            raise TypeError(f"the {self.role} worker cannot handle {type(msg).__name__}")

    def _failed(self, msg: Any, e: Exception) -> list[UserReply]:
        """The error replies for the requests `msg` belongs to; each of them is aborted."""
        logger.exception(f"the {self.role} worker failed on a {type(msg).__name__}")
        text = f"the request failed in the {self.role} worker: {type(e).__name__}: {e}"
        uids = list(msg.uids) if isinstance(msg, TokenBatch) else []
        uids += [msg.uid] if isinstance(msg, (DetokenizeStartMsg, TokenizeMsg)) else []
        replies = []
        for uid in dict.fromkeys(uids):
            self.detokenize_mgr.drop(uid)
            self.send_backend.put(AbortMsg(uid))
            replies.append(UserReply(uid, finished=True, finish_reason=FinishReason.ERROR, error=text))
        return replies if self.send_frontends else []

    def _abort_stopped(self, uids: list[int]) -> None:
        for uid in uids:  # a stop string ended these: the scheduler stops generating for them
            self.send_backend.put(AbortMsg(uid))

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.put(None)
            self.thread.join(1.0)
        if self.tokenizer is not None:
            self.tokenizer.stop()
        for q in (self.recv, self.send_backend, *self.send_frontends):
            q.stop()


def tokenize_worker(
    *,
    role: str,
    worker_name: str,
    tokenizer_path: str,
    recv_addr: str,
    recv_create: bool,
    backend_addr: str,
    frontend_addrs: list[str] | None = None,
    detokenizer_addr: str | None = None,
    stream_interval: int = 1,
    ack_queue: Any = None,
    allow_special_tokens_in_content: bool = False,
) -> None:
    """Process entry: load the tokenizer, connect, report ready, then serve until killed."""
    logger = init_logger(__name__, worker_name)
    torch.set_num_threads(1)  # the scheduler needs the cores
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = model_vocab_size(tokenizer_path, tokenizer)
    worker = TokenizerWorker(
        role,
        tokenizer,
        recv_addr,
        recv_create,
        backend_addr,
        frontend_addrs,
        detokenizer_addr,
        vocab,
        stream_interval,
        allow_special_tokens_in_content,
    )
    logger.info(f"{worker_name} ready ({role})")
    if ack_queue is not None:
        ack_queue.put((worker_name, {}))
    try:
        worker.run_forever()
    finally:
        worker.stop()
