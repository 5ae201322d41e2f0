"""The tokenizer endpoints, shaped as vLLM's: POST /tokenize (a prompt, or chat messages through the chat
template), POST /detokenize and GET /tokenizer_info (lm-evaluation-harness's remote tokenizer reads them).

The API server loads its own copy of the model's (fast) tokenizer for them on the first call: a round trip
through the tokenizer worker would queue behind the prompts it tokenizes for generation. Encoding and
decoding run in a thread (`asyncio.to_thread`), so a large input never holds up the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from minisgl.tokenizer import TokenizeManager, chat_text
from minisgl.utils.hf import load_tokenizer

from .errors import APIError
from .params import Limits, chat_messages, template_kwargs
from .protocol import ChatMessage, Int64, _Body

# what /tokenizer_info reports (vLLM reports the tokenizer's init kwargs): its special tokens, and settings
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
_SETTINGS = ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces")


class TokenizeBody(_Body):
    """POST /tokenize: `prompt` (plain text) or `messages` (a chat, rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for a chat (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeBody(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[Int64]


class ServerTokenizer:
    """The API server's own tokenizer, loaded on first use (thread-safe)."""

    def __init__(self, model_path: str, limits: Limits, allow_special_in_content: bool = False) -> None:
        self.model_path, self.limits = model_path, limits
        self.allow_special_in_content = allow_special_in_content
        self._tokenizer: Any = None
        self._chat: TokenizeManager | None = None  # encodes a chat as the tokenizer worker does
        self._lock = threading.Lock()
        self._pieces: dict[int, str] = {}  # token id -> its text decoded alone (bounded by the vocabulary)

    def get(self) -> Any:
        """The Hugging Face tokenizer (loads it on the first call; blocking: call it in a thread)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.model_path)
                self._chat = TokenizeManager(self._tokenizer, self.allow_special_in_content)
            return self._tokenizer

    def piece(self, token: int) -> str:
        """A token's text decoded alone, as the detokenizer shows a generated token's (cached)."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.get().decode([token])
        return text

    async def warm(self, ids: list[int]) -> None:
        """Decode these tokens' texts in a thread, so that rendering them later does not hold the event
        loop (a long prompt's log-probabilities name thousands of tokens)."""
        new = list({t for t in ids if t not in self._pieces})
        if new:
            await asyncio.to_thread(lambda: [self.piece(t) for t in new])

    async def encode(self, text: str) -> list[int]:
        """A prompt's ids, as the tokenizer worker encodes a text prompt (in a thread)."""
        return await asyncio.to_thread(lambda: list(self.get().encode(text)))

    async def decode(self, ids: list[int]) -> str:
        return await asyncio.to_thread(lambda: self.get().decode(ids))

    async def tokenize(self, body: TokenizeBody, max_model_len: int) -> dict[str, Any]:
        """vLLM's TokenizeResponse: `count`, `max_model_len`, `tokens` (and `token_strs` when asked)."""
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", "prompt", "invalid_value")
        if body.prompt is not None:
            self.limits.check_text(body.prompt, "prompt")
        ids, strs = await asyncio.to_thread(self._tokenize, body)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        out["token_strs"] = strs if body.return_token_strs else None
        return out

    def _tokenize(self, body: TokenizeBody) -> tuple[list[int], list[str]]:
        tok = self.get()
        if body.prompt is not None:
            special = body.add_special_tokens is not False
            ids = list(tok.encode(body.prompt, add_special_tokens=special))
        else:
            messages = chat_messages(body.messages or [], self.limits)
            kwargs = template_kwargs(body.chat_template_kwargs)
            try:
                text = chat_text(tok, messages, body.tools, kwargs, body.add_generation_prompt)
            except ValueError as e:
                raise APIError(str(e), "messages", "invalid_value") from None
            if body.add_special_tokens:
                ids = list(tok.encode(text, add_special_tokens=True))
            else:  # as the worker encodes the prompt: special strings typed in content stay text
                assert self._chat is not None
                ids = self._chat.encode_chat(text, messages)
        return ids, tok.convert_ids_to_tokens(ids)

    async def detokenize(self, body: DetokenizeBody) -> dict[str, Any]:
        """vLLM's DetokenizeResponse: `prompt`, the text of the tokens."""
        vocab = len(await asyncio.to_thread(self.get))
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"'tokens' holds {bad}, not a token id in [0, {vocab})", "tokens", "invalid_value")
        return {"prompt": await asyncio.to_thread(lambda: self.get().decode(body.tokens))}

    async def info(self, max_model_len: int) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's class, its special tokens and settings, the chat
        template; `model_max_length` is the served context (a tokenizer's own is often a 1e30 sentinel)."""
        tok = await asyncio.to_thread(self.get)
        out: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
        for name in _SPECIAL_TOKENS:
            if (value := getattr(tok, name, None)) is not None:
                out[name] = str(value)
        config = getattr(tok, "init_kwargs", None) or {}
        out.update({name: config[name] for name in _SETTINGS if isinstance(config.get(name), bool)})
        out["model_max_length"] = max_model_len
        out["vocab_size"] = len(tok)
        out["chat_template"] = getattr(tok, "chat_template", None)
        return out
