"""The tokenizer / detokenizer worker process.

Roles: "both" (`--num-tokenizer 0`: one process tokenizes requests and detokenizes replies), "tokenizer"
(one of N; the API server's PUSH spreads requests over them) and "detokenizer" (the single one that every
scheduler reply goes through).

A request never takes the worker down: whatever goes wrong while handling one message becomes an error
reply for its uid. Prompts are tokenized one at a time, with the replies of the other requests in between,
so a large prompt delays the streams by the time of one tokenization, not of a whole batch of them.
"""

from __future__ import annotations

import json
import os
from collections import deque
from typing import Any

import torch

from minisgl.message import (
    AbortMsg,
    BatchDetokenizeMsg,
    BatchFrontendMsg,
    DetokenizeMsg,
    DetokenizeStartMsg,
    StatsMsg,
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


class RequestError(ValueError):
    """A request this worker refuses; `param` names the field by its generic name."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class TokenizerWorker:
    """Owns the sockets of one worker and routes every message it receives."""

    def __init__(
        self,
        role: str,
        tokenizer: Any,
        recv_addr: str,
        recv_create: bool,
        backend_addr: str,
        frontend_addr: str | None,
        detokenizer_addr: str | None,
        vocab_size: int = INT32_MAX,
    ) -> None:
        assert role in ROLES, role
        self.role = role
        self.vocab_size = vocab_size
        self.pending: deque[TokenizeMsg] = deque()  # prompts received and not yet tokenized
        self.tokenize_mgr = TokenizeManager(tokenizer)
        self.detokenize_mgr = DetokenizeManager(tokenizer)
        self.recv: ZmqPullQueue[Any] = ZmqPullQueue(recv_addr, create=recv_create, decoder=loads)
        self.send_backend: ZmqPushQueue[Any] = ZmqPushQueue(backend_addr, create=False, encoder=dumps)
        self.send_frontend: ZmqPushQueue[Any] | None = None
        self.send_detokenizer: ZmqPushQueue[Any] | None = None
        if role in ("both", "detokenizer"):
            assert frontend_addr is not None
            self.send_frontend = ZmqPushQueue(frontend_addr, create=False, encoder=dumps)
        if role == "tokenizer":
            assert detokenizer_addr is not None
            self.send_detokenizer = ZmqPushQueue(detokenizer_addr, create=False, encoder=dumps)

    def run_forever(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        """Take every waiting message (block for one when no prompt is pending), answer everything but the
        prompts at once, then tokenize one prompt."""
        msgs = [] if self.pending else [self.recv.get()]
        msgs += self.recv.get_all()
        self.pending.extend(m for m in msgs if isinstance(m, TokenizeMsg))
        others = [m for m in msgs if m is not None and not isinstance(m, TokenizeMsg)]
        if self.pending:
            others.append(self.pending.popleft())
        self.handle(others)

    def handle(self, msgs: list[Any]) -> None:
        replies: list[UserReply] = []
        for msg in msgs:
            try:
                replies += self._handle_one(msg)
            except Exception as e:  # noqa: BLE001 - one message must not take the worker down
                replies += self._failed(msg, e)
        if replies:
            assert self.send_frontend is not None
            self.send_frontend.put(BatchFrontendMsg(replies))

    def _handle_one(self, msg: Any) -> list[UserReply]:
        if isinstance(msg, TokenizeMsg):
            return self._tokenize(msg)
        if isinstance(msg, AbortMsg):
            self.send_backend.put(msg)
        elif isinstance(msg, DetokenizeStartMsg):
            return self._detokenize_start(msg)
        elif isinstance(msg, BatchDetokenizeMsg):
            return self._detokenize(msg.msgs)
        elif isinstance(msg, StatsMsg):
            assert self.send_frontend is not None
            self.send_frontend.put(msg)
        else:
            raise TypeError(f"the {self.role} worker cannot handle {type(msg).__name__}")
        return []

    def _failed(self, msg: Any, e: Exception) -> list[UserReply]:
        """The error reply for the request `msg` belongs to (a message of several requests: each of them)."""
        if isinstance(e, RequestError):
            text, param = str(e), e.param
        else:
            logger.exception(f"the {self.role} worker failed on a {type(msg).__name__}")
            text, param = f"the request failed in the {self.role} worker: {type(e).__name__}: {e}", None
        if isinstance(msg, TokenizeMsg):
            if param is None:
                text, param = f"cannot tokenize: {e}", "prompt"
            error = DetokenizeMsg(
                msg.uid, finished=True, finish_reason="error", error=text, error_param=param
            )
            if self.send_detokenizer is not None:
                self.send_detokenizer.put(BatchDetokenizeMsg([error]))
                return []
            return self.detokenize_mgr.feed([error])[0]
        uids = [m.uid for m in msg.msgs] if isinstance(msg, BatchDetokenizeMsg) else []
        uids += [msg.uid] if isinstance(msg, DetokenizeStartMsg) else []
        replies = []
        for uid in dict.fromkeys(uids):  # each request of the message ends with the error, and is aborted
            self.detokenize_mgr.drop(uid)
            self.send_backend.put(AbortMsg(uid))
            replies.append(UserReply(uid, finished=True, finish_reason="error", error=text))
        return replies

    def _check_ids(self, ids: list[int], param: str, what: str) -> None:
        # before the int32 tensor: an id beyond it would raise there, or wrap
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise RequestError(f"{what} must be in [0, {self.vocab_size})", param)

    def _tokenize(self, msg: TokenizeMsg) -> list[UserReply]:
        input_ids = self.tokenize_mgr.tokenize(msg)
        if not input_ids:
            raise RequestError("the prompt is empty after tokenization", "prompt")
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
        replies: list[UserReply] = []
        if self.send_detokenizer is not None:  # registered there before the scheduler can answer
            self.send_detokenizer.put(start)
        else:
            replies = self._detokenize_start(start)
        self.send_backend.put(
            UserMsg(
                uid=msg.uid,
                input_ids=ids,
                sampling_params=msg.sampling_params,
                max_tokens_auto=msg.max_tokens_auto,
            )
        )
        return replies

    def _detokenize_start(self, msg: DetokenizeStartMsg) -> list[UserReply]:
        replies, stopped = self.detokenize_mgr.start(msg)
        self._abort_stopped(stopped)
        return replies

    def _detokenize(self, msgs: list[DetokenizeMsg]) -> list[UserReply]:
        replies, stopped = self.detokenize_mgr.feed(msgs)
        self._abort_stopped(stopped)
        return replies

    def _abort_stopped(self, uids: list[int]) -> None:
        for uid in uids:  # a stop string ended these: the scheduler stops generating for them
            self.send_backend.put(AbortMsg(uid))

    def stop(self) -> None:
        for q in (self.recv, self.send_backend, self.send_frontend, self.send_detokenizer):
            if q is not None:
                q.stop()


def tokenize_worker(
    *,
    role: str,
    worker_name: str,
    tokenizer_path: str,
    recv_addr: str,
    recv_create: bool,
    backend_addr: str,
    frontend_addr: str | None = None,
    detokenizer_addr: str | None = None,
    ack_queue: Any = None,
) -> None:
    """Process entry: load the tokenizer, connect, report ready, then serve until killed."""
    logger = init_logger(__name__, worker_name)
    torch.set_num_threads(1)  # the scheduler needs the cores
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = model_vocab_size(tokenizer_path, tokenizer)
    worker = TokenizerWorker(
        role, tokenizer, recv_addr, recv_create, backend_addr, frontend_addr, detokenizer_addr, vocab
    )
    logger.info(f"{worker_name} ready ({role})")
    if ack_queue is not None:
        ack_queue.put((worker_name, {}))
    try:
        worker.run_forever()
    finally:
        worker.stop()
