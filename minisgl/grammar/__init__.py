"""Constrained decoding with xgrammar: checking a request's constraint, compiling it off the scheduler's
critical path, and the per-step token masks.

A request sets at most one of SamplingParams' `json_schema`, `regex`, `ebnf`, `structural_tag`.
`check_grammar` parses it (no tokenizer needed: the service's tokenizer process and `LLM.generate` call it,
so a bad constraint is refused before it reaches the scheduler). The scheduler compiles it against the
model's vocabulary on a worker thread (`GrammarCompiler`, one compilation per distinct constraint) and
gives the request a matcher (`new_matcher`), advanced with every token the request keeps. Each step,
`TokenMasks.fill` writes the allowed-token bitmask of the batch's constrained rows on the host and copies
it to the device; `apply_token_mask` sets the other logits of those rows to -inf before sampling.

JSON schemas compile with `any_whitespace=False` and the separators ", " and ": ": a model may put no
whitespace of its own choosing between the tokens, so a weak (or random) model cannot loop on spaces and
newlines, and the output reads as `json.dumps` writes it.

xgrammar is imported on first use: a process that never sees a constraint never loads it."""

from .checks import (
    JSON_SEPARATORS,
    MAX_GRAMMAR_CHARS,
    MAX_NESTING,
    check_grammar,
    check_size,
    nesting_depth,
    parse_grammar,
)
from .compiler import DEFAULT_CACHE_MB, DEFAULT_COMPILE_TIMEOUT, GrammarCompiler
from .masks import TokenMask, TokenMasks, apply_token_mask, new_matcher

__all__ = [
    "DEFAULT_CACHE_MB",
    "DEFAULT_COMPILE_TIMEOUT",
    "JSON_SEPARATORS",
    "MAX_GRAMMAR_CHARS",
    "MAX_NESTING",
    "GrammarCompiler",
    "TokenMask",
    "TokenMasks",
    "apply_token_mask",
    "check_grammar",
    "check_size",
    "nesting_depth",
    "new_matcher",
    "parse_grammar",
]
