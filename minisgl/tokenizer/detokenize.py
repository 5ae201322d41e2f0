"""Incremental detokenization: one token in, the new text out, as soon as it is safe to show.

Text is held back while it ends in an incomplete UTF-8 character (the decoder yields U+FFFD there) and while
its end could be the start of a stop string; a stop string is cut off and never shown. A character still
incomplete when the output ends (max_tokens) is dropped. Each request decodes
only a small window of its latest tokens, so the cost per token does not grow with the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.message import DetokenizeMsg, DetokenizeStartMsg, TokenLogprob, UserReply
from minisgl.utils import init_logger

logger = init_logger(__name__)

PROMPT_CONTEXT = (
    4  # last prompt tokens decoded before the first output token (word-boundary spaces come out right)
)


@dataclass
class _DecodeState:
    prompt_len: int
    stop: list[str]
    stop_token_ids: set[int]
    logprobs: bool
    ids: list[int]  # a few prompt tokens, then every output token
    num_context: int  # how many of `ids` come from the prompt
    prefix_offset: int = 0  # window start: decoded only as context for the next tokens
    read_offset: int = 0  # tokens before this are already in `text`
    text: str = ""  # complete output text so far
    sent: int = 0  # characters of `text` already sent
    max_stop: int = field(init=False)

    def __post_init__(self) -> None:
        self.read_offset = len(self.ids)
        self.max_stop = max((len(s) for s in self.stop), default=0)

    @property
    def completion_tokens(self) -> int:
        return len(self.ids) - self.num_context


class DetokenizeManager:
    """Per-request decoding state; `feed` returns the replies for the API server and the uids whose stop
    string was hit (the scheduler must abort them)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[int, _DecodeState] = {}
        self.early: dict[int, list[DetokenizeMsg]] = {}  # tokens that outran their DetokenizeStartMsg
        self.dropped: set[int] = set()  # ended here (stop string); the scheduler's last message is ignored

    def start(self, msg: DetokenizeStartMsg) -> tuple[list[UserReply], list[int]]:
        context = list(msg.prompt_tail[-PROMPT_CONTEXT:])
        self.states[msg.uid] = _DecodeState(
            prompt_len=msg.prompt_len,
            stop=[s for s in msg.stop if s],
            stop_token_ids=set(msg.stop_token_ids),
            logprobs=msg.logprobs,
            ids=context,
            num_context=len(context),
        )
        early = self.early.pop(msg.uid, [])
        return self.feed(early) if early else ([], [])

    def feed(self, msgs: list[DetokenizeMsg]) -> tuple[list[UserReply], list[int]]:
        replies: list[UserReply] = []
        stopped: list[int] = []
        for msg in msgs:
            if msg.uid in self.dropped:
                if msg.finished:
                    self.dropped.discard(msg.uid)
                continue
            state = self.states.get(msg.uid)
            if state is None:
                if msg.error is not None:  # rejected before it was registered here
                    replies.append(
                        UserReply(
                            msg.uid,
                            finished=True,
                            finish_reason="error",
                            error=msg.error,
                            error_param=msg.error_param,
                        )
                    )
                else:
                    self.early.setdefault(msg.uid, []).append(msg)
                continue
            try:
                reply = self._step(msg.uid, state, msg)
            except Exception as e:
                logger.exception(f"detokenizing request {msg.uid} failed")
                error = f"the request failed in the detokenizer: {type(e).__name__}: {e}"
                reply = UserReply(msg.uid, finished=True, finish_reason="error", error=error)
                msg = DetokenizeMsg(msg.uid, finished=msg.finished)  # unfinished: aborted (below)
            replies.append(reply)
            if reply.finished:
                del self.states[msg.uid]
                if not msg.finished:  # our stop string, not the scheduler's decision
                    self.dropped.add(msg.uid)
                    stopped.append(msg.uid)
        return replies, stopped

    def drop(self, uid: int) -> None:
        """Forget a request that failed here; the scheduler's messages for it are ignored until its last."""
        if self.states.pop(uid, None) is not None:
            self.dropped.add(uid)
        self.early.pop(uid, None)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _step(self, uid: int, st: _DecodeState, msg: DetokenizeMsg) -> UserReply:
        reply = UserReply(uid, prompt_tokens=st.prompt_len)
        if msg.error is not None:
            reply.finished, reply.finish_reason, reply.error = True, "error", msg.error
            reply.error_param = msg.error_param
            return reply
        if msg.token_id >= 0:
            reply.token_ids = [msg.token_id]
            ends_on_stop_token = msg.finish_reason == "stop" and msg.token_id in st.stop_token_ids
            st.ids.append(msg.token_id)
            if ends_on_stop_token:  # like a stop string, a stop token is not part of the text
                st.read_offset = len(st.ids)
            else:
                self._advance(st, final=msg.finished)
            if st.logprobs and msg.logprob is not None:
                reply.logprobs = [self._logprob(msg)]
        elif msg.finished:
            self._advance(st, final=True)
        reply.completion_tokens = st.completion_tokens

        end = len(st.text)
        if st.stop:
            hit = self._find_stop(st)
            if hit >= 0:
                reply.text = st.text[st.sent : hit]
                st.sent = len(st.text)
                reply.finished, reply.finish_reason = True, "stop"
                return reply
            if not msg.finished:
                end -= self._stop_prefix_len(st)
        reply.text = st.text[st.sent : end]
        st.sent = end
        if msg.finished:
            reply.finished, reply.finish_reason = True, msg.finish_reason
        return reply

    def _advance(self, st: _DecodeState, final: bool) -> None:
        """Move the newly complete characters of the token window into `text`."""
        if st.read_offset >= len(st.ids):
            return
        prefix = self._decode(st.ids[st.prefix_offset : st.read_offset])
        full = self._decode(st.ids[st.prefix_offset :])
        if len(full) <= len(prefix) and not final:
            return  # a special token or a byte fragment: nothing new yet
        new = full[len(prefix) :]
        if new.endswith("\ufffd"):
            if not final:
                return  # an incomplete UTF-8 character: wait for its other bytes
            new = new.rstrip("\ufffd")  # cut off by the end of the output: never completed, never shown
        st.text += new
        st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)

    def _find_stop(self, st: _DecodeState) -> int:
        # a stop string cannot start in text already sent: that text was never a possible stop prefix
        hits = [i for i in (st.text.find(s, st.sent) for s in st.stop) if i >= 0]
        return min(hits) if hits else -1

    def _stop_prefix_len(self, st: _DecodeState) -> int:
        """Length of the longest unsent tail of the text that some stop string starts with."""
        tail = st.text[st.sent :]
        for k in range(min(st.max_stop - 1, len(tail)), 0, -1):
            if any(s.startswith(tail[-k:]) for s in st.stop):
                return k
        return 0

    def _logprob(self, msg: DetokenizeMsg) -> TokenLogprob:
        def text(t: int) -> str:  # special tokens stay visible here: a logprob must name its token
            return self.tokenizer.decode([t], skip_special_tokens=False)

        top = [(text(t), int(t), float(lp)) for t, lp in (msg.top_logprobs or [])]
        return TokenLogprob(text(msg.token_id), msg.token_id, float(msg.logprob), top)
