"""The results of a step: each sampled row's token given to its request, whether that ends the request,
and the `StepOutput` that reports it (log-probabilities, the prompt's log-probabilities, an embedding)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minisgl.core import Batch, FinishReason, PromptLogprobs, Req
from minisgl.engine import ForwardOutput
from minisgl.utils import init_logger

logger = init_logger(__name__)


@dataclass
class StepOutput:
    uid: int
    token_id: int
    finished: bool
    finish_reason: FinishReason | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    cached_tokens: int = 0  # the request's prompt tokens found in the prefix cache (Req.cached_prompt_len)
    error: str | None = None  # why a request ended with FinishReason.ERROR (token_id -1: no token)
    error_param: str | None = None  # the field at fault, when the client's (InvalidRequest.param)
    prompt_logprobs: PromptLogprobs | None = None  # with the first token (SamplingParams.prompt_logprobs)
    embedding: list[float] | None = None  # an embedding request's pooled, L2-normalised vector

    def extras(self) -> dict[str, Any] | None:
        """The once-per-request payloads as plain data (the messages carry them): `prompt_logprobs` (a
        PromptLogprobs' fields) and `embedding`."""
        out: dict[str, Any] = {}
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = dataclasses.asdict(self.prompt_logprobs)
        if self.embedding is not None:
            out["embedding"] = self.embedding
        return out or None


class OutputProcessor:
    """Turns a computed step into StepOutputs; a request that finishes is handed to `end` (which frees its
    slot, pages and matcher)."""

    def __init__(self, eos_token_ids: set[int], pooling: str, end: Callable[[Req], None]) -> None:
        self.eos_token_ids = eos_token_ids  # the scheduler's set: the LLM adds the tokenizer's later
        self.pooling = pooling
        self._end = end

    def process(self, batch: Batch, tokens: list[int], out: ForwardOutput) -> list[StepOutput]:
        """A prefill or decode step's outputs, `tokens` its sampled rows' tokens on the host."""
        logprobs = out.logprobs_host
        if batch.prompt_counts is not None:
            self._collect_prompt_logprobs(batch, out.prompt_logprobs_host)
        for k, i in enumerate(batch.embed_reqs or []):
            req = batch.reqs[i]
            part = out.embed_host[k]
            req.embedding = part if req.embedding is None else req.embedding + part
        results: list[StepOutput] = []
        j = -1
        for req, sampled in zip(batch.reqs, batch.sample_mask):
            if not sampled:
                continue
            j += 1
            if req.finished:  # finished or aborted after this step was launched: discard
                continue
            results.append(self.emit(req, tokens[j], j, logprobs))
        return results

    def emit(self, req: Req, token: int, j: int, logprobs: tuple | None) -> StepOutput:
        """Give req its sampled `token` (row j of the step's logprobs); end it if that finishes it."""
        if req.sampling_params.max_tokens == 0:  # an embedding, or only the prompt's log-probabilities
            token, finish, error = -1, FinishReason.LENGTH, None
        else:
            req.token_ids.append(token)
            finish, error = self._grammar_finish(req, token) if req.grammar is not None else (None, None)
            finish = finish or self._finish_reason(req, token)
        res = StepOutput(req.uid, token, finish is not None, finish, cached_tokens=req.cached_prompt_len)
        res.error = error
        if req.prompt_logprobs is not None and len(req.token_ids) <= req.prompt_len + 1:
            res.prompt_logprobs = req.prompt_logprobs  # with the request's first output
        if req.sampling_params.embed and req.embedding is not None:
            res.embedding = self._pooled(req)
        if logprobs is not None and req.sampling_params.logprobs:
            res.logprob = float(logprobs[0][j])
            k = req.sampling_params.top_logprobs
            if k and logprobs[1] is not None:
                res.top_logprobs = list(zip(logprobs[2][j, :k].tolist(), logprobs[1][j, :k].tolist()))
        if finish is not None:
            req.finished, req.finish_reason = True, finish
            self._end(req)
        return res

    def _pooled(self, req: Req) -> list[float]:
        """An embedding request's vector: its pooled sum (a mean divides by the prompt's length),
        L2-normalised."""
        assert req.embedding is not None
        v = req.embedding / req.prompt_len if self.pooling == "mean" else req.embedding
        return (v / v.norm().clamp_min(1e-12)).tolist()

    def _collect_prompt_logprobs(self, batch: Batch, host: tuple) -> None:
        """Give each request its rows of the step's prompt log-probabilities."""
        token, rank, top_vals, top_ids = host
        start = 0
        for req, n in zip(batch.reqs, batch.prompt_counts or []):
            if n and not req.finished and req.prompt_logprobs is not None:
                k = req.sampling_params.prompt_logprobs or 0
                vals = top_vals[start : start + n, :k] if k else None
                ids = top_ids[start : start + n, :k] if k else None
                req.prompt_logprobs.extend(token[start : start + n], rank[start : start + n], vals, ids)
            start += n

    def _grammar_finish(self, req: Req, token: int) -> tuple[FinishReason | None, str | None]:
        """Advance the request's matcher: STOP once its grammar is complete (and ended by a stop token)."""
        if not req.grammar.accept_token(token):  # the mask allowed only what the matcher accepts
            logger.error(f"request {req.uid}: token {token} was sampled outside its grammar")
            return FinishReason.ERROR, f"token {token} was sampled outside the request's grammar"
        return (FinishReason.STOP, None) if req.grammar.is_terminated() else (None, None)

    def _finish_reason(self, req: Req, token: int) -> FinishReason | None:
        params = req.sampling_params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if len(req.token_ids) >= req.max_total_len:
            return FinishReason.LENGTH
        return None
