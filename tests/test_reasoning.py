"""Reasoning models: the think block of a reply is `reasoning_content` / `reasoning` (streamed as deltas of
both), the rest `content` with its tool calls; where the reply starts is read from the chat template's
generation prompt with the request's `chat_template_kwargs`; a constraint lets the reasoning come first.

The served model is the default one with a Qwen3-style template (helpers.THINKING_TEMPLATE); its outputs are
forced by a grammar, so every split is checked against the text the grammar wrote, never a recording.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from test_tool_calls import ADD
from xgrammar.testing import _is_grammar_accept_string

from minisgl.service.openai.constraints import Constraint
from minisgl.service.openai.reasoning import (
    CLOSED,
    MAY_OPEN,
    OPEN,
    REASONING_FORMATS,
    ReasoningSplitter,
    after_reasoning,
    detect,
    prompt_state,
    split,
)
from minisgl.service.openai.tool_parser import HERMES
from minisgl.service.openai.tools import ToolRequest, structural_tag

openai = pytest.importorskip("openai")
QWEN3 = REASONING_FORMATS["qwen3"]
R1 = REASONING_FORMATS["deepseek-r1"]
ASK = [{"role": "user", "content": "What is the capital of France?"}]


# ---- the parser -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, state, reasoning, content",
    [
        ("<think>\nParis, surely.\n</think>\n\nIt is Paris.", MAY_OPEN, "Paris, surely.\n", "It is Paris."),
        ("It is Paris.", MAY_OPEN, None, "It is Paris."),
        ("  <think>a</think>b", MAY_OPEN, "a", "b"),
        ("Paris, surely.</think>\n\nIt is Paris.", OPEN, "Paris, surely.", "It is Paris."),
        ("<think>x</think>y", OPEN, "x", "y"),  # an opening marker the prompt already wrote is dropped
        ("still thinking", OPEN, "still thinking", ""),  # cut short inside the block
        ("<think>a</think>b", CLOSED, None, "<think>a</think>b"),  # thinking is off: all of it is the answer
        ("a < b, </thin and </think>c <think>", MAY_OPEN, None, "a < b, </thin and </think>c <think>"),
    ],
)
def test_the_split_of_a_whole_output_and_of_its_stream_in_any_pieces_agree(text, state, reasoning, content):
    assert split(text, QWEN3, state) == (reasoning, content)
    if state == CLOSED:
        return
    for step in (1, 2, 3, 7):
        s = ReasoningSplitter(QWEN3, state)
        parts = [s.feed(text[k : k + step]) for k in range(0, len(text), step)] + [s.finish()]
        assert "".join(r for r, _ in parts) == (reasoning or "")
        assert "".join(c for _, c in parts) == content
        assert not any("<think>" in r or "</think>" in r for r, _ in parts)  # markers never leak


def test_the_format_comes_from_the_flag_or_a_template_that_writes_a_think_block():
    assert detect("{{ '<think>\\n' }} ... </think>") is QWEN3
    assert detect("<|im_start|>assistant") is None
    assert detect("<think></think>", "none") is None
    assert detect("", "deepseek-r1") is R1


def test_where_a_reply_starts_is_read_from_the_generation_prompt():
    assert prompt_state("<|im_start|>assistant\n", QWEN3) == MAY_OPEN
    assert prompt_state("<|im_start|>assistant\n<think>\n", QWEN3) == OPEN
    assert prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n", QWEN3) == CLOSED
    assert prompt_state("<|im_start|>assistant\n", R1) == OPEN  # deepseek-r1 starts in the reasoning


# ---- constraints after the reasoning ----------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def accepts(c: Constraint, text: str) -> bool:
    assert c.kind == "structural_tag"
    return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(c.value), text)


def test_a_schema_holds_after_the_reasoning_which_comes_first():
    c = Constraint("json_schema", json.dumps(SCHEMA), "response_format")
    opened = after_reasoning(c, QWEN3, OPEN)
    assert accepts(opened, 'The user wants a.\n</think>\n\n{"a": 1}')
    assert not accepts(opened, '{"a": 1}')  # the block the prompt opened must close first
    assert not accepts(opened, 'hmm</think>\n\n{"b": 1}')
    may = after_reasoning(c, QWEN3, MAY_OPEN)
    assert accepts(may, '<think>hmm</think>\n{"a": 2}') and accepts(may, '{"a": 2}')
    assert not accepts(may, 'hmm</think>{"a": 2}')
    assert after_reasoning(c, QWEN3, CLOSED) is c and after_reasoning(c, None, MAY_OPEN) is c
    own = Constraint("ebnf", 'root ::= "<think>a</think>b"', "ebnf")  # the client's grammar writes the block
    assert after_reasoning(own, QWEN3, MAY_OPEN) is own


def test_a_forced_tool_call_comes_after_the_reasoning():
    tr = ToolRequest([ADD], "required", schemas={"add": ADD["function"]["parameters"]})
    c = after_reasoning(Constraint("structural_tag", structural_tag(tr, HERMES), "tool_choice"), QWEN3, OPEN)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert accepts(c, f"I should add.</think>\n\n{call}")
    assert not accepts(c, call)
    assert not accepts(c, f"x</think>{call.replace('add', 'sub')}")


# ---- through the service ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(shared_service):
    return openai.OpenAI(base_url=f"{shared_service.url}/v1", api_key="none", timeout=300, max_retries=0)


def both_ways(client, extra: dict, **kw):
    """(reasoning, content, calls) of the same request, non-streamed and streamed (deltas joined)."""
    args = dict(model="m", messages=ASK, temperature=0, max_tokens=80, extra_body=extra, **kw)
    m = client.chat.completions.create(**args).choices[0].message
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
    full = (m.reasoning_content, m.content, calls)
    assert m.reasoning == m.reasoning_content  # both names, for clients that read either
    reasoning, reasoning2, content, pieces = "", "", "", {}
    for chunk in client.chat.completions.create(stream=True, **args):
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        reasoning2 += getattr(d, "reasoning", None) or ""
        content += d.content or ""
        for t in d.tool_calls or []:
            pieces.setdefault(t.index, ["", ""])
            pieces[t.index][0] += t.function.name or ""
            pieces[t.index][1] += t.function.arguments or ""
    assert reasoning2 == reasoning
    streamed = [(n, json.loads(a)) for n, a in pieces.values()]
    return full, (reasoning or None, content or None, streamed)


def grammar(*parts: str) -> str:
    return "root ::= " + " ".join(json.dumps(p) for p in parts)


def test_a_reply_that_opens_a_think_block_is_split_streamed_and_not(client):
    full, streamed = both_ways(
        client, {"ebnf": grammar("<think>\n", "Paris, surely.", "\n</think>\n\n", "It is Paris.")}
    )
    assert full == streamed == ("Paris, surely.\n", "It is Paris.", [])


def test_a_reply_that_starts_inside_the_block_the_prompt_opened_is_split(client):
    extra = {
        "ebnf": grammar("Paris, surely.", "</think>", "It is Paris."),
        "chat_template_kwargs": {"open_thinking": True},
    }
    full, streamed = both_ways(client, extra)
    assert full == streamed == ("Paris, surely.", "It is Paris.", [])


def test_with_thinking_off_the_template_gets_the_variable_and_the_reply_is_all_content(client):
    extra = {"ebnf": grammar("<think>a</think>b"), "chat_template_kwargs": {"enable_thinking": False}}
    full, streamed = both_ways(client, extra)
    assert full == (None, "<think>a</think>b", [])
    assert streamed == full


def test_tool_calls_after_the_reasoning_are_parsed_from_the_answer(client):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    full, streamed = both_ways(client, {"ebnf": grammar("<think>I should add.</think>\n", call)}, tools=[ADD])
    assert full == streamed == ("I should add.", None, [("add", {"a": 1, "b": 2})])


def test_structured_output_is_held_to_its_schema_with_room_for_reasoning_first(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    full, streamed = both_ways(client, {}, response_format=rf)
    assert full == streamed
    jsonschema.validate(json.loads(full[1]), schema)
