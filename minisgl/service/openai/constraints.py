"""Constrained decoding on the request side: `response_format`, SGLang's `json_schema` / `regex` / `ebnf` /
`structural_tag` and vLLM's `guided_*` fields -> the one SamplingParams constraint field they ask for,
checked by parsing it with xgrammar (HTTP 400 naming the request's field when it does not parse).

The grammar itself is compiled and applied by the scheduler (minisgl/grammar.py, whose parser checks it
here too); this only decides which constraint a request asks for and names the field in errors. `json_object` is the JSON Schema `{"type": "object"}` rather than xgrammar's built-in JSON
grammar: OpenAI's JSON mode promises an object (the built-in grammar also allows arrays and scalars), and
it then shares the schema path (and its cache) with every other schema.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from minisgl.core import SamplingParams
from minisgl.grammar import parse_grammar

from .errors import APIError
from .protocol import ResponseFormat, SamplingBody

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


def _as_json(value: Any, param: str) -> str:
    """A schema or structural tag given as an object or as a JSON string -> the JSON string."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise APIError(f"'{param}' is not valid JSON: {e}", param, "invalid_value") from None
        return value
    return json.dumps(value, ensure_ascii=False)


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
            found.append(Constraint(kind, _as_json(value, param), param))
    for param, kind in (
        ("regex", "regex"),
        ("guided_regex", "regex"),
        ("ebnf", "ebnf"),
        ("guided_grammar", "ebnf"),
    ):
        value = getattr(req, param)
        if value is not None:
            found.append(Constraint(kind, value, param))
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


@functools.lru_cache(maxsize=256)
def _parse(kind: str, value: str) -> str | None:
    """xgrammar's error for a constraint (None when it parses), as the scheduler will compile it. Cached:
    clients repeat their schemas."""
    try:
        parse_grammar(kind, value)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, pydantic errors...
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def check(c: Constraint) -> None:
    """Raise the 400 naming the constraint's request field when xgrammar cannot parse it."""
    error = _parse(c.kind, c.value)
    if error is not None:
        what = {"json_schema": "JSON Schema", "regex": "regular expression", "ebnf": "EBNF grammar"}
        raise APIError(
            f"'{c.param}' is not a valid {what.get(c.kind, 'structural tag')}: {error[:500]}",
            c.param,
            "invalid_value",
        )
