"""Incremental detokenization: one token in, the new text out, as soon as it is safe to show.

Text is held back while it ends in an incomplete UTF-8 character (the decoder yields U+FFFD there) and while
its end could be the start of a stop string; a stop string is cut off and never shown. A character still
incomplete when the output ends (max_tokens) is dropped. Each request decodes
only a small window of its latest tokens, so the cost per token does not grow with the output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from minisgl.core import FinishReason
from minisgl.message import DetokenizeMsg, DetokenizeStartMsg, TokenLogprob, UserReply
from minisgl.utils import init_logger

logger = init_logger(__name__)

PROMPT_CONTEXT = (
    4  # last prompt tokens decoded before the first output token (word-boundary spaces come out right)
)


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE table, inverted: the printable character a vocabulary writes for each byte ->
    the byte (printable bytes stand for themselves, the other 68 for the characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1)]
    printable += range(ord("\xae"), ord("\xff") + 1)
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


class TokenBytes:
    """The bytes one token id stands for, from its vocabulary piece: byte-level BPE pieces through GPT-2's
    table, SentencePiece's `<0xNN>` byte pieces and '\u2581' (a space); other tokenizers (and special
    tokens) as the UTF-8 of the token decoded alone. A piece may hold part of a UTF-8 character."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        # byte-level vocabularies hold "\u0120" (a space) and "\u010a" (a newline); SentencePiece "<0x0A>"
        self.kind = "sentencepiece" if "<0x0A>" in vocab else "byte_level" if "\u010a" in vocab else "text"
        self.added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}  # stored as text
        self.table = _byte_level_decoder()
        self.known: dict[int, bytes] = {}  # at most one entry per vocabulary id

    def __call__(self, token_id: int) -> bytes:
        if token_id not in self.known:
            self.known[token_id] = self._bytes(token_id)
        return self.known[token_id]

    def _bytes(self, token_id: int) -> bytes:
        piece = None if token_id in self.added else self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and self.kind == "byte_level" and all(c in self.table for c in piece):
            return bytes(self.table[c] for c in piece)
        if isinstance(piece, str) and self.kind == "sentencepiece":
            m = _BYTE_TOKEN.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8", "replace")


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
    cached_tokens: int = 0  # prompt tokens the prefix cache held (the scheduler says so with each token)
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
        self.token_bytes = TokenBytes(tokenizer)
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
                            finish_reason=FinishReason.ERROR,
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
                reply = UserReply(msg.uid, finished=True, finish_reason=FinishReason.ERROR, error=error)
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
        st.cached_tokens = msg.cached_tokens or st.cached_tokens
        reply = UserReply(uid, prompt_tokens=st.prompt_len, cached_tokens=st.cached_tokens)
        if msg.error is not None:
            reply.finished, reply.finish_reason, reply.error = True, FinishReason.ERROR, msg.error
            reply.error_param = msg.error_param
            return reply
        if msg.token_id >= 0:
            reply.token_ids = [msg.token_id]
            ends_on_stop_token = msg.finish_reason == FinishReason.STOP and msg.token_id in st.stop_token_ids
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
                reply.finished, reply.finish_reason = True, FinishReason.STOP
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
        return TokenLogprob(
            text(msg.token_id),
            msg.token_id,
            float(msg.logprob),
            top,
            token_bytes=self.token_bytes(msg.token_id),
            top_bytes=[self.token_bytes(t) for _, t, _ in top],
        )
