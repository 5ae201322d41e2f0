"""A request's way in: the rules it must pass (`validate_request`, one set for the offline path and the
service) and the `Req` made from it (`new_req`)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.core import InvalidRequest, Req, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What the engine can hold: the longest sequence, the vocabulary, the KV pool's tokens."""

    max_seq_len: int
    vocab_size: int
    pool_tokens: int


def validate_request(input_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raise InvalidRequest naming the field (`prompt`, `max_tokens`, ...) of a request that cannot run."""
    params.validate()
    n, max_len, vocab = len(input_ids), limits.max_seq_len, limits.vocab_size
    if n == 0:
        raise InvalidRequest("the prompt is empty", "prompt")
    if n >= max_len:
        raise InvalidRequest(
            f"the prompt has {n} tokens; the maximum sequence length is {max_len} "
            "(prompt + at least one generated token)",
            "prompt",
        )
    if min(input_ids) < 0 or max(input_ids) >= vocab:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise InvalidRequest(f"'logit_bias' token ids must be in [0, {vocab})", "logit_bias")
    if n >= limits.pool_tokens:
        raise InvalidRequest(
            f"the prompt has {n} tokens but the KV pool holds only {limits.pool_tokens}", "prompt"
        )
    if params.prompt_logprobs is not None and params.prompt_logprobs_start >= n:
        raise InvalidRequest(
            f"'prompt_logprobs_start' is {params.prompt_logprobs_start}; the prompt has {n} tokens",
            "prompt_logprobs_start",
        )
    if params.max_tokens is not None and n + params.max_tokens > max_len:
        raise InvalidRequest(
            f"the prompt has {n} tokens and 'max_tokens' is {params.max_tokens}: together more than "
            f"the maximum sequence length {max_len}; lower 'max_tokens' or shorten the prompt "
            "(with no 'max_tokens' the output runs up to the context)",
            "max_tokens",
        )


def new_req(
    uid: int, input_ids: list[int], params: SamplingParams, limits: RequestLimits, pooling: str
) -> Req:
    """The Req of a validated request; `params.max_tokens=None` runs up to the context."""
    req = Req(uid=uid, token_ids=input_ids, sampling_params=params)
    max_tokens = limits.max_seq_len if params.max_tokens is None else params.max_tokens
    # a request alone must always fit in the pool, or retraction could not make progress
    req.max_total_len = min(len(input_ids) + max_tokens, limits.max_seq_len, limits.pool_tokens)
    if params.embed and pooling != "last":
        req.embed_from = 0  # every position is pooled (mean), or the first (cls): none from the cache
    return req
