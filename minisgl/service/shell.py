"""`python -m minisgl --shell`: chat with the model in the terminal (streaming, multi-turn).

It talks to the tokenizer and scheduler processes over the same ZMQ messages as the API server, without HTTP.
Commands: /reset clears the conversation, /exit (or Ctrl-D) quits; Ctrl-C stops the answer being written.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from minisgl.core import SamplingParams
from minisgl.message import AbortMsg, ReplyBatch, TokenizeMsg, UserReply, dumps, loads

from .zmq_queue import ZmqPullQueue, ZmqPushQueue

if TYPE_CHECKING:
    from .args import ServerArgs
    from .processes import ServiceProcesses

MAX_ANSWER_TOKENS = 1024  # per answer; lowered automatically when the context has less room


class ChatSession:
    """The conversation and its transport: one request per turn, replies streamed to `write`."""

    def __init__(self, args: ServerArgs, write: Callable[[str], None]) -> None:
        self.send: ZmqPushQueue[Any] = ZmqPushQueue(args.request_addrs, create=False, encoder=dumps)
        self.recv: ZmqPullQueue[Any] = ZmqPullQueue(args.frontend_addr, create=True, decoder=loads)
        self.write = write
        self.history: list[dict[str, str]] = []
        self.uids = itertools.count()
        self.pending: deque[UserReply] = deque()  # replies received, not yet read

    def reset(self) -> None:
        self.history.clear()

    def ask(self, text: str) -> str:
        """Send one user turn, stream the answer; returns it. Ctrl-C aborts the answer (kept as written)."""
        self.history.append({"role": "user", "content": text})
        uid = next(self.uids)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_ANSWER_TOKENS)
        self.send.put(TokenizeMsg(uid, params, messages=list(self.history), max_tokens_auto=True))
        answer = ""
        try:
            while True:
                reply = self._next(uid)
                if reply.error is not None:
                    self.history.pop()  # the turn was rejected (e.g. the conversation is too long)
                    self.write(f"[error: {reply.error}; /reset starts a new conversation]\n")
                    return ""
                answer += reply.text
                self.write(reply.text)
                if reply.finished:
                    break
        except KeyboardInterrupt:
            self.send.put(AbortMsg(uid))
            self.write(" [interrupted]")
        self.write("\n")
        self.history.append({"role": "assistant", "content": answer})
        return answer

    def _next(self, uid: int) -> UserReply:
        """The next reply of `uid` (a batch may hold several); replies of an interrupted earlier turn
        are dropped."""
        while True:
            while self.pending:
                reply = self.pending.popleft()
                if reply.uid == uid:
                    return reply
            msg = self.recv.get()
            if isinstance(msg, ReplyBatch):
                self.pending.extend(msg.replies())

    def stop(self) -> None:
        self.send.stop()
        self.recv.stop()


def run_shell(args: ServerArgs, service: ServiceProcesses) -> int:
    """The interactive loop (prompt_toolkit when stdin is a terminal, plain input() otherwise)."""

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    def on_death(problem: str) -> None:
        sys.stderr.write(f"\n{problem}; the shell stops.\n")
        service.stop()
        os._exit(1)

    service.watch(on_death)
    session = ChatSession(args, write)
    if sys.stdin.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory

        prompt = PromptSession(history=InMemoryHistory()).prompt
    else:
        prompt = input
    write(f"minisgl shell: {args.model_name}. /reset clears the conversation, /exit quits.\n")
    try:
        while True:
            try:
                line = prompt(">>> ").strip()
            except KeyboardInterrupt:
                continue
            except EOFError:
                break
            if not line:
                continue
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                session.reset()
                write("(conversation cleared)\n")
                continue
            session.ask(line)
    finally:
        session.stop()
    return 0
