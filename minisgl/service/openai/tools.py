"""Tool calling on the request side: the served model's tool-call format (--tool-call-parser, or found from
its chat template), `tools` / `tool_choice` checked, the tools rendered for a chat template that has no
tool support (Hermes-style in the system message, as Qwen2.5's template writes them), and the structural
tag that enforces `required` or a named function.

A template that reads `tools` renders them itself (the tokenizer worker passes `tools=` to
apply_chat_template, and the messages keep their `tool_calls` and `tool` roles). A template without tool
support gets plain messages instead: the tool definitions appended to the system message, an assistant's
calls written as the model writes them, `tool` results as a user turn of `<tool_response>` blocks.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from minisgl.utils import init_logger

from .constraints import Constraint, check
from .errors import APIError
from .tool_parser import HERMES, LLAMA3, TOOL_FORMATS, ToolFormat

logger = init_logger(__name__, "api")

_NAME = re.compile(r"[a-zA-Z0-9_.-]{1,64}")  # OpenAI's rule for a function name (plus ".")
_READS_TOOLS = re.compile(r"\btools\b")  # a template that reads the `tools` variable renders them
MAX_TOOLS = 128

HERMES_TOOLS_PROMPT = (  # Qwen2.5's words
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolSupport:
    """What the served model can do with tools: its call format (None: no tools) and whether its chat
    template renders `tools` itself."""

    fmt: ToolFormat | None
    native: bool


def chat_template_text(model_path: str) -> str:
    """The model's chat template as text (every named template of a tokenizer that has several)."""
    if not model_path:
        return ""
    try:
        with open(os.path.join(model_path, "chat_template.jinja")) as f:
            return f.read()
    except OSError:
        pass
    try:
        with open(os.path.join(model_path, "tokenizer_config.json")) as f:
            template = json.load(f).get("chat_template") or ""
    except (OSError, ValueError):
        return ""
    if isinstance(template, list):  # [{name, template}, ...]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return str(template)


def detect(template: str, parser: str = "auto") -> ToolSupport:
    """The format from --tool-call-parser, or from the template: `<tool_call>` (Qwen2.5 / Qwen3, Hermes)
    or Llama 3's header tokens; a ChatML template without tool support gets the Hermes format, rendered
    here."""
    native = bool(_READS_TOOLS.search(template))
    if parser != "auto":
        fmt: ToolFormat | None = TOOL_FORMATS[parser]
    elif "<tool_call>" in template:
        fmt = HERMES
    elif native and ("<|python_tag|>" in template or "<|start_header_id|>" in template):
        fmt = LLAMA3
    elif "<|im_start|>" in template:
        fmt = HERMES
    else:
        fmt = None
    if fmt is not None and not native and fmt is not HERMES:
        fmt = None  # only the Hermes form can be rendered without the template's help
    return ToolSupport(fmt, native)


@dataclass
class ToolRequest:
    """A request's tools, checked: the OpenAI tool objects, the choice ("auto", "none", "required",
    "forced") and, when forced, the function's name."""

    tools: list[dict[str, Any]]
    choice: str
    forced: str | None = None
    parallel: bool = True
    schemas: dict[str, Any] = field(default_factory=dict)  # function name -> parameters schema

    @property
    def parses(self) -> bool:
        """Whether tool calls are read out of the output ("none": the text is the answer)."""
        return self.choice != "none"


def preload() -> None:
    """Import what checking tools and forcing a call need (xgrammar's structural tags take ~1 s): at start,
    not on the event loop when the first such request arrives, which stalled every stream meanwhile. One
    that is not installed is not an error here: a request that needs it gets the clear one."""
    for module in ("jsonschema", "xgrammar.structural_tag"):
        try:
            importlib.import_module(module)
        except ImportError:
            pass


def _bad(message: str, param: str) -> APIError:
    return APIError(message, param, "invalid_value")


def _check_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 naming `param` when `schema` is not a valid JSON Schema (against the meta-schema of the draft
    it names, 2020-12 by default, as OpenAI checks a function's parameters). The body's depth bound makes
    the validator's recursion safe."""
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        at = f" at '{where}'" if where else ""
        raise _bad(f"'{param}' is not a valid JSON Schema{at}: {e.message[:300]}", param) from None


def _check_tool(i: int, tool: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, normalized tool) of tools[i]; the parameters must be an object schema xgrammar reads."""
    where = f"tools[{i}]"
    if tool.get("type", "function") != "function":
        raise _bad(f"'{where}.type' must be 'function', got {tool.get('type')!r}", f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"'{where}.function' must be an object {{name, description, parameters}}", where)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(
            f"'{where}.function.name' must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
            f"{where}.function.name",
        )
    if not isinstance(fn.get("description", ""), str):
        raise _bad(f"'{where}.function.description' must be a string", f"{where}.function.description")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise _bad(
            f'\'{where}.function.parameters\' must be a JSON Schema of an object ({{"type": "object", ...}})',
            f"{where}.function.parameters",
        )
    check(Constraint("json_schema", json.dumps(params), f"{where}.function.parameters"))  # its bounds
    _check_schema(params, f"{where}.function.parameters")
    return name, {"type": "function", "function": dict(fn, parameters=params)}


def _choice(tool_choice: Any, names: set[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("auto", "none", "required"):
        if tool_choice == "required" and not names:
            raise _bad("'tool_choice' is 'required' but no 'tools' are given", "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise _bad(
            'tool_choice\' must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    name = fn.get("name")
    if name not in names:
        known = ", ".join(sorted(names)) or "none"
        raise _bad(
            f"'tool_choice' names the function {name!r}, which 'tools' does not define ({known})",
            "tool_choice",
        )
    return "forced", name


def tool_request(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None, support: ToolSupport
) -> ToolRequest | None:
    """The request's tools checked (HTTP 400 naming the bad part), or None when it has none."""
    tools = tools or []
    if not tools and tool_choice in (None, "none", "auto"):
        return None
    if len(tools) > MAX_TOOLS:
        raise _bad(f"'tools' may hold at most {MAX_TOOLS} functions", "tools")
    schemas: dict[str, Any] = {}
    normalized = []
    for i, tool in enumerate(tools):
        name, norm = _check_tool(i, tool)
        if name in schemas:
            raise _bad(f"'tools' defines the function {name!r} twice", f"tools[{i}].function.name")
        schemas[name] = norm["function"]["parameters"]
        normalized.append(norm)
    choice, forced = _choice(tool_choice, set(schemas))
    if support.fmt is None:
        raise APIError(
            "this model's chat template has no tool support and no known tool-call format: start the "
            "server with --tool-call-parser (hermes, llama3) or send no 'tools'",
            "tools",
            "unsupported_parameter",
        )
    return ToolRequest(normalized, choice, forced, parallel is not False, schemas)


def structural_tag(tr: ToolRequest, fmt: ToolFormat) -> str | None:
    """The xgrammar structural tag that enforces `required` (one or more calls of any tool; only one when
    parallel_tool_calls is false) or a named function (exactly one call of it); None for auto / none.
    The output starts with the call, so the arguments always parse and match the function's schema."""
    if tr.choice not in ("required", "forced"):
        return None
    from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TagsWithSeparatorFormat

    names = [tr.forced] if tr.forced is not None else list(tr.schemas)
    tags = [
        TagFormat(
            begin=fmt.call_prefix(name),
            # runs of whitespace bounded: a small model can otherwise pad the JSON until max_tokens
            content=JSONSchemaFormat(json_schema=tr.schemas[name], max_whitespace_cnt=2),
            end=fmt.call_suffix(),
        )
        for name in names
    ]
    if tr.forced is not None:
        return StructuralTag(format=tags[0]).model_dump_json()
    calls = TagsWithSeparatorFormat(
        tags=tags, separator=fmt.separator, at_least_one=True, stop_after_first=not tr.parallel
    )
    return StructuralTag(format=calls).model_dump_json()


def with_tool_grammar(
    found: list[Constraint], tr: ToolRequest | None, support: ToolSupport
) -> list[Constraint]:
    """The request's constraints, or the one that enforces its forced call: a forced call leaves no room
    for another constraint (HTTP 400 naming that one)."""
    tag = structural_tag(tr, support.fmt) if tr is not None and support.fmt is not None else None
    if tag is None:
        return found
    if found:
        param = found[0].param
        raise _bad(f"'{param}' cannot be combined with a 'tool_choice' that forces a call", param)
    return [Constraint("structural_tag", tag, "tool_choice")]


def _hermes_calls(content: str, tool_calls: list[dict[str, Any]]) -> str:
    calls = [
        HERMES.call_text(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
        for c in tool_calls
    ]
    return "\n".join(([content] if content else []) + calls)


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages for a template without tool support, rendered as Qwen2.5's template renders tools,
    calls and results, in plain {role, content} messages."""
    block = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict[str, Any]] = []
    if tools and messages[0]["role"] == "system":
        first = messages[0]["content"]
        out.append({"role": "system", "content": f"{first}\n\n{block}" if first else block})
        messages = messages[1:]
    elif tools:
        out.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": _hermes_calls(m["content"], m["tool_calls"])})
        elif m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("tool_responses", None)
    return out


def template_messages(
    messages: list[dict[str, Any]], tr: ToolRequest | None, support: ToolSupport
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools for the template) as the tokenizer worker renders them."""
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if support.native:
        return messages, tr.tools if tr is not None else None
    if tr is None and not has_history:
        return messages, None
    if support.fmt is not HERMES:
        raise APIError(
            "this model's chat template has no tool support: tool calls and tool results cannot be "
            "rendered (start the server with --tool-call-parser hermes)",
            "messages",
            "invalid_value",
        )
    return hermes_messages(messages, tr.tools if tr is not None else []), None
