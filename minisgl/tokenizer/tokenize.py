"""Tokenization of incoming requests: chat template for conversations, plain encoding for text."""

from __future__ import annotations

from typing import Any

from minisgl.message import TokenizeMsg


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

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def tokenize(self, msg: TokenizeMsg) -> list[int]:
        """Raise ValueError naming the problem when the prompt cannot be tokenized."""
        if msg.input_ids is not None:
            return [int(t) for t in msg.input_ids]
        if msg.messages is not None:
            text = chat_text(self.tokenizer, msg.messages, msg.tools, msg.chat_template_kwargs)
            return list(self.tokenizer.encode(text, add_special_tokens=False))  # the template has BOS if any
        assert msg.text is not None, "a TokenizeMsg carries text, messages or input_ids"
        return list(self.tokenizer.encode(msg.text))  # as LLM.generate does for a string prompt
