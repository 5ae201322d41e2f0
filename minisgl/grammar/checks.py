"""A request's constraint checked before it reaches the scheduler: its size, its nesting (iteratively, before
anything parses it recursively) and its syntax (xgrammar's parser, no tokenizer needed)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from minisgl.core import InvalidRequest, SamplingParams
from minisgl.utils import init_logger

if TYPE_CHECKING:
    import xgrammar

logger = init_logger(__name__)

JSON_SEPARATORS = (", ", ": ")
MAX_GRAMMAR_CHARS = 1 << 20  # a constraint's text; far beyond any real schema or grammar
MAX_NESTING = 40  # brackets in a constraint's text: a body's 32 levels, and a forced tool call's wrapping
MAX_CHECKED = 256  # constraints remembered as parsed (by their hash)
WHAT = {
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "ebnf": "EBNF grammar (with a 'root' rule)",
    "structural_tag": "structural tag",
}


def load_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(
            "structured output needs xgrammar: pip install 'xgrammar>=0.2' (the `grammar` extra; ./run "
            "installs it)"
        ) from e
    return xgrammar


def parse_grammar(kind: str, text: str) -> xgrammar.Grammar:
    """The xgrammar Grammar of one constraint (kind: a SamplingParams field name); raises on bad text."""
    xgr = load_xgrammar()
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(text)
    raise ValueError(f"unknown constraint kind {kind!r}")


# what a nesting scan skips: JSON strings; in a regex or EBNF grammar escapes, character classes, literals
_OPAQUE = {
    "json": re.compile(r'"(?:[^"\\]|\\.)*"'),
    "text": re.compile(r'\\.|\[(?:\\.|[^\]\\])*\]|"(?:[^"\\]|\\.)*"'),
}
_OPEN, _CLOSE = frozenset("[{("), frozenset("]})")


def nesting_depth(kind: str, text: str) -> int:
    """How deep the brackets of a constraint's text nest, found without recursion (the parsers that read
    it next recurse once per level: too deep a text would exhaust their stack)."""
    skeleton = _OPAQUE["json" if kind in ("json_schema", "structural_tag") else "text"].sub("", text)
    depth = deepest = 0
    for c in re.sub(r"[^\[\]{}()]", "", skeleton):
        depth += 1 if c in _OPEN else -1
        deepest = max(deepest, depth)
    return deepest


def check_size(kind: str, text: str, param: str | None = None) -> None:
    """Bound a constraint's text before anything parses it: its length and its nesting depth (iterative,
    so a schema of arrays nested 1,000 deep is a 400, not a RecursionError). `param`: the name an error
    gives the field (default: `kind`)."""
    param = param or kind
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"'{param}' holds {len(text)} characters; at most {MAX_GRAMMAR_CHARS}", param)
    depth = nesting_depth(kind, text)
    if depth > MAX_NESTING:
        raise InvalidRequest(f"'{param}' nests {depth} levels deep; at most {MAX_NESTING}", param)


def detail(e: Exception) -> str:
    """xgrammar's error, on one line, without its time and source-file prefix."""
    text = " ".join(str(e).split())
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:300] or type(e).__name__


def constraint_digest(kind: str, text: str) -> bytes:
    return hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).digest()


_checked: OrderedDict[bytes, None] = OrderedDict()  # digests of constraints that parsed (clients repeat them)


def check_grammar(params: SamplingParams, parse: bool = True) -> None:
    """Check the request's constraint, if any: its type, size and nesting (`check_size`), a JSON one's
    syntax, and (`parse`) whether xgrammar parses it; raise InvalidRequest naming the field (`json_schema`,
    `regex`, `ebnf`, `structural_tag`) when it is not valid. The service leaves the parse to its compile
    processes (xgrammar's warnings on a large schema would flood its log otherwise)."""
    params.validate()
    grammar = params.grammar
    if grammar is None:
        return
    kind, text = grammar
    digest = constraint_digest(kind, text)
    if digest in _checked:
        return
    check_size(kind, text)
    if kind in ("json_schema", "structural_tag"):
        try:
            value = json.loads(text)  # safe: the depth is bounded
        except ValueError as e:
            raise InvalidRequest(f"'{kind}' is not valid JSON: {e}", kind) from None
        if not isinstance(value, (dict, bool) if kind == "json_schema" else dict):
            raise InvalidRequest(f"'{kind}' must be a JSON object, got {type(value).__name__}", kind)
    if not parse:
        return
    try:
        parse_grammar(kind, text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError or its own types
        raise InvalidRequest(f"'{kind}' is not a valid {WHAT[kind]}: {detail(e)}", kind) from None
    if len(_checked) >= MAX_CHECKED:
        _checked.popitem(last=False)
    _checked[digest] = None
