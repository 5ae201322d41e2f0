"""Tokenization of incoming requests: chat template for conversations, plain encoding for text."""

from __future__ import annotations

from typing import Any

from minisgl.message import TokenizeMsg


class TokenizeManager:
    """Turns a TokenizeMsg into prompt token ids with the model's own (Hugging Face) tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def tokenize(self, msg: TokenizeMsg) -> list[int]:
        """Raise ValueError naming the problem when the prompt cannot be tokenized."""
        if msg.input_ids is not None:
            return [int(t) for t in msg.input_ids]
        if msg.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(
                    "this model's tokenizer has no chat template: use /v1/completions with a prompt"
                )
            # `tools` only when the request has them: a template that reads it then renders them
            extra = {"tools": msg.tools} if msg.tools else {}
            text = self.tokenizer.apply_chat_template(
                msg.messages, tokenize=False, add_generation_prompt=True, **extra
            )
            return list(self.tokenizer.encode(text, add_special_tokens=False))  # the template has BOS if any
        assert msg.text is not None, "a TokenizeMsg carries text, messages or input_ids"
        return list(self.tokenizer.encode(msg.text))  # as LLM.generate does for a string prompt
