"""The tokenizer / detokenizer worker process.

Roles: "both" (`--num-tokenizer 0`: one process tokenizes requests and detokenizes replies), "tokenizer"
(one of N; the API server's PUSH spreads requests over them) and "detokenizer" (the single one that every
scheduler reply goes through).
"""

from __future__ import annotations

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
    ) -> None:
        assert role in ROLES, role
        self.role = role
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
            msgs = [self.recv.get()] + self.recv.get_all()  # block for one, then take whatever else waits
            self.handle(msgs)

    def handle(self, msgs: list[Any]) -> None:
        replies: list[UserReply] = []
        for msg in msgs:
            if isinstance(msg, TokenizeMsg):
                replies += self._tokenize(msg)
            elif isinstance(msg, AbortMsg):
                self.send_backend.put(msg)
            elif isinstance(msg, DetokenizeStartMsg):
                replies += self._detokenize_start(msg)
            elif isinstance(msg, BatchDetokenizeMsg):
                replies += self._detokenize(msg.msgs)
            elif isinstance(msg, StatsMsg):
                assert self.send_frontend is not None
                self.send_frontend.put(msg)
            else:
                raise TypeError(f"the {self.role} worker cannot handle {type(msg).__name__}")
        if replies:
            assert self.send_frontend is not None
            self.send_frontend.put(BatchFrontendMsg(replies))

    def _tokenize(self, msg: TokenizeMsg) -> list[UserReply]:
        try:
            input_ids = self.tokenize_mgr.tokenize(msg)
            if not input_ids:
                raise ValueError("the prompt is empty after tokenization")
            ids = torch.tensor(input_ids, dtype=torch.int32)  # raises for ids beyond int32
        except Exception as e:  # noqa: BLE001 - a bad prompt must not take the worker down, only fail itself
            error = DetokenizeMsg(
                msg.uid,
                finished=True,
                finish_reason="error",
                error=f"cannot tokenize: {e}",
                error_param="prompt",
            )
            if self.send_detokenizer is not None:
                self.send_detokenizer.put(BatchDetokenizeMsg([error]))
                return []
            return self.detokenize_mgr.feed([error])[0]
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
    worker = TokenizerWorker(
        role, tokenizer, recv_addr, recv_create, backend_addr, frontend_addr, detokenizer_addr
    )
    logger.info(f"{worker_name} ready ({role})")
    if ack_queue is not None:
        ack_queue.put((worker_name, {}))
    try:
        worker.run_forever()
    finally:
        worker.stop()
