"""The Responses API for text (POST /v1/responses), as llama-server and vLLM serve it to agent frameworks:
the request is translated into a chat completion (`input` as text or items, `instructions`, function tools,
`text.format`), which runs the chat path (template, reasoning, tool grammar); the output is rendered as
Responses items (reasoning, message, function_call) and, streamed, as its typed events (response.created,
response.output_text.delta, ..., response.completed).

Stateless, as vLLM without a response store: `previous_response_id` is refused (a client sends the whole
conversation in `input`), `store` changes nothing; tools other than functions are refused.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError
from .reasoning import ReasoningText
from .render import ChatOutput, ChatOutputParser, Renderer, call_id
from .routing import ChoiceState, Generation
from .tool_parser import CallArgs, CallEnd, CallStart, Text

# Responses fields with a chat counterpart of the same meaning
_SAME = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "seed", "top_k", "min_p")
_SAME += ("stop", "chat_template_kwargs", "frequency_penalty", "presence_penalty", "repetition_penalty")
_SAME += ("ignore_eos", "logit_bias", "stop_token_ids", "json_schema", "regex", "ebnf", "structural_tag")
_SAME += ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
_INPUT_TEXT = ("input_text", "output_text", "text")  # content part types that carry text


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(message, param, code)


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{where}.content' must be a string or a list of input_text parts", where)
    parts = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") not in _INPUT_TEXT
            or not isinstance(part.get("text"), str)
        ):
            raise _bad(f"'{where}.content' may hold only text parts (input_text, output_text)", where)
        parts.append(part["text"])
    return "".join(parts)


def _messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages: a function_call item becomes an assistant's tool call
    (consecutive calls: one assistant turn), a function_call_output a `tool` message; reasoning items are
    dropped (the templates drop past reasoning too)."""
    out: list[dict[str, Any]] = []
    if isinstance(data.get("instructions"), str) and data["instructions"]:
        out.append({"role": "system", "content": data["instructions"]})
    items = data.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str):
            out.append({"role": item["role"], "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
            if (
                out
                and out[-1]["role"] == "assistant"
                and out[-1].get("tool_calls")
                and not out[-1]["content"]
            ):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind != "reasoning":
            raise _bad(
                f"'{where}' must be a message, function_call, function_call_output or reasoning item",
                where,
            )
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools ({type, name, description, parameters}) as chat tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise _bad(f"'tools[{i}]' is a {kind!r} tool; only function tools are supported", f"tools[{i}]")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` ({type: text | json_object | json_schema, name, schema, strict}) as chat's
    response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("'text.format' must be an object {type: text | json_object | json_schema, ...}", "text")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def chat_body(data: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as the body of the chat completion that answers it (HTTP 400 naming the
    Responses field that cannot be translated)."""
    if data.get("previous_response_id") is not None:
        raise _bad(
            "'previous_response_id' is not supported: this server keeps no responses (send the whole "
            "conversation in 'input')",
            "previous_response_id",
            "unsupported_parameter",
        )
    body: dict[str, Any] = {k: data[k] for k in _SAME if k in data}
    body["messages"] = _messages(data)
    if data.get("max_output_tokens") is not None:
        body["max_completion_tokens"] = data["max_output_tokens"]
    if (tools := _tools(data.get("tools"))) is not None:
        body["tools"] = tools
    if data.get("tool_choice") is not None:
        body["tool_choice"] = _tool_choice(data["tool_choice"])
    if (rf := _response_format(data.get("text"))) is not None:
        body["response_format"] = rf
    return body


def _usage(c: ChoiceState, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": c.prompt_tokens,
        "input_tokens_details": {"cached_tokens": c.cached_tokens},
        "output_tokens": c.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": content, "status": status}


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": _item_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def _call_item(name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id(),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass
class ResponsesRenderer(Renderer):
    """/v1/responses: one `response` object, or its events while streaming (one choice)."""

    request: dict[str, Any] = field(default_factory=dict)  # the Responses body, echoed in the response
    output: ChatOutput = field(default_factory=ChatOutput)
    parser: ChatOutputParser | None = None
    items: list[dict[str, Any]] = field(default_factory=list)  # the output items, as streamed so far
    open_item: dict[str, Any] | None = None
    seq: int = 0

    def _response(self, status: str, output: list[dict[str, Any]], c: ChoiceState | None) -> dict[str, Any]:
        r = self.request
        text = r.get("text") if isinstance(r.get("text"), dict) else None
        incomplete = c is not None and c.finish_reason == "length"
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.get("instructions"),
            "max_output_tokens": r.get("max_output_tokens"),
            "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "temperature": r.get("temperature"),
            "top_p": r.get("top_p"),
            "tool_choice": r.get("tool_choice", "auto"),
            "tools": r.get("tools") or [],
            "text": text or {"format": {"type": "text"}},
            "reasoning": r.get("reasoning"),
            "store": False,
            "metadata": r.get("metadata") or {},
            "truncation": "disabled",
            "usage": _usage(c) if c is not None else None,
        }

    def full(self, gen: Generation) -> Any:
        c = gen.choices[0]
        reasoning, content, calls = self.output.parse(c.text)
        items = [_reasoning_item(reasoning)] if reasoning else []
        if content or not calls:
            items.append(_message_item(content or ""))
        items += [_call_item(t.name, t.arguments) for t in calls]
        return self._response("completed", items, c)

    # ---- streaming: each event of the Responses API --------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def stream_start(self, gen: Generation) -> list[bytes]:
        started = self._response("in_progress", [], None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        """Close the open item and start `item`."""
        out = self._close()
        self.open_item = item
        self.items.append(item)
        index = len(self.items) - 1
        out.append(
            self._event(
                "response.output_item.added", output_index=index, item=dict(item, status="in_progress")
            )
        )
        if item["type"] in ("message", "reasoning"):
            part = dict(item["content"][0], text="")
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        return out

    def _close(self) -> list[bytes]:
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        index = self.items.index(item)
        where = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]
                )
            )
            out.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(
                self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            )
            out.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        else:
            out.append(
                self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])
            )
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _events(self, events: list[Any]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            item = self.open_item
            if isinstance(e, Text) and not e.text.strip() and (item is None or item["type"] != "message"):
                continue  # the space between two calls opens no message
            if isinstance(e, (ReasoningText, Text)):
                kind = "reasoning" if isinstance(e, ReasoningText) else "message"
                if item is None or item["type"] != kind:
                    out += self._open(
                        _reasoning_item("", "completed") if kind == "reasoning" else _message_item("")
                    )
                    item = self.open_item
                assert item is not None
                item["content"][0]["text"] += e.text
                delta = (
                    "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                )
                extra = {} if kind == "reasoning" else {"logprobs": []}
                where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
                out.append(self._event(delta, **where, delta=e.text, **extra))
            elif isinstance(e, CallStart):
                out += self._open(_call_item(e.name, ""))
            elif isinstance(e, CallArgs) and item is not None and item["type"] == "function_call":
                item["arguments"] += e.text
                where = {"item_id": item["id"], "output_index": len(self.items) - 1}
                out.append(self._event("response.function_call_arguments.delta", **where, delta=e.text))
            elif isinstance(e, CallEnd):
                out += self._close()
        return out

    def stream_delta(self, c: ChoiceState, reply: Any, offset: int) -> bytes | None:
        if self.parser is None:
            self.parser = self.output.parser()
        return b"".join(self._events(self.parser.feed(reply.text))) or None

    def stream_finish(self, c: ChoiceState) -> bytes | None:
        if self.parser is None:
            self.parser = self.output.parser()
        out = self._events(self.parser.finish()) + self._close()
        done = self._response("completed", self.items, c)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        out.append(self._event(kind, response=done))
        return b"".join(out)
