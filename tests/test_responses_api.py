"""The Responses API (POST /v1/responses) through the official openai SDK, streamed and not: text, input
items and instructions, function tools, `text.format`, reasoning items. The chat completion of the same
conversation is the reference for the text (the endpoint is a translation onto the chat path)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from test_tool_calls import ADD

from minisgl.service.openai.errors import APIError
from minisgl.service.openai.responses import chat_body

openai = pytest.importorskip("openai")
ADD_TOOL = {"type": "function", **ADD["function"]}  # Responses' flat function tool
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(shared_service):
    return openai.OpenAI(base_url=f"{shared_service.url}/v1", api_key="none", timeout=300, max_retries=0)


def chat_text(client, messages, **kw) -> str:
    r = client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)
    return r.choices[0].message.content


def stream(client, **kw) -> tuple[list, object]:
    """Every event of a streamed response, and the final response."""
    events = list(client.responses.create(model="m", temperature=0, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    return events, events[-1].response


def test_text_input_with_instructions_answers_as_the_chat_of_the_same_conversation(client):
    r = client.responses.create(
        model="m", input=QUESTION, instructions="Answer in one sentence.", max_output_tokens=24, temperature=0
    )
    expected = chat_text(
        client,
        [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
    )
    assert r.object == "response" and r.output_text == expected
    assert [o.type for o in r.output] == ["message"]
    assert (
        r.usage.output_tokens <= 24 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    )
    assert r.status == ("incomplete" if r.usage.output_tokens == 24 else "completed")


def test_streamed_text_deltas_make_the_final_text_and_the_non_streamed_one(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    events, final = stream(client, input=items, max_output_tokens=24)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == next(e.text for e in events if e.type == "response.output_text.done")
    again = client.responses.create(model="m", input=items, max_output_tokens=24, temperature=0)
    assert (
        again.output_text == text == chat_text(client, [{"role": "user", "content": QUESTION}], max_tokens=24)
    )


def test_a_required_function_call_is_a_function_call_item_streamed_and_not(client):
    kw = {
        "input": "Add 1 and 2.",
        "tools": [ADD_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 80,
    }
    r = client.responses.create(model="m", temperature=0, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["add"] and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), ADD["function"]["parameters"])
    events, final = stream(client, **kw)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == done.arguments == calls[0].arguments
    assert [(o.type, o.name, o.arguments) for o in final.output if o.type == "function_call"] == [
        ("function_call", "add", args)
    ]


def test_text_format_json_schema_holds_the_answer_to_the_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    r = client.responses.create(model="m", input=QUESTION, text=fmt, max_output_tokens=60, temperature=0)
    jsonschema.validate(json.loads(r.output_text), schema)
    _, final = stream(client, input=QUESTION, text=fmt, max_output_tokens=60)
    assert final.output_text == r.output_text


def test_reasoning_is_a_reasoning_item_before_the_message(client):
    grammar = {"ebnf": 'root ::= "<think>" "Paris, surely." "</think>" "It is Paris."'}
    r = client.responses.create(
        model="m", input=QUESTION, max_output_tokens=60, temperature=0, extra_body=grammar
    )
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Paris, surely." and r.output_text == "It is Paris."
    events, final = stream(client, input=QUESTION, max_output_tokens=60, extra_body=grammar)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Paris, surely."
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "It is Paris."


def test_a_conversation_of_items_becomes_chat_messages():
    body = chat_body(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Add 1 and 2."},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
                {"type": "function_call_output", "call_id": "c1", "output": "3"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
            ],
            "max_output_tokens": 5,
            "tools": [ADD_TOOL],
            "tool_choice": {"type": "function", "name": "add"},
            "text": {"format": {"type": "json_object"}},
        }
    )
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    assert body["tools"] == [ADD] and body["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert body["max_completion_tokens"] == 5 and body["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0]"),
        ({"input": []}, "input"),
        ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ],
)
def test_what_cannot_be_translated_is_a_400_naming_the_responses_field(shared_service, body, param):
    r = httpx.post(f"{shared_service.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if param != "max_output_tokens":  # that one is the chat path's rule, under the Responses name
        with pytest.raises(APIError):
            chat_body(body)
