"""Incremental detokenization: a step's tokens in (one TokenBatch), the new text out (one ReplyBatch), as
soon as it is safe to show.

Text is held back while it ends in an incomplete UTF-8 character (the decoder yields U+FFFD there) and while
its end could be the start of a stop string; a stop string is cut off and never shown. A character still
incomplete when the output ends (max_tokens) is dropped. Each request decodes only a small window of its
latest tokens, so the cost per token does not grow with the output: with a fast (Rust) tokenizer through
the tokenizers library's stream decoder (one call per token, no Python decode), otherwise (a slow
tokenizer, or one that cleans up spaces after decoding) by decoding the window twice in Python. With a
stream interval N a request's text goes out with its first token, then every N tokens and at its end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream

from minisgl.core import FinishReason
from minisgl.message import DetokenizeMsg, DetokenizeStartMsg, ReplyBatch, TokenBatch, TokenLogprob, UserReply
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
    stream: DecodeStream | None  # the Rust decoder's state; None: the window is decoded in Python
    prefix_offset: int = 0  # window start: decoded only as context for the next tokens
    read_offset: int = 0  # tokens before this are already in `text`
    text: str = ""  # complete output text so far
    cached_tokens: int = 0  # prompt tokens the prefix cache held (the scheduler says so with each token)
    sent: int = 0  # characters of `text` already sent
    replies: int = 0  # replies sent
    unsent_ids: list[int] = field(default_factory=list)  # tokens not yet sent in a reply
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)  # once-per-request payloads not yet sent
    max_stop: int = field(init=False)

    def __post_init__(self) -> None:
        self.read_offset = len(self.ids)
        self.max_stop = max((len(s) for s in self.stop), default=0)

    @property
    def completion_tokens(self) -> int:
        return len(self.ids) - self.num_context


def _rust_tokenizer(tokenizer: Any) -> Any:
    """The tokenizers-library Tokenizer under a fast HF tokenizer whose decode is exactly the Rust
    decoder's (no Python clean-up of spaces afterwards); None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class DetokenizeManager:
    """Per-request decoding state; `feed_batch` turns a step's TokenBatch into a ReplyBatch for the API
    server and the uids whose stop string was hit (the scheduler must abort them)."""

    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        assert stream_interval >= 1, stream_interval
        self.tokenizer = tokenizer
        self.interval = stream_interval
        self.rust = _rust_tokenizer(tokenizer)
        self.token_bytes = TokenBytes(tokenizer)
        self.token_text: dict[int, str] = {}  # a token's text decoded alone (for log-probs)
        self.states: dict[int, _DecodeState] = {}
        self.early: dict[int, list[DetokenizeMsg]] = {}  # tokens that outran their DetokenizeStartMsg
        self.dropped: set[int] = set()  # ended here (stop string); the scheduler's last message is ignored

    def start(self, msg: DetokenizeStartMsg) -> tuple[list[UserReply], list[int]]:
        context = list(msg.prompt_tail[-PROMPT_CONTEXT:])
        stream = None
        if self.rust is not None:
            stream = DecodeStream(ids=context, skip_special_tokens=True)
        self.states[msg.uid] = _DecodeState(
            prompt_len=msg.prompt_len,
            stop=[s for s in msg.stop if s],
            stop_token_ids=set(msg.stop_token_ids),
            logprobs=msg.logprobs,
            ids=context,
            num_context=len(context),
            stream=stream,
        )
        early = self.early.pop(msg.uid, [])
        return self.feed(early) if early else ([], [])

    def feed(self, msgs: list[DetokenizeMsg]) -> tuple[list[UserReply], list[int]]:
        """`feed_batch` for rows given as objects, answered as objects (tests, the rare rows)."""
        out, stopped = self.feed_batch(TokenBatch.of(msgs))
        return out.replies(), stopped

    def feed_batch(self, batch: TokenBatch) -> tuple[ReplyBatch, list[int]]:
        out = ReplyBatch()
        stopped: list[int] = []
        states, tokens = self.states, batch.token_ids
        for i, uid in enumerate(batch.uids):
            st = states.get(uid)
            if st is None:
                self._unknown(batch.row(i), out)
                continue
            try:
                ended = self._step(uid, st, batch, i, tokens[i], out)
            except Exception as e:
                logger.exception(f"detokenizing request {uid} failed")
                error = f"the request failed in the detokenizer: {type(e).__name__}: {e}"
                out.add(UserReply(uid, finished=True, finish_reason=FinishReason.ERROR, error=error))
                ended = i not in batch.finish  # not the scheduler's end: abort it (below)
            if ended is not None:
                del states[uid]
                if ended:  # our stop string (or our failure), not the scheduler's decision
                    self.dropped.add(uid)
                    stopped.append(uid)
        return out, stopped

    def _unknown(self, row: DetokenizeMsg, out: ReplyBatch) -> None:
        """A row of a request with no state here: ended here already, rejected early, or early."""
        if row.uid in self.dropped:
            if row.finished:
                self.dropped.discard(row.uid)
        elif row.error is not None:  # rejected before it was registered here
            error = UserReply(row.uid, finished=True, finish_reason=FinishReason.ERROR, error=row.error)
            error.error_param = row.error_param
            out.add(error)
        else:
            self.early.setdefault(row.uid, []).append(row)

    def drop(self, uid: int) -> None:
        """Forget a request that failed here; the scheduler's messages for it are ignored until its last."""
        if self.states.pop(uid, None) is not None:
            self.dropped.add(uid)
        self.early.pop(uid, None)

    def _step(
        self, uid: int, st: _DecodeState, batch: TokenBatch, i: int, token: int, out: ReplyBatch
    ) -> bool | None:
        """Apply row i; append a reply when one is due. Returns None while the request goes on, else
        whether it ended here (a stop string) rather than by the scheduler's word."""
        reason = batch.finish.get(i)
        finished = reason is not None
        if batch.cached_tokens:
            st.cached_tokens = batch.cached_tokens.get(i, st.cached_tokens)
        if batch.extras and i in batch.extras:
            st.extras.update(batch.extras[i])
        if batch.errors and i in batch.errors:
            message, param = batch.errors[i]
            reply = UserReply(uid, finished=True, finish_reason=FinishReason.ERROR, error=message)
            reply.error_param, reply.prompt_tokens = param, st.prompt_len
            out.add(reply)
            return False
        if token >= 0:
            st.unsent_ids.append(token)
            st.ids.append(token)
            if finished and reason == FinishReason.STOP and token in st.stop_token_ids:
                st.read_offset = len(st.ids)  # like a stop string, a stop token is not part of the text
            else:
                self._advance(st, final=finished)
            if st.logprobs and batch.logprobs and i in batch.logprobs:
                st.unsent_logprobs.append(self._logprob(token, *batch.logprobs[i]))
        elif finished:
            self._advance(st, final=True)

        end = len(st.text)
        if st.stop:
            hit = self._find_stop(st)
            if hit >= 0:
                self._reply(uid, st, hit, FinishReason.STOP, out)
                st.sent = len(st.text)
                return True
            if not finished:
                end -= self._stop_prefix_len(st)
        if finished or st.replies == 0 or len(st.unsent_ids) >= self.interval:
            self._reply(uid, st, end, reason if finished else None, out)
        return False if finished else None

    def _reply(self, uid: int, st: _DecodeState, end: int, reason: str | None, out: ReplyBatch) -> None:
        """Send the text up to `end` and the tokens and log-probs not yet sent (a row of `out`)."""
        i = len(out.uids)
        out.uids.append(uid)
        out.texts.append(st.text[st.sent : end])
        out.token_ids.append(st.unsent_ids)
        st.sent, st.unsent_ids = max(st.sent, end), []
        info: dict[str, Any] = {}
        if st.replies == 0 or reason is not None:
            info.update(prompt_tokens=st.prompt_len, cached_tokens=st.cached_tokens)
        if reason is not None:
            info.update(finished=True, finish_reason=reason, completion_tokens=st.completion_tokens)
        if st.unsent_logprobs:
            info["logprobs"], st.unsent_logprobs = st.unsent_logprobs, []
        if st.extras:
            info["extras"], st.extras = st.extras, {}
        if info:
            out.info[i] = info
        st.replies += 1

    def _advance(self, st: _DecodeState, final: bool) -> None:
        """Move the newly complete characters of the token window into `text`."""
        if st.read_offset >= len(st.ids):
            return
        if st.stream is not None and not final:
            try:
                new = st.stream.step(self.rust, st.ids[-1])
            except Exception:  # noqa: BLE001 - the Rust decoder gave up on this window: decode in Python
                logger.warning("the stream decoder failed; decoding this request's tokens in Python")
                st.stream = None
            else:
                if new is not None:  # it keeps the same window as below: only the offsets follow it
                    st.text += new
                    st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)
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

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

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

    def _text(self, token_id: int) -> str:
        """A token decoded alone, special tokens visible (a logprob must name its token)."""
        text = self.token_text.get(token_id)
        if text is None:
            text = self.token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _logprob(self, token_id: int, logprob: float, top_logprobs: Any) -> TokenLogprob:
        top = [(self._text(t), int(t), float(lp)) for t, lp in (top_logprobs or [])]
        return TokenLogprob(
            self._text(token_id),
            token_id,
            float(logprob),
            top,
            token_bytes=self.token_bytes(token_id),
            top_bytes=[self.token_bytes(t) for _, t, _ in top],
        )
