"""Tool calling without a service: the parsers against hand-written model outputs (Hermes and Llama 3 forms,
streamed piece by piece as well as whole), the prompt a template without tool support gets (against a
hand-built string), the format found from a template, the checks of `tools` / `tool_choice`, the
structural tag that enforces a call (against xgrammar's own matcher), the request's constraint fields, and
the chat renderer's chunks and bodies.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, UserReply
from minisgl.models.resolve import resolve_model_path
from minisgl.service.openai.constraints import requested, single
from minisgl.service.openai.errors import APIError
from minisgl.service.openai.protocol import ChatCompletionRequest, CompletionRequest
from minisgl.service.openai.render import ChatOutput, ChatRenderer
from minisgl.service.openai.routing import ChoiceState
from minisgl.service.openai.tool_parser import (
    HERMES,
    LLAMA3,
    CallArgs,
    CallStart,
    Text,
    ToolCallParser,
    parse_tool_calls,
)
from minisgl.service.openai.tools import (
    ToolSupport,
    detect,
    structural_tag,
    template_messages,
    tool_request,
)
from minisgl.tokenizer import TokenizeManager
from minisgl.utils.hf import load_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CHATML = ToolSupport(HERMES, native=False)

HERMES_OUT = (
    "Let me look that up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris {centre}", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2]}}\n</tool_call>'
)


def streamed(text: str, fmt, step: int = 1) -> list:
    """The events of `text` fed `step` characters at a time (as tokens arrive), then finished."""
    parser = ToolCallParser(fmt)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    return events + parser.finish()


# ---- parsing ------------------------------------------------------------------------------------------
def test_hermes_calls_after_text_are_parsed_and_the_text_is_the_content():
    content, calls = parse_tool_calls(HERMES_OUT, HERMES)
    assert content == "Let me look that up."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris {centre}", "unit": "c"}),
        ("add", {"a": 1, "b": [2]}),
    ]
    assert calls[0].arguments == '{"city": "Paris {centre}", "unit": "c"}'  # the model's own text


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_streamed_hermes_events_give_the_same_calls_and_no_markup_in_the_text(step):
    events = streamed(HERMES_OUT, HERMES, step)
    text = "".join(e.text for e in events if isinstance(e, Text))
    assert "<tool_call>" not in text and "</tool_call>" not in text and "{" not in text
    assert text.strip() == "Let me look that up."
    assert [e.name for e in events if isinstance(e, CallStart)] == ["get_weather", "add"]
    _, calls = parse_tool_calls(HERMES_OUT, HERMES)
    for i, call in enumerate(calls):
        pieces = "".join(e.text for e in events if isinstance(e, CallArgs) and e.index == i)
        assert pieces == call.arguments  # the pieces concatenated are the arguments, valid JSON
    starts = [k for k, e in enumerate(events) if isinstance(e, CallStart)]
    first_args = [k for k, e in enumerate(events) if isinstance(e, CallArgs) and e.index == 0]
    assert starts[0] < first_args[0]  # the name comes before the arguments


def test_malformed_json_in_a_call_is_left_as_content():
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": }}\n</tool_call>'
    assert parse_tool_calls(text, HERMES) == (text, [])
    half = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1'  # cut by max_tokens
    assert parse_tool_calls(half, HERMES) == (half, [])


def test_text_without_calls_is_unchanged_even_with_a_partial_marker():
    for text in ("a < b and c <tool", "no calls here", '{"a": 1} is JSON'):
        assert parse_tool_calls(text, HERMES) == (text, [])
        assert "".join(e.text for e in streamed(text, HERMES) if isinstance(e, Text)) == text


def test_a_call_with_its_keys_in_another_order_is_parsed():
    text = '<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>'
    content, calls = parse_tool_calls(text, HERMES)
    assert content is None and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 1, "b": 2}


def test_llama3_json_calls_are_parsed_with_their_parameters():
    one = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}'
    two = one + '; {"name": "add", "parameters": {"a": 3, "b": 4}}'
    content, calls = parse_tool_calls(two, LLAMA3)
    assert content is None and [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].arguments) == {"a": 3, "b": 4}
    _, calls = parse_tool_calls("<|python_tag|>" + one, LLAMA3)
    assert calls[0].arguments == '{"city": "Oslo", "unit": "f"}'
    events = streamed(two, LLAMA3)
    assert "".join(e.text for e in events if isinstance(e, CallArgs) and e.index == 0) == calls[0].arguments


def test_llama3_text_and_json_that_is_not_a_call_stay_content():
    for text in ('The answer is {"name": "x", "parameters": {}}', '{"a": 1}', "Hello there"):
        assert parse_tool_calls(text, LLAMA3) == (text, [])


# ---- rendering -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def hand_built_tool_prompt(system: str) -> str:
    """The ChatML prompt of a tool exchange, written out by hand as Qwen2.5's template renders it."""
    tools = json.dumps(WEATHER) + "\n" + json.dumps(ADD)
    return (
        f"<|im_start|>system\n{system}\n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Oslo, and 2+3?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n-3 degrees\n</tool_response>\n"
        "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


TOOL_EXCHANGE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo, and 2+3?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}},
            },
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
        ],
    },
    {"role": "tool", "content": "-3 degrees", "tool_call_id": "call_1"},
    {"role": "tool", "content": "5", "tool_call_id": "call_2"},
]


def test_a_chatml_template_without_tool_support_gets_the_tools_calls_and_results_hermes_style(tokenizer):
    tr = tool_request([WEATHER, ADD], "auto", None, CHATML)
    messages, template_tools = template_messages(TOOL_EXCHANGE, tr, CHATML)
    assert template_tools is None  # the template cannot read them: they are in the messages
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == hand_built_tool_prompt("Be brief.")


# a template that reads `tools` itself (the shape of Qwen2.5's, cut down)
NATIVE_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% endfor %}<assistant>"
)


def test_a_history_of_calls_without_tools_keeps_the_system_message_as_it_is():
    messages, _ = template_messages(TOOL_EXCHANGE, None, CHATML)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[2]["content"].startswith("Checking.\n<tool_call>\n")


def test_a_template_with_tool_support_renders_the_tools_itself(tokenizer):
    support = detect(NATIVE_TEMPLATE, "hermes")
    assert support.native and support.fmt is HERMES
    tr = tool_request([WEATHER, ADD], "required", None, support)
    messages, tools = template_messages(TOOL_EXCHANGE[1:3], tr, support)
    assert messages == TOOL_EXCHANGE[1:3] and tools == [WEATHER, ADD]
    tok = load_tokenizer(resolve_model_path(None))
    tok.chat_template = NATIVE_TEMPLATE
    msg = TokenizeMsg(0, SamplingParams(), messages=messages, tools=tools)
    text = tok.decode(TokenizeManager(tok).tokenize(msg))
    expected = (
        "<tools>get_weather;add;</tools><user>Weather in Oslo, and 2+3?<assistant>Checking."
        '[get_weather {"city": "Oslo", "unit": "c"}][add {"a": 2, "b": 3}]<assistant>'
    )
    assert text == expected


def test_the_format_is_found_from_the_template():
    qwen = "{% if tools %}...<tool_call>...{% endif %}<|im_start|>"
    llama = "{% if tools %}{{ custom_tools }}{% endif %}<|start_header_id|>ipython<|python_tag|>"
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}"
    assert detect(qwen) == ToolSupport(HERMES, True)
    assert detect(llama) == ToolSupport(LLAMA3, True)
    assert detect(chatml) == ToolSupport(HERMES, False)  # rendered Hermes-style here
    assert detect("{{ messages[0].content }}").fmt is None  # no tool support, no known fallback
    assert detect(chatml, "llama3").fmt is None  # Llama 3's form needs the template's support
    assert detect("{{ messages }}", "hermes") == ToolSupport(HERMES, False)


# ---- checks --------------------------------------------------------------------------------------------
def refused(param_start: str, *args) -> APIError:
    with pytest.raises(APIError) as e:
        tool_request(*args)
    assert e.value.status == 400 and e.value.param.startswith(param_start), e.value.param
    return e.value


def test_bad_tools_and_tool_choices_are_refused_naming_the_field():
    refused(
        "tools[0].function.name",
        [{"type": "function", "function": {"description": "x"}}],
        "auto",
        None,
        CHATML,
    )
    no_object = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    refused("tools[1].function.parameters", [ADD, no_object], "auto", None, CHATML)
    bad_schema = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "required": 5}},
    }
    refused("tools[0].function.parameters", [bad_schema], "auto", None, CHATML)
    refused("tools[1].function.name", [ADD, ADD], "auto", None, CHATML)
    err = refused("tool_choice", [ADD], {"type": "function", "function": {"name": "nope"}}, None, CHATML)
    assert "nope" in err.message
    refused("tool_choice", [ADD], "always", None, CHATML)
    refused("tool_choice", None, "required", None, CHATML)
    refused("tools", [ADD], "auto", None, ToolSupport(None, False))
    assert tool_request([], "none", None, CHATML) is None and tool_request(None, None, None, CHATML) is None


def test_required_is_enforced_by_a_structural_tag_of_the_tools_schemas():
    tag = xgr.Grammar.from_structural_tag(
        structural_tag(tool_request([WEATHER, ADD], "required", None, CHATML), HERMES)
    )
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x", "unit": "f"}}\n</tool_call>'
    assert _is_grammar_accept_string(tag, call)
    assert _is_grammar_accept_string(tag, call + "\n" + weather)  # parallel calls by default
    assert not _is_grammar_accept_string(tag, "")  # at least one call
    assert not _is_grammar_accept_string(tag, "Hi " + call)  # the output is the calls
    assert not _is_grammar_accept_string(tag, call.replace('"b": 2', '"b": "2"'))  # the schema holds
    assert not _is_grammar_accept_string(tag, call.replace(', "b": 2', ""))  # required properties
    assert not _is_grammar_accept_string(tag, weather.replace('"f"', '"k"'))  # enum
    assert not _is_grammar_accept_string(tag, call.replace("add", "sub"))  # only the given tools
    single_call = structural_tag(tool_request([WEATHER, ADD], "required", False, CHATML), HERMES)
    assert not _is_grammar_accept_string(xgr.Grammar.from_structural_tag(single_call), call + "\n" + weather)


def test_a_named_function_is_enforced_alone_and_llama3_calls_have_their_own_form():
    named = {"type": "function", "function": {"name": "add"}}
    tag = xgr.Grammar.from_structural_tag(
        structural_tag(tool_request([WEATHER, ADD], named, None, CHATML), HERMES)
    )
    assert _is_grammar_accept_string(
        tag, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x", "unit": "f"}}\n</tool_call>'
    assert not _is_grammar_accept_string(tag, weather)
    llama = structural_tag(tool_request([ADD], "required", None, ToolSupport(LLAMA3, True)), LLAMA3)
    assert _is_grammar_accept_string(
        xgr.Grammar.from_structural_tag(llama), '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    )
    assert structural_tag(tool_request([ADD], "auto", None, CHATML), HERMES) is None  # auto: free text


def test_each_constraint_field_becomes_its_sampling_params_field_and_a_bad_one_names_itself():
    def one(**body):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
        return single(requested(req, req.response_format))

    assert one(response_format={"type": "json_object"}).value == '{"type": "object"}'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = one(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert (c.kind, json.loads(c.value), c.param) == ("json_schema", schema, "response_format")
    assert one(response_format={"type": "text"}) is None and one() is None
    assert (one(regex="[ab]+").kind, one(ebnf='root ::= "a"').kind) == ("regex", "ebnf")
    assert (
        one(guided_json=schema).kind == "json_schema"
        and one(json_schema=json.dumps(schema)).param == "json_schema"
    )
    assert one(guided_choice=["yes", "no"]).value == "(yes)|(no)"
    # what xgrammar refuses ("(unclosed" as a regex) is found by the scheduler's compile processes, which
    # name the field too (test_structured_api); here: what is refused before anything parses the text
    for body, param in [
        ({"regex": "(" * 41 + ")" * 41}, "regex"),
        ({"json_schema": '{"items": ' * 41 + "{}" + "}" * 41}, "json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ]:
        with pytest.raises(APIError) as e:
            one(**body)
        assert e.value.param == param, (body, e.value.message)
    req = CompletionRequest.model_validate({"prompt": "x", "regex": "[0-9]+"})
    assert single(requested(req, req.response_format)).kind == "regex"


# ---- the chat renderer ------------------------------------------------------------------------------------
def sse_deltas(frames: list[bytes]) -> list[dict]:
    """The choices of every SSE frame, in order."""
    out = []
    for frame in frames:
        for line in frame.decode().split("\n\n"):
            if line.startswith("data: "):
                out += json.loads(line[len("data: ") :])["choices"]
    return out


def test_two_streamed_choices_each_get_their_own_calls_in_openai_chunks():
    r = ChatRenderer("m", "chatcmpl-0", output=ChatOutput(tools=HERMES))
    choices = [ChoiceState(0, 10, 0), ChoiceState(1, 11, 0)]
    texts = [HERMES_OUT, '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 6}}\n</tool_call>']
    frames = []
    for k in range(0, max(map(len, texts)), 3):  # the two choices' pieces interleaved, as they arrive
        for c, text in zip(choices, texts):
            if text[k : k + 3]:
                frames.append(r.stream_delta(c, UserReply(c.uid, text[k : k + 3]), 0) or b"")
    for c in choices:
        c.finish_reason = "stop"
        frames.append(r.stream_finish(c))
    deltas = sse_deltas(frames)
    for index, text in enumerate(texts):
        mine = [d for d in deltas if d["index"] == index]
        content = "".join(d["delta"].get("content", "") for d in mine)
        calls: dict[int, dict] = {}
        for d in mine:
            for tc in d["delta"].get("tool_calls", []):
                if tc["index"] not in calls:
                    assert (
                        set(tc) == {"index", "id", "type", "function"} and tc["function"]["arguments"] == ""
                    )
                    calls[tc["index"]] = dict(tc["function"])
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                    calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
        expected_content, expected_calls = parse_tool_calls(text, HERMES)
        assert content.strip() == (expected_content or "") and "<tool_call>" not in content
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (t.name, t.arguments) for t in expected_calls
        ]
        assert mine[-1]["finish_reason"] == "tool_calls" and mine[-1]["delta"] == {}


def test_the_full_reply_holds_the_calls_and_the_text_outside_them():
    r = ChatRenderer("m", "chatcmpl-0", output=ChatOutput(tools=HERMES))
    c = ChoiceState(0, 1, 0, text=HERMES_OUT, finish_reason="stop")
    message = r._final(c)["message"]
    assert message["content"] == "Let me look that up."
    assert [(t["type"], t["function"]["name"]) for t in message["tool_calls"]] == [
        ("function", "get_weather"),
        ("function", "add"),
    ]
    assert r._final(c)["finish_reason"] == "tool_calls"
    c.finish_reason = "length"  # cut short: the client must know it
    assert r._final(c)["finish_reason"] == "length"
    plain = ChoiceState(0, 1, 0, text="just text", finish_reason="stop")
    assert r._final(plain)["message"] == {"role": "assistant", "content": "just text"}


@pytest.mark.parametrize("cut", ["<", "<tool_", "<tool_call", "<tool_call>\n", '<tool_call>\n{"name": "ad'])
def test_a_forced_call_cut_by_max_tokens_before_its_name_leaves_no_markup_in_the_content(cut):
    """With tool_choice forcing a call the output is calls only: a start marker cut by max_tokens is
    markup (no content, no call); with "auto" the same text may be the model's own, and stays."""
    assert parse_tool_calls(cut, HERMES, forced=True) == (None, [])
    assert parse_tool_calls(cut, HERMES) == (cut, [])
    events = ChatOutput(tools=HERMES, forced=True).parser()
    streamed = events.feed(cut) + events.finish()
    assert not streamed, streamed
