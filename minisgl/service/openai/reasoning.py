"""Reasoning models: the text between the think markers is `reasoning_content` (and `reasoning`), the rest
is the answer (`content`, where tool calls are parsed).

The format comes from --reasoning-parser (qwen3, deepseek-r1) or from the chat template (one that writes
`<think>` gets qwen3's). Where a reply starts is read from the template's generation prompt, rendered for a
one-message chat with the request's `chat_template_kwargs`: a prompt that ends inside an open block (e.g.
Qwen3-Thinking's, DeepSeek-R1's) starts the output in the reasoning; one that holds a closed block (Qwen3
with `enable_thinking: false`) has none; otherwise the model may open one itself. deepseek-r1's output
starts in the reasoning whatever the prompt (its models often leave the opening marker out).

Structured output and forced tool calls apply to the answer: the request's constraint becomes an xgrammar
structural tag that lets the reasoning come first (`after_reasoning`), unless the client's own grammar
already writes the end marker (it then describes the whole output).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .constraints import Constraint
from .tool_parser import _longest_prefix_suffix

# where the reasoning stands when the output starts
OPEN = "open"  # the prompt opened the block: the output starts inside it
CLOSED = "closed"  # the prompt holds a closed (empty) block: thinking is off, no reasoning
MAY_OPEN = "may_open"  # the model may open a block at the start of its output


@dataclass
class ReasoningText:
    """A piece of the reasoning (an event beside tool_parser's Text and calls)."""

    text: str


@dataclass(frozen=True)
class ReasoningFormat:
    """A family's think markers; `always_open`: its output starts in the reasoning whatever the prompt."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_open: bool = False


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek-r1": ReasoningFormat("deepseek-r1", always_open=True),
}


def detect(template: str, parser: str = "auto") -> ReasoningFormat | None:
    """The format --reasoning-parser names (`none`: no parsing), or on `auto` qwen3's where the chat
    template writes a think block."""
    if parser == "none":
        return None
    if parser != "auto":
        return REASONING_FORMATS[parser]
    qwen3 = REASONING_FORMATS["qwen3"]
    return qwen3 if qwen3.start in template and qwen3.end in template else None


def prompt_state(prompt: str, fmt: ReasoningFormat) -> str:
    """Where the output of a prompt that ends with this text starts: OPEN, CLOSED or MAY_OPEN."""
    if fmt.always_open:
        return OPEN
    start, end = prompt.rfind(fmt.start), prompt.rfind(fmt.end)
    if start < 0 and end < 0:
        return MAY_OPEN
    return OPEN if start > end else CLOSED


class ReasoningSplitter:
    """Splits one choice's text, as it arrives, into (reasoning, content): markers are held back while
    incomplete, never shown. The reasoning and the content after the block start at their first non-space
    character."""

    def __init__(self, fmt: ReasoningFormat, state: str) -> None:
        assert state in (OPEN, MAY_OPEN), state
        self.fmt = fmt
        self.state = "start"  # -> "inside" -> "after"
        self.unopened = "inside" if state == OPEN else "after"  # a first text without the start marker
        self.held = ""
        self.entered = False  # a block was opened (by the prompt or the output)
        self.reasoned = False  # some reasoning text came

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        buf, self.held = self.held + text, ""
        if self.state == "start":
            lead = buf.lstrip()
            if lead.startswith(self.fmt.start):
                buf, self.state = lead[len(self.fmt.start) :], "inside"
            elif self.fmt.start.startswith(lead):  # nothing yet, or part of the marker: wait
                self.held = buf
                return "", ""
            else:
                self.state = self.unopened
            self.entered = self.state == "inside"
        if self.state == "inside" and not self.reasoned:  # the reasoning starts at its first non-space
            buf = buf.lstrip()
            self.reasoned = bool(buf)
        if self.state == "inside":
            i = buf.find(self.fmt.end)
            if i < 0:
                keep = _longest_prefix_suffix(buf, self.fmt.end)
                self.held = buf[len(buf) - keep :]
                return buf[: len(buf) - keep], ""
            reasoning, buf, self.state = buf[:i], buf[i + len(self.fmt.end) :], "after_marker"
        if self.state == "after_marker":
            buf = buf.lstrip()
            if buf:
                self.state = "after"
        if self.state == "after":
            content = buf
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held at the end: an unclosed block's tail is reasoning, anything else content."""
        held, self.held = self.held, ""
        if self.state == "start":
            self.state = self.unopened
            self.entered = self.state == "inside"
        return (held, "") if self.state == "inside" else ("", held)


def split(text: str, fmt: ReasoningFormat, state: str) -> tuple[str | None, str]:
    """A whole output as (reasoning, content); reasoning is None when the output has none."""
    if state == CLOSED:
        return None, text
    s = ReasoningSplitter(fmt, state)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.entered else None), c1 + c2


def _inner_format(c: Constraint) -> dict[str, Any]:
    """The constraint as a format of an xgrammar structural tag."""
    if c.kind == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(c.value)}
    if c.kind == "regex":
        return {"type": "regex", "pattern": c.value}
    if c.kind == "ebnf":
        return {"type": "grammar", "grammar": c.value}
    return json.loads(c.value)["format"]


def after_reasoning(c: Constraint | None, fmt: ReasoningFormat | None, state: str) -> Constraint | None:
    """The constraint that lets the reasoning come first (any text up to the end marker, then up to four
    spaces or newlines), then holds the answer to `c`."""
    if c is None or fmt is None or state == CLOSED or fmt.end in c.value:
        return c
    block: dict[str, Any] = {"type": "tag", "content": {"type": "any_text"}, "end": fmt.end}
    if state == OPEN:
        think = dict(block, begin="")
    else:
        think = {"type": "optional", "content": dict(block, begin=fmt.start)}
    spaces = {"type": "regex", "pattern": "[ \\n]{0,4}"}
    tag = {
        "type": "structural_tag",
        "format": {"type": "sequence", "elements": [think, spaces, _inner_format(c)]},
    }
    return Constraint("structural_tag", json.dumps(tag, ensure_ascii=False), c.param)
