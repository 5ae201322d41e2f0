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

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minisgl.core import InvalidRequest, Req, SamplingParams
from minisgl.utils.device import HostRing

if TYPE_CHECKING:
    import xgrammar

JSON_SEPARATORS = (", ", ": ")
MAX_GRAMMAR_CHARS = 1 << 20  # a constraint's text; far beyond any real schema or grammar
MAX_CACHED = 256  # compiled constraints kept (each holds per-token tables of the vocabulary)
BATCH_FILL_MIN = 8  # constrained rows from which a GPU step fills their masks on several threads
_WHAT = {
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "ebnf": "EBNF grammar (with a 'root' rule)",
    "structural_tag": "structural tag",
}


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def parse_grammar(kind: str, text: str) -> xgrammar.Grammar:
    """The xgrammar Grammar of one constraint (kind: a SamplingParams field name); raises on bad text."""
    xgr = _xgr()
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(text)
    raise ValueError(f"unknown constraint kind {kind!r}")


_checked: dict[tuple[str, str], None] = {}  # constraints that parsed (a client often repeats its schema)


def check_grammar(params: SamplingParams) -> None:
    """Parse the request's constraint, if any, with xgrammar; raise InvalidRequest naming the field
    (`json_schema`, `regex`, `ebnf`, `structural_tag`) when it is not valid. Checks the types first."""
    params.validate()
    grammar = params.grammar
    if grammar is None or grammar in _checked:
        return
    kind, text = grammar
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"'{kind}' holds {len(text)} characters; at most {MAX_GRAMMAR_CHARS}", kind)
    if kind in ("json_schema", "structural_tag"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise InvalidRequest(f"'{kind}' is not valid JSON: {e}", kind) from None
        if not isinstance(value, (dict, bool) if kind == "json_schema" else dict):
            raise InvalidRequest(f"'{kind}' must be a JSON object, got {type(value).__name__}", kind)
    try:
        parse_grammar(kind, text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError or its own types
        detail = " ".join(str(e).split())[:300]
        raise InvalidRequest(f"'{kind}' is not a valid {_WHAT[kind]}: {detail}", kind) from None
    if len(_checked) >= MAX_CACHED:
        _checked.pop(next(iter(_checked)))
    _checked[grammar] = None


class GrammarCompiler:
    """Compiles constraints against the model's vocabulary on one worker thread, once per (kind, text).

    xgrammar's compiler is built on the thread at the first constraint, from the model's tokenizer
    (`load_tokenizer`), with the logits' width as the vocabulary (ids beyond the tokenizer's are never
    allowed) and the stop tokens (`stop_ids`) as the ones that may end a complete output."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_ids: Callable[[], list[int]]
    ) -> None:
        self._load_tokenizer, self.vocab_size, self._stop_ids = load_tokenizer, vocab_size, stop_ids
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="minisgl-grammar")
        self._futures: dict[tuple[str, str], Future] = {}
        self._compiler: Any = None

    def submit(self, kind: str, text: str) -> Future:
        """A future of the compiled grammar (an xgrammar CompiledGrammar); a repeated constraint shares it."""
        key = (kind, text)
        future = self._futures.pop(key, None)
        if future is None:
            future = self._pool.submit(self._compile, kind, text)
        self._futures[key] = future  # most recently used last
        if len(self._futures) > MAX_CACHED:
            self._futures.pop(next(iter(self._futures)))
        return future

    def _compile(self, kind: str, text: str) -> Any:
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(
                self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=sorted(self._stop_ids())
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(parse_grammar(kind, text))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def new_matcher(compiled: Any) -> Any:
    """A fresh matcher (xgrammar GrammarMatcher) of a compiled grammar, for one request."""
    return _xgr().GrammarMatcher(compiled)


@dataclass
class TokenMask:
    """A batch's allowed tokens on the device: `bits` [n, ceil(V/32)] int32, one row per constrained
    sampled row; `rows` [n] their indices among the sampled rows (None: every sampled row, in order),
    on the device and (`host_rows`) as a list."""

    bits: torch.Tensor
    rows: torch.Tensor | None
    host_rows: list[int]


class TokenMasks:
    """Fills the token bitmasks of a batch's constrained rows on the host, through pinned buffers. With
    a GPU, many rows are filled by xgrammar's thread pool (on a CPU the cores run the model)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.width = (vocab_size + 31) // 32
        self.device = device
        self._ring = HostRing(device)
        self.threads = 1 if device.type == "cpu" else min(8, max(1, (os.cpu_count() or 2) // 2))
        self._batch: Any = None  # xgrammar BatchGrammarMatcher, made at the first large batch

    def fill(self, reqs: list[Req], rows: list[int], num_sampled: int) -> TokenMask:
        """The mask of sampled rows `rows` (their requests `reqs`, in order) of a batch sampling
        `num_sampled` rows. A finished request's row (its token will be discarded) allows everything."""
        n = len(rows)
        buf, slot = self._ring.take(n * self.width)
        bits = buf[: n * self.width].view(n, self.width)
        live = []
        for k, req in enumerate(reqs):
            if req.finished or req.grammar is None:
                bits[k].fill_(-1)
            else:
                live.append(k)
        if self.threads > 1 and len(live) >= BATCH_FILL_MIN:
            if self._batch is None:
                self._batch = _xgr().BatchGrammarMatcher(self.threads)
            self._batch.batch_fill_next_token_bitmask([reqs[k].grammar for k in live], bits, live)
        else:
            for k in live:
                reqs[k].grammar.fill_next_token_bitmask(bits, k)
        dev = bits.to(self.device, non_blocking=True)
        self._ring.used(slot)  # the buffer is handed out again once this copy is done
        every = n == num_sampled  # rows are ascending and distinct: all of them means 0..n-1
        index = None
        if not every and self.device.type != "cpu":
            index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return TokenMask(dev, index, list(range(n)) if every else rows)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the logits of the tokens a constrained row may not take to -inf, in place (xgrammar's kernel:
    Triton on a GPU, C++ on a CPU); the other rows are untouched."""
    apply, width = _xgr().apply_token_bitmask_inplace, logits.shape[-1]
    if len(mask.host_rows) == logits.shape[0]:
        apply(logits, mask.bits, vocab_size=width)
    elif logits.device.type == "cpu":  # row by row on views: no copy of the logits
        for k, row in enumerate(mask.host_rows):
            apply(logits[row], mask.bits[k], vocab_size=width)
    else:  # one kernel over the constrained rows, gathered
        sub = logits.index_select(0, mask.rows)
        apply(sub, mask.bits, vocab_size=width)
        logits.index_copy_(0, mask.rows, sub)
