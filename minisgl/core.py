"""The core data structures: SamplingParams, Req, Batch, and the Phase and FinishReason enums (the
per-process Context a forward pass reads is layers/context.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


class Phase(str, Enum):
    """What a batch computes. A str, so logs and messages carry the plain value."""

    PREFILL = "prefill"  # prompt tokens, possibly on top of a cached prefix (chunks included)
    DECODE = "decode"  # one new token per request

    def __str__(self) -> str:
        return self.value


class FinishReason(str, Enum):
    """Why a request ended. A str, so messages and JSON replies carry the OpenAI value ("stop", ...)."""

    STOP = "stop"  # an EOS or stop token, or a stop string (found by the detokenizer)
    LENGTH = "length"  # max_tokens or the maximum sequence length reached
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # failed inside the service (the reply carries the error)

    def __str__(self) -> str:
        return self.value


class InvalidRequest(ValueError):
    """A request its client can fix. `param` is the offending field by its generic name (`max_tokens`,
    `temperature`, `top_p`, `top_k`, `seed`, `top_logprobs`, `stop_token_ids`, `prompt`); the message
    quotes that name as `'max_tokens'`, so an API can show the field under its own name (`renamed`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param

    @staticmethod
    def renamed(message: str, param: str | None, name: str | None) -> str:
        """`message` with the quoted generic field name replaced by `name` (an endpoint's spelling)."""
        if param is None or name is None or name == param:
            return message
        return message.replace(f"'{param}'", f"'{name}'")


MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-3, 100.0


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop. temperature 0 means greedy.

    `max_tokens=None` generates up to the context: as many tokens as the model's maximum sequence length
    leaves after the prompt. An explicit `max_tokens` that does not fit beside the prompt is rejected."""

    temperature: float = 0.0
    top_k: int = -1  # -1: no limit
    top_p: float = 1.0
    max_tokens: int | None = 1024  # None: up to the context
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    frequency_penalty: float = 0.0  # OpenAI: minus this times the count of the token in the output
    presence_penalty: float = 0.0  # OpenAI: minus this once the token occurs in the output
    repetition_penalty: float = 1.0  # vLLM/HF, over prompt + output: > 1 discourages repeats; 1 is off
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to the logits
    # constrained decoding (at most one; minisgl/grammar/): the output must match it, and the request
    # stops ("stop") once it is complete
    json_schema: str | None = None  # a JSON Schema as JSON text (a dict is accepted and dumped)
    regex: str | None = None
    ebnf: str | None = None  # an xgrammar (GBNF-style) EBNF grammar with a `root` rule
    structural_tag: str | None = None  # xgrammar's structural tag as JSON text (a dict is dumped)
    # keep the tokens at least min_p times as likely as the most likely one (vLLM's); 0 is off. Last, so
    # that positional construction keeps its meaning
    min_p: float = 0.0
    # the prompt's own log-probabilities (vLLM's `prompt_logprobs`): None is off, k >= 0 reports each prompt
    # token's log-probability and the k most likely tokens at its position, from prompt position
    # `prompt_logprobs_start` on (SGLang's `logprob_start_len`; position 0 has none). Those positions are
    # computed, never taken from the prefix cache; with prompt_logprobs set, `max_tokens` may be 0
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    # an embedding instead of a generation: the prompt's final hidden states pooled (the engine's
    # --pooling) and L2-normalised; nothing is generated (max_tokens must then be 0)
    embed: bool = False

    def __post_init__(self) -> None:
        for name in ("json_schema", "structural_tag"):  # messages carry the text, not the object
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, json.dumps(value))

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's constraint (kind is the field's name), or None."""
        for kind in GRAMMAR_FIELDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    def validate(self) -> None:
        """Raise InvalidRequest naming the offending field. Constraints are only type-checked here;
        minisgl.grammar.check_grammar parses them."""
        _validate_grammar_fields(self)
        least = 0 if self.prompt_logprobs is not None or self.embed else 1  # 0: nothing is generated
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < least):
            raise InvalidRequest(
                f"'max_tokens' must be at least {least}, got {self.max_tokens!r}", "max_tokens"
            )
        if self.embed and self.max_tokens != 0:
            raise InvalidRequest("an embedding generates nothing: 'max_tokens' must be 0", "max_tokens")
        k = self.prompt_logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 20):
            raise InvalidRequest(f"'prompt_logprobs' must be in [0, 20], got {k!r}", "prompt_logprobs")
        start = self.prompt_logprobs_start
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise InvalidRequest(
                f"'prompt_logprobs_start' must be >= 0, got {start!r}", "prompt_logprobs_start"
            )
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(f"'temperature' must be >= 0, got {t!r}", "temperature")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"'top_p' must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"'min_p' must be in [0, 1], got {self.min_p!r}", "min_p")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest(f"'top_k' must be -1 (no limit) or >= 1, got {self.top_k!r}", "top_k")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequest(f"'seed' must be an integer, got {self.seed!r}", "seed")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequest("'stop_token_ids' must be token ids >= 0", "stop_token_ids")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest(
                f"'top_logprobs' must be in [0, 20], got {self.top_logprobs!r}", "top_logprobs"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequest(f"'{name}' must be in [-2, 2], got {value!r}", name)
        r = self.repetition_penalty
        # > 0 as vLLM asks, and within a range where logits divided or multiplied by it stay finite
        # (1e-300 would turn them into inf, then the probabilities into NaN)
        if not _is_real(r) or not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(
                f"'repetition_penalty' must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                f"(1 is off), got {r!r}",
                "repetition_penalty",
            )
        if self.logit_bias is not None:
            _validate_logit_bias(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def _validate_grammar_fields(params: SamplingParams) -> None:
    given = [name for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    for name in given:
        if not isinstance(getattr(params, name), str):
            raise InvalidRequest(
                f"'{name}' must be a string, got {type(getattr(params, name)).__name__}", name
            )
    if len(given) > 1:
        names = " and ".join(f"'{n}'" for n in given)
        raise InvalidRequest(
            f"at most one of {names} may be given (each constrains the whole output)", given[0]
        )


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _validate_logit_bias(bias: Any) -> None:
    # JSON object keys are strings: the API layer turns them into ints before they get here
    if not isinstance(bias, dict):
        raise InvalidRequest(
            f"'logit_bias' must map token ids to biases, got {type(bias).__name__}", "logit_bias"
        )
    for token, value in bias.items():
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids (integers >= 0), got {token!r}", "logit_bias"
            )
        if not _is_real(value) or not (-100.0 <= value <= 100.0):
            raise InvalidRequest(
                f"'logit_bias' values must be in [-100, 100], got {value!r} for token {token}", "logit_bias"
            )


@dataclass
class PromptLogprobs:
    """A prompt's log-probabilities under the model's raw distribution, from prompt position `start` (at
    least 1) to its end: `token[i]` is that of prompt token start + i given the tokens before it, `rank[i]`
    its rank there (1: the most likely), and `top_ids[i]` / `top_logprobs[i]` the k most likely tokens
    there, most likely first."""

    start: int
    ids: list[int] = field(default_factory=list)  # the whole prompt's token ids
    token: list[float] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(
        self,
        token: torch.Tensor,
        rank: torch.Tensor,
        top_vals: torch.Tensor | None,
        top_ids: torch.Tensor | None,
    ) -> None:
        """Append one chunk's rows (host tensors)."""
        self.token += token.tolist()
        self.rank += rank.tolist()
        n = token.numel()
        self.top_logprobs += top_vals.tolist() if top_vals is not None else [[] for _ in range(n)]
        self.top_ids += top_ids.tolist() if top_ids is not None else [[] for _ in range(n)]


@dataclass(eq=False)
class Req:
    """One request inside the scheduler: its tokens, its request slot and how far its KV has been computed.

    `token_ids` holds the prompt followed by every generated token. `cached_len` tokens have their KV in the
    pool; the tokens from `cached_len` to `device_len` are computed by the step in flight. The first
    `prefix_cache_len` of them are the part the prefix cache holds for it (locked through `cache_handle`).
    """

    uid: int
    token_ids: list[int]
    sampling_params: SamplingParams
    prompt_len: int = -1
    table_idx: int = -1  # row in the page table and token pool; -1 while not admitted
    cached_len: int = 0  # tokens whose KV is in the pool
    device_len: int = 0  # tokens whose KV exists once the step in flight finishes
    cache_handle: Any = None  # the prefix-cache node locked for this request
    prefix_cache_len: int = 0  # tokens covered by cache_handle (their pages are held by the prefix cache)
    pages: list[int] = field(default_factory=list)  # KV pages covering positions 0.., in order
    table_len: int = 0  # positions whose slots are written in the device page table
    finished: bool = False
    finish_reason: FinishReason | None = None
    max_total_len: int = 0  # prompt + max_tokens, capped by the model's maximum length
    arrival: int = 0  # admission order; the newest running request is retracted first
    cached_prompt_len: int = 0  # prompt tokens the prefix cache held at first admission (usage reports it)
    # minisgl.grammar.RequestGrammar of a constrained request once its grammar is compiled: the matcher
    # has accepted every generated token (kept through retraction; dropped when the request ends)
    grammar: Any = None
    # the prompt's log-probabilities collected so far (SamplingParams.prompt_logprobs), and the next prompt
    # position whose log-probability is still to be scheduled (prompt_len: none left)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_lp_next: int = 0
    # an embedding (SamplingParams.embed): the pooled sum of its final hidden states so far (float32), and
    # the first position it must compute itself (0 for mean and CLS pooling: no prefix from the cache)
    embedding: torch.Tensor | None = None
    embed_from: int = 1 << 62
    # speculative decoding's state for this request (scheduler/speculative.py SpecState), None when off
    spec: Any = None

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.token_ids)
        k = self.sampling_params.prompt_logprobs
        self.prompt_lp_next = self.prompt_len
        if k is not None:
            self.prompt_lp_next = max(self.sampling_params.prompt_logprobs_start, 1)
            self.prompt_logprobs = PromptLogprobs(self.prompt_lp_next, self.token_ids[: self.prompt_len])

    @property
    def prompt_lp_rows(self) -> range:
        """The positions whose logits still give a prompt log-probability (row p predicts token p + 1)."""
        return range(self.prompt_lp_next - 1, self.prompt_len - 1)


@dataclass(eq=False)
class Batch:
    """One forward step. The scheduler fills the host fields; the engine and backend fill the tensors.

    For each request, `extend_lens[i]` new tokens are computed on top of `prefix_lens[i]` already cached
    ones. A request samples a token only when the step reaches the end of its known tokens
    (`sample_mask`); a prefill chunk that stops inside the prompt does not.
    """

    reqs: list[Req]
    phase: Phase  # a plain "prefill" / "decode" is accepted and converted
    prefix_lens: list[int]
    extend_lens: list[int]
    sample_mask: list[bool]
    # device tensors, filled by the scheduler's batch preparation
    input_ids: torch.Tensor | None = None  # [num_tokens] (decode: read from the token pool by the engine)
    positions: torch.Tensor | None = None  # [num_tokens]
    out_loc: torch.Tensor | None = None  # [num_tokens] KV slot each new token writes
    table_idx: torch.Tensor | None = None  # [batch] page-table rows
    seq_lens_t: torch.Tensor | None = None  # [batch] prefix + extend, on the device
    attn_metadata: Any = None  # owned by the attention backend
    # (rows, positions, slots): page-table entries the engine writes before the forward; decode's are
    # (table_idx, positions, out_loc), and its input ids are read from the token pool by the engine
    pt_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # decode: [4, batch] int32, one row per field of engine/graph DECODE_INPUTS, in its order
    graph_inputs: torch.Tensor | None = None
    # sampling: which flat rows give logits, and where each sampled token goes in the token pool
    logits_idx: torch.Tensor | None = None  # [num_sampled] (None in decode: every row samples)
    sample_table_idx: torch.Tensor | None = None  # [num_sampled]
    sample_pos: torch.Tensor | None = None  # [num_sampled] position of the sampled token
    sampling_info: Any = None  # engine/sampler.py SamplingInfo
    # the sampled rows (indices among them) under a grammar; their token masks are filled just before
    # sampling (minisgl/grammar/). None: no constrained row, the plain path
    grammar_rows: list[int] | None = None
    padded_size: int = 0  # batch size after padding for a CUDA graph (decode only)
    # prompt log-probabilities (SamplingParams.prompt_logprobs): the flat rows whose logits are reduced to
    # (the target's log-probability, the top `prompt_top`), their target tokens, and per request of the
    # batch the number of its rows, in batch order. None: no request asks
    prompt_rows: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    prompt_top: int = 0
    prompt_counts: list[int] | None = None
    # embeddings: the flat rows whose final hidden states are summed into each embedding request's vector,
    # the index (among `embed_reqs`) of each row's request, and those requests' batch indices
    embed_rows: torch.Tensor | None = None
    embed_seg: torch.Tensor | None = None
    embed_reqs: list[int] | None = None
    # a verify step (scheduler/speculative.py): a decode batch whose consecutive rows may share a request,
    # row i checking the proposal `drafts[i]` (-1: the request's last row, nothing to check); on the
    # device, (rows, positions, ids) that put the proposals into the token pool, where the next rows read
    # their input tokens
    drafts: list[int] | None = None
    draft_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the rows whose proposal was drawn from a draft distribution q, checked by speculative_sample
    # (engine/sampler.py): (rows [R] int64, their proposals [R] int64, their q [R, vocab] float32)
    draft_probs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.phase = Phase(self.phase)

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def is_prefill(self) -> bool:
        return self.phase is Phase.PREFILL

    @property
    def is_decode(self) -> bool:
        return self.phase is Phase.DECODE

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)
