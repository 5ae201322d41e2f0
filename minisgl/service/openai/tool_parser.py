"""Tool calls in a model's output: the formats of the families served (Hermes-style `<tool_call>` JSON of
Qwen2.5 / Qwen3, Llama 3's bare JSON) and one incremental parser for both, fed the text as it streams.

The parser splits the text into events: plain text (the message's `content`), the start of a call (its
function name), pieces of its `arguments` (the model's own JSON text, whitespace around it dropped) and
the end of a call (whether the whole call object parsed). Streaming sends the events as they come; the
non-streamed reply (`parse_tool_calls`) keeps only the calls that parsed and gives the others back to the
content as the model wrote them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes a tool call: `start` + a JSON object {"name", `args_key`} + `end`,
    calls separated by `separator` (what the enforcing grammar puts between two calls)."""

    name: str
    start: str  # before each call object ("" : the call is bare JSON at the start of the output)
    end: str  # after it
    args_key: str  # "arguments" (Hermes) or "parameters" (Llama 3)
    separator: str

    def call_prefix(self, function: str) -> str:
        """The text of a call up to its arguments (the enforcing grammar's tag begins with it)."""
        opening = f"{self.start}\n" if self.start else ""
        return opening + '{"name": ' + json.dumps(function, ensure_ascii=False) + f', "{self.args_key}": '

    def call_suffix(self) -> str:
        """The text of a call after its arguments."""
        return "}" + (f"\n{self.end}" if self.end else "")

    def call_text(self, function: str, arguments: str) -> str:
        """A whole call as the model writes it (for an assistant turn rendered without template support)."""
        return self.call_prefix(function) + arguments + self.call_suffix()


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", "\n")
LLAMA3 = ToolFormat("llama3", "", "", "parameters", ";")
# --tool-call-parser values (SGLang's and vLLM's names) -> format
TOOL_FORMATS = {"hermes": HERMES, "qwen25": HERMES, "qwen3": HERMES, "llama3": LLAMA3, "llama3_json": LLAMA3}
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open a call with it

# the call object up to its arguments' value: {"name": "...", "arguments":
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_HEADER_MAX = 512  # characters of a call object within which its header must have appeared


@dataclass
class Text:
    """Plain text of the message."""

    text: str


@dataclass
class CallStart:
    """Call `index` begins; its function's name."""

    index: int
    name: str


@dataclass
class CallArgs:
    """The next piece of call `index`'s arguments (JSON text)."""

    index: int
    text: str


@dataclass
class CallEnd:
    """Call `index` is complete; `ok` when its object parsed as {"name", "arguments": {...}}, else `raw`
    is the call as written (markers included)."""

    index: int
    ok: bool
    raw: str


Event = Text | CallStart | CallArgs | CallEnd


def _longest_prefix_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a beginning of `marker` (held back: it may be a
    marker cut between two tokens)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call_of(obj: str) -> tuple[str, Any] | None:
    """(name, arguments) of a call object's text, or None when it is not one."""
    try:
        value = json.loads(obj)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters"))
    return (value["name"], args) if isinstance(args, dict) else None


@dataclass
class ToolCallParser:
    """Incremental: `feed` each new piece of text, `finish` at the end; both return the events found."""

    fmt: ToolFormat
    forced: bool = False  # tool_choice forced a call: the output is calls only, and a cut marker is markup
    buf: str = ""  # received, not yet decided
    mode: str = ""  # text | lead | plain | open | obj | close | after
    raw: str = ""  # the current call as written so far
    obj: str = ""  # the current call's JSON object so far
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    args_from: int | None = None  # where the arguments begin in `obj` (once the header is read)
    args_sent: int = 0
    count: int = 0  # calls started
    pending: CallEnd | None = None  # a complete object waiting for its end marker
    out: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Llama 3's calls are bare JSON: only the start of the output can open one
        self.mode = "text" if self.fmt.start else "lead"

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        while self.buf and self._step():
            pass
        events, self.out = self.out, []
        return events

    def finish(self) -> list[Event]:
        """Flush what was held back: an unfinished marker or call is text (or a call that did not parse)."""
        if self.mode == "obj":
            if self.args_from is not None:
                self.out.append(CallEnd(self.count - 1, False, self.raw + self.buf))
            elif not self.forced:  # forced: a call cut before its name, markup
                self._text(self.raw + self.buf)
        elif self.mode in ("lead", "open"):
            if not self.forced:  # forced: a call cut (max_tokens) before its object, markup
                self._text(self.raw + self.buf)
        elif self.mode == "close":
            self._end_call()
            rest = self.buf.strip()
            if not self.fmt.end.startswith(rest):  # the call's own end marker, cut (max_tokens): not text
                self._text(rest)
        elif (
            self.mode == "text"
            and (self.count or self.forced)
            and self.buf.strip()
            and self.fmt.start.startswith(self.buf.strip())
        ):
            pass  # a call's start marker, cut (max_tokens): markup, not text
        elif self.mode != "after":
            self._text(self.buf)
        self.buf, self.raw = "", ""
        events, self.out = self.out, []
        return events

    def _text(self, text: str) -> None:
        if text:
            self.out.append(Text(text))

    def _step(self) -> bool:
        """Handle what `buf` holds in the current mode; False when it must wait for more text."""
        return getattr(self, f"_mode_{self.mode}")()

    def _mode_plain(self) -> bool:
        self._text(self.buf)
        self.buf = ""
        return False

    def _mode_text(self) -> bool:
        i = self.buf.find(self.fmt.start)
        if i < 0:
            keep = _longest_prefix_suffix(self.buf, self.fmt.start)
            self._text(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        self._text(self.buf[:i])
        self.raw, self.buf, self.mode = self.fmt.start, self.buf[i + len(self.fmt.start) :], "open"
        return True

    def _mode_lead(self) -> bool:
        s = self.buf.lstrip()
        if not s or (PYTHON_TAG.startswith(s) and s != PYTHON_TAG):
            return False  # only whitespace, or maybe the tag: wait
        if s.startswith(PYTHON_TAG):
            self.raw += self.buf[: len(self.buf) - len(s) + len(PYTHON_TAG)]
            self.buf = s[len(PYTHON_TAG) :]
            return True
        self.mode = "open" if s[0] == "{" else "plain"
        if self.mode == "plain":
            self.buf, self.raw = self.raw + self.buf, ""
        return True

    def _mode_open(self) -> bool:
        s = self.buf.lstrip()
        if not s:
            return False
        self.raw += self.buf[: len(self.buf) - len(s)]
        self.buf = s
        if s[0] != "{":  # a marker not followed by an object: it was text
            self._text(self.raw)
            self.raw, self.mode = "", "text" if self.fmt.start else "plain"
            return True
        self.obj, self.depth, self.in_string, self.escaped = "", 0, False, False
        self.args_from, self.args_sent, self.mode = None, 0, "obj"
        return True

    def _mode_obj(self) -> bool:
        for i, ch in enumerate(self.buf):
            self.obj += ch
            self._scan(ch)
            if self.args_from is None and len(self.obj) <= _HEADER_MAX:
                m = _HEADER.match(self.obj)
                if m:
                    self.out.append(CallStart(self.count, json.loads(f'"{m.group(1)}"')))
                    self.count += 1
                    self.args_from = m.end()
            if self.depth == 0:  # the call object is closed
                self.raw += self.buf[: i + 1]
                self.buf = self.buf[i + 1 :]
                self._close_object()
                return True
        self.raw += self.buf
        self.buf = ""
        self._send_args(self.obj[self.args_from :] if self.args_from is not None else "")
        return False

    def _scan(self, ch: str) -> None:
        """Track strings and braces, so that braces inside strings do not count."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _send_args(self, args: str) -> None:
        # whitespace before and after the arguments' value is not theirs: leading dropped, trailing held
        text = args.strip()
        if self.args_from is not None and len(text) > self.args_sent:
            self.out.append(CallArgs(self.count - 1, text[self.args_sent :]))
            self.args_sent = len(text)

    def _close_object(self) -> None:
        call = _call_of(self.obj)
        if self.args_from is not None:
            self._send_args(self.obj[self.args_from : -1])
        elif call is not None:  # a call whose header was not at its start (keys in another order)
            self.out.append(CallStart(self.count, call[0]))
            self.out.append(CallArgs(self.count, json.dumps(call[1], ensure_ascii=False)))
            self.count += 1
            self.args_from = len(self.obj)
        else:  # braces that are not a call: text
            self._text(self.raw)
            self.raw, self.mode = "", "text" if self.fmt.start else "plain"
            return
        self.pending = CallEnd(self.count - 1, call is not None, "")
        self.mode = "close" if self.fmt.end else "after"
        if self.mode == "after":
            self._end_call()

    def _end_call(self) -> None:
        if self.pending is not None:
            self.pending.raw = self.raw
            self.out.append(self.pending)
        self.pending, self.raw = None, ""

    def _mode_close(self) -> bool:
        s = self.buf.lstrip()
        if not s:
            return False
        if s.startswith(self.fmt.end):
            self.raw += self.buf[: len(self.buf) - len(s) + len(self.fmt.end)]
            self.buf = s[len(self.fmt.end) :]
        elif self.fmt.end.startswith(s):
            return False  # maybe the end marker, cut between tokens
        self._end_call()  # (an end marker that is missing does not undo the call)
        self.mode = "text"
        return True

    def _mode_after(self) -> bool:
        s = self.buf.lstrip()
        if not s:
            return False
        if s[0] == ";":  # Llama 3 separates calls with ";"
            self.buf, self.raw, self.mode = s[1:], ";", "open"
        else:
            self.mode = "plain"
        return True


@dataclass
class ParsedCall:
    """One tool call of a finished output."""

    name: str
    arguments: str  # JSON text


def parse_tool_calls(text: str, fmt: ToolFormat, forced: bool = False) -> tuple[str | None, list[ParsedCall]]:
    """The content outside the calls (None when there is none beside them) and the calls that parsed; a
    call that did not parse stays in the content as written."""
    parser = ToolCallParser(fmt, forced)
    parts: list[str] = []
    calls: dict[int, ParsedCall] = {}
    for e in parser.feed(text) + parser.finish():
        if isinstance(e, Text):
            parts.append(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = ParsedCall(e.name, "")
        elif isinstance(e, CallArgs):
            calls[e.index].arguments += e.text
        elif not e.ok:
            parts.append("" if forced else e.raw)  # forced: the output is calls only; this one was cut
            del calls[e.index]
    if not calls and not forced:
        return text, []
    content = "".join(parts).strip()
    return content or None, list(calls.values())
