"""Tokenization of incoming requests: chat template for conversations, plain encoding for text.

The chat template's own markers (`<|im_start|>`, ...) are control tokens; the same strings typed in a
user's or a tool's content are text (unless the service allows them: `--allow-special-tokens-in-content`),
or anyone could close their turn and open a system one. The common case, content that holds none of
them, is encoded in one piece as before."""

from __future__ import annotations

import re
from typing import Any

from minisgl.core import InvalidRequest
from minisgl.message import TokenizeMsg

UNTRUSTED_ROLES = ("user", "tool")  # content that comes from outside the application


def chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The conversation rendered by the model's chat template (ValueError when it has none). `tools` only
    when given (a template that reads it then renders them); `template_kwargs`: its other variables."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: use /v1/completions with a prompt")
    extra = dict(template_kwargs or {}, **({"tools": tools} if tools else {}))
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


class TokenizeManager:
    """Turns a TokenizeMsg into prompt token ids with the model's own (Hugging Face) tokenizer."""

    def __init__(self, tokenizer: Any, allow_special_in_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.allow_special_in_content = allow_special_in_content
        special = sorted(
            (t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special),
            key=len,
            reverse=True,
        )
        self._special = re.compile("|".join(map(re.escape, special))) if special else None

    def tokenize(self, msg: TokenizeMsg) -> list[int]:
        """Raise ValueError naming the problem when the prompt cannot be tokenized."""
        if msg.input_ids is not None:
            return [int(t) for t in msg.input_ids]
        if msg.messages is not None:
            text = chat_text(self.tokenizer, msg.messages, msg.tools, msg.chat_template_kwargs)
            return self.encode_chat(text, msg.messages)
        assert msg.text is not None, "a TokenizeMsg carries text, messages or input_ids"
        return list(self.tokenizer.encode(msg.text))  # as LLM.generate does for a string prompt

    def encode_chat(self, text: str, messages: list[dict[str, Any]]) -> list[int]:
        """The templated chat's ids (the template has BOS if any), with the special strings inside
        untrusted content encoded as text."""
        spans = [] if self.allow_special_in_content else self._untrusted_spans(text, messages)
        if not spans:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        ids: list[int] = []
        at = 0
        for start, end in spans:
            ids += self.tokenizer.encode(text[at:start], add_special_tokens=False)
            ids += self.tokenizer.encode(text[start:end], add_special_tokens=False, split_special_tokens=True)
            at = end
        return ids + self.tokenizer.encode(text[at:], add_special_tokens=False)

    def _untrusted_spans(self, text: str, messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
        """Where the templated text holds the content of each user or tool message with a special string
        in it, in order."""
        if self._special is None:
            return []
        spans, at = [], 0
        for i, m in enumerate(messages):
            content = m.get("content")
            if not isinstance(content, str) or not content:
                continue
            start = text.find(content, at)
            if start >= 0:
                at = start + len(content)
            if m.get("role") not in UNTRUSTED_ROLES or not self._special.search(content):
                continue
            if start < 0:  # the template changed the content: its special strings cannot be told apart
                raise InvalidRequest(
                    f"'messages[{i}].content' holds the model's control token "
                    f"{self._special.search(content).group()!r}, which content may not use",  # type: ignore[union-attr]
                    "prompt",
                )
            spans.append((start, at))
        return spans
