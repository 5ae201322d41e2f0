"""Constrained decoding on the request side: `response_format`, SGLang's `json_schema` / `regex` / `ebnf` /
`structural_tag` and vLLM's `guided_*` fields -> the one SamplingParams constraint field they ask for.

A constraint's length and nesting depth are measured without recursion before a JSON string is parsed,
then it gets the bounds of the body itself (`check_json`). Nothing here runs xgrammar: the scheduler's
compile processes parse and compile it (minisgl/grammar/), within a time and a byte budget, and their
errors (not a valid schema, over a budget, no output possible) name the request's field through
`FieldNames.constraint`. `json_object` is the JSON Schema `{"type": "object"}` rather than xgrammar's built-in JSON
grammar: OpenAI's JSON mode promises an object (the built-in grammar also allows arrays and scalars), and
it then shares the schema path (and its cache) with every other schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from minisgl.core import InvalidRequest, SamplingParams
from minisgl.grammar import check_grammar, check_size

from .errors import APIError
from .protocol import ResponseFormat, SamplingBody, check_json

JSON_OBJECT_SCHEMA = '{"type": "object"}'
KINDS = ("json_schema", "regex", "ebnf", "structural_tag")  # the SamplingParams fields


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: the SamplingParams field (`kind`), its value, the request field it came
    from (what an error names)."""

    kind: str
    value: str
    param: str

    def apply(self, params: SamplingParams) -> None:
        """Set the constraint on `params` (the other three fields stay None)."""
        setattr(params, self.kind, self.value)


def _bounded(kind: str, text: str, param: str) -> str:
    """`text`, once its length and nesting depth are within the bounds (HTTP 400 naming `param`)."""
    try:
        check_size(kind, text, param)
    except InvalidRequest as e:
        raise APIError(str(e), param, "invalid_value") from None
    return text


def _as_json(value: Any, param: str, kind: str) -> str:
    """A schema or structural tag given as an object or as a JSON string -> the JSON string. A string
    gets the body's bounds too: its depth is measured before it is parsed, its strings and sizes after."""
    if not isinstance(value, str):  # inside the body: bounded with it already
        return json.dumps(value, ensure_ascii=False)
    _bounded(kind, value, param)
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise APIError(f"'{param}' is not valid JSON: {e}", param, "invalid_value") from None
    if isinstance(parsed, (dict, list)):
        try:
            check_json(parsed if isinstance(parsed, dict) else {param: parsed}, strings=True)
        except APIError as e:
            raise APIError(e.message.replace(f"'{e.param}'", f"'{param}'"), param, "invalid_value") from None
    return value


def _from_response_format(rf: ResponseFormat) -> Constraint | None:
    param = "response_format"
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint("json_schema", JSON_OBJECT_SCHEMA, param)
    if rf.type == "json_schema":
        spec = rf.json_schema
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise APIError(
                "'response_format' of type json_schema needs 'json_schema': {name, schema, strict}",
                param,
                "invalid_value",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise APIError("'response_format.json_schema.schema' must be an object", param, "invalid_value")
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False), param)
    if rf.type == "structural_tag":  # xgrammar's (and SGLang's) {"type": "structural_tag", "format": ...}
        return Constraint("structural_tag", json.dumps(rf.model_dump(), ensure_ascii=False), param)
    raise APIError(
        f"'response_format.type' must be text, json_object, json_schema or structural_tag, got {rf.type!r}",
        param,
        "invalid_value",
    )


def requested(req: SamplingBody, response_format: ResponseFormat | None) -> list[Constraint]:
    """Every constraint the body asks for (more than one is refused by `single`)."""
    found = [_from_response_format(response_format)] if response_format is not None else []
    for param, kind in (
        ("json_schema", "json_schema"),
        ("guided_json", "json_schema"),
        ("structural_tag", "structural_tag"),
    ):
        value = getattr(req, param)
        if value is not None:
            found.append(Constraint(kind, _as_json(value, param, kind), param))
    for param, kind in (
        ("regex", "regex"),
        ("guided_regex", "regex"),
        ("ebnf", "ebnf"),
        ("guided_grammar", "ebnf"),
    ):
        value = getattr(req, param)
        if value is not None:
            found.append(Constraint(kind, _bounded(kind, value, param), param))
    if req.guided_choice is not None:  # vLLM: one of these strings exactly
        if not req.guided_choice:
            raise APIError("'guided_choice' must not be empty", "guided_choice", "invalid_value")
        alternatives = "|".join(f"({re.escape(c)})" for c in req.guided_choice)
        found.append(Constraint("regex", alternatives, "guided_choice"))
    return [c for c in found if c is not None]


def single(found: list[Constraint]) -> Constraint | None:
    """The request's one constraint, checked; two of them are a 400 naming the second."""
    if len(found) > 1:
        names = ", ".join(f"'{c.param}'" for c in found)
        raise APIError(
            f"a request may constrain its output once; it gives {names}", found[1].param, "invalid_value"
        )
    if not found:
        return None
    check(found[0])
    return found[0]


def check(c: Constraint) -> None:
    """Raise the 400 naming the constraint's request field when it is too large, too deep or not valid
    JSON. xgrammar parses it in the scheduler's compile processes, whose errors name the field too."""
    _bounded(c.kind, c.value, c.param)
    try:
        check_grammar(SamplingParams(**{c.kind: c.value}), parse=False)
    except InvalidRequest as e:
        raise APIError(InvalidRequest.renamed(str(e), c.kind, c.param), c.param, "invalid_value") from None
