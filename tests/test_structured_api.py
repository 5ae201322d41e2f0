"""Structured output and tool calling through the real service and the official `openai` client, on the
default model (SmolLM2-135M-Instruct, whose ChatML template has no tool support: the tools are rendered
Hermes-style by the server).

One service for the module. Outputs are checked against their schema (jsonschema), their regex
(re.fullmatch), and a hand-built prompt; never against recorded output.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from helpers import serving
from test_tool_calls import ADD, WEATHER, hand_built_tool_prompt

from minisgl.models.resolve import resolve_model_path
from minisgl.utils.hf import load_tokenizer

openai = pytest.importorskip("openai")

ARGS = ["--dtype", "float32", "--num-pages", "2048", "--max-seq-len-override", "1024"]
ARGS += ["--served-model-name", "m"]
PERSON = {  # nested object, enum, array, required fields; bounded so that a tiny model finishes
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "pet": {
            "type": "object",
            "properties": {
                "kind": {"type": "string", "enum": ["cat", "dog"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
            },
            "required": ["kind", "tags"],
        },
    },
    "required": ["name", "age", "pet"],
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
NAME_RE = r"[A-Z][a-z]{2,8} is (happy|sad)\."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(ARGS, tmp_path_factory.mktemp("structured") / "server.log") as service:
        yield service


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def chat(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


def assert_valid_calls(message, names=SCHEMAS):
    """Every call names a given tool and its arguments parse and validate against that tool's schema."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), names[call.function.name])


# ---- response_format and the grammar fields ------------------------------------------------------------
def test_a_json_schema_response_format_gives_json_that_validates(client):
    r = chat(client, ASK_PERSON, response_format=PERSON_FORMAT, max_tokens=120)
    assert r.choices[0].finish_reason == "stop"  # the grammar ended the output
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    c = client.completions.create(
        model="m",
        prompt="A person as JSON:",
        max_tokens=120,
        temperature=0,
        extra_body={"response_format": PERSON_FORMAT},
    )
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)


def test_json_object_gives_a_json_object(client):
    messages = [{"role": "user", "content": "Reply with a JSON object holding your name."}]
    r = chat(client, messages, response_format={"type": "json_object"}, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_regex_constrains_the_output_on_every_endpoint(client, http):
    r = chat(client, ASK_PERSON, max_tokens=30, extra_body={"regex": NAME_RE})
    assert re.fullmatch(NAME_RE, r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    c = client.completions.create(
        model="m", prompt="Tom", max_tokens=30, temperature=0, extra_body={"guided_regex": NAME_RE}
    )
    assert re.fullmatch(NAME_RE, c.choices[0].text)
    g = http.post(
        "/generate",
        json={"text": "Tom", "sampling_params": {"max_new_tokens": 30, "temperature": 0, "regex": NAME_RE}},
    )
    assert g.status_code == 200, g.text
    assert re.fullmatch(NAME_RE, g.json()["text"])
    choice = chat(client, ASK_PERSON, max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")


def test_constrained_and_unconstrained_requests_in_one_batch_each_get_what_they_asked_for(client):
    free = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 24}
    alone = chat(client, **free).choices[0].message.content
    constrained = {"messages": ASK_PERSON, "max_tokens": 30, "extra_body": {"regex": NAME_RE}}
    jobs = [free, constrained, free, constrained]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda kw: chat(client, **kw).choices[0].message.content, jobs))
    assert replies[0] == replies[2] == alone  # greedy: the same as the request sent alone
    assert re.fullmatch(NAME_RE, replies[1]) and re.fullmatch(NAME_RE, replies[3])


# ---- tools ------------------------------------------------------------------------------------------------
def test_required_gives_tool_calls_whose_arguments_validate(client):
    r = chat(
        client,
        ASK_WEATHER,
        tools=[WEATHER, ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message)
    assert len(choice.message.tool_calls) == 1 and choice.message.content is None


def test_required_streams_the_calls_as_openai_does(client):
    kw = {"tools": [WEATHER, ADD], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60}
    whole = chat(client, ASK_WEATHER, **kw).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chat(client, ASK_WEATHER, stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first piece of a call: its id, type and name, no arguments yet
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
    assert finish == "tool_calls" and "<tool_call>" not in content and not content.strip()
    assert list(calls) == [0]
    args = json.loads(calls[0]["arguments"])  # the pieces together are one valid JSON
    jsonschema.validate(args, SCHEMAS[calls[0]["name"]])
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments)


def test_a_named_function_is_the_one_called(client):
    named = {"type": "function", "function": {"name": "add"}}
    messages = [{"role": "user", "content": "What is 20 plus 22?"}]
    r = chat(client, messages, tools=[WEATHER, ADD], tool_choice=named, max_tokens=80)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["add"]
    assert_valid_calls(r.choices[0].message)


def test_each_of_n_choices_has_its_own_calls(client):
    r = client.chat.completions.create(
        model="m",
        messages=ASK_WEATHER,
        tools=[WEATHER, ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        n=3,
        temperature=1.0,
        seed=7,
    )
    assert len(r.choices) == 3
    ids = set()
    for choice in r.choices:
        assert_valid_calls(choice.message)
        ids |= {c.id for c in choice.message.tool_calls}
    assert len(ids) == 3  # every call its own id


def test_tool_choice_none_reads_no_calls(client):
    r = chat(client, ASK_WEATHER, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_a_tool_result_goes_back_through_the_template(client):
    exchange = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo, and 2+3?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    ]
    r = chat(client, exchange, tools=[WEATHER, ADD], tool_choice="none", max_tokens=12)
    prompt = hand_built_tool_prompt("Be brief.")
    tokenizer = load_tokenizer(resolve_model_path(None))
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    c = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == c.choices[0].text  # the same prompt, greedy: the same answer


# ---- bad input ------------------------------------------------------------------------------------------
BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"regex": "(unclosed"}, "regex"),
    ({"ebnf": "root ::= ("}, "ebnf"),
    ({"regex": "a", "guided_json": {"type": "object"}}, "regex"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "not json"}}]}]}, "messages[0].tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field_and_the_service_keeps_serving(http, fields, param):
    body = {"model": "m", "messages": ASK_WEATHER, "max_tokens": 4, **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
    ok = http.post("/v1/chat/completions", json={"model": "m", "messages": ASK_WEATHER, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_bad_completion_constraint_is_a_400_naming_it(http):
    for fields, param in [
        ({"regex": "[z-a]"}, "regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ]:
        r = http.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post(
        "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "json_schema": "{bad"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text
