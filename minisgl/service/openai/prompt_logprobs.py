"""The prompt's log-probabilities (minisgl.core.PromptLogprobs, computed by the engine) in each endpoint's
shape: OpenAI completions' `echo` (the prompt's tokens first in `logprobs`, the first one's entries null),
vLLM's `prompt_logprobs` (per position a dict of the prompt token and the top k, with ranks) and SGLang's
`meta_info.input_token_logprobs` / `input_top_logprobs` ([logprob, id, text] triples).

Token texts come from the API server's own tokenizer (`piece`: a token decoded alone, as the detokenizer
shows a generated token), so the scheduler sends only numbers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minisgl.core import PromptLogprobs

Piece = Callable[[int], str]


def _at(lp: PromptLogprobs, p: int) -> int | None:
    """The index in `lp`'s lists of prompt position p (None: no entry there)."""
    i = p - lp.start
    return i if 0 <= i < len(lp.token) else None


def completion_prompt(
    ids: list[int], lp: PromptLogprobs | None, piece: Piece, top_k: int
) -> dict[str, list[Any]]:
    """OpenAI completions' parallel lists for the prompt: every token's text, its log-probability (null
    where there is none: the first token) and the `top_k` most likely there (a dict text -> log-probability)."""
    tokens = [piece(t) for t in ids]
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    for p in range(len(ids)):
        i = _at(lp, p) if lp is not None else None
        if i is None or lp is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(lp.token[i])
        top.append({piece(t): v for t, v in zip(lp.top_ids[i][:top_k], lp.top_logprobs[i][:top_k])})
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def vllm_prompt(ids: list[int], lp: PromptLogprobs, piece: Piece) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (none there) or {token id: {logprob, rank,
    decoded_token}} for the prompt token and the top k (ids as JSON keys: strings)."""
    out: list[dict[str, Any] | None] = []
    for p, token in enumerate(ids):
        i = _at(lp, p)
        if i is None:
            out.append(None)
            continue
        entry = {
            str(t): {"logprob": v, "rank": r + 1, "decoded_token": piece(t)}
            for r, (t, v) in enumerate(zip(lp.top_ids[i], lp.top_logprobs[i]))
        }
        entry[str(token)] = {"logprob": lp.token[i], "rank": lp.rank[i], "decoded_token": piece(token)}
        out.append(entry)
    return out


def sglang_input(
    ids: list[int], lp: PromptLogprobs, start: int, piece: Piece | None
) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """SGLang's `input_token_logprobs` ([logprob, id, text] from prompt position `start`, logprob null at
    position 0) and `input_top_logprobs` (per position the top k as such triples; None at position 0).
    `piece` None: text null (SGLang without `return_text_in_logprobs`)."""

    def text(t: int) -> str | None:
        return piece(t) if piece is not None else None

    tokens: list[list[Any]] = []
    top: list[list[list[Any]] | None] = []
    for p in range(start, len(ids)):
        i = _at(lp, p)
        tokens.append([lp.token[i] if i is not None else None, ids[p], text(ids[p])])
        if i is None:
            top.append(None)
        else:
            top.append([[v, t, text(t)] for t, v in zip(lp.top_ids[i], lp.top_logprobs[i])])
    return tokens, top
