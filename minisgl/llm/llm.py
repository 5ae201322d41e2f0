"""LLM: the offline interface, a thin driver of the Scheduler."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from minisgl.core import InvalidRequest, PromptLogprobs, SamplingParams
from minisgl.grammar import check_grammar
from minisgl.models import ModelConfig
from minisgl.models.resolve import resolve_model_path
from minisgl.scheduler import Scheduler, SchedulerConfig, StepOutput
from minisgl.utils import init_logger
from minisgl.utils.hf import load_hf_config, load_tokenizer
from minisgl.utils.net import free_port
from minisgl.utils.options import build

from .ranks import FollowerRanks, follow_rank0, rank_state

logger = init_logger(__name__)

Prompt = str | list[int]


def _load_tokenizer(model_dir: str) -> Any:
    has_tokenizer = any(
        os.path.exists(os.path.join(model_dir, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    return load_tokenizer(model_dir) if has_tokenizer else None


def _put_prompt_logprobs(out: dict[str, Any], lp: PromptLogprobs, params: SamplingParams) -> None:
    """A request's prompt log-probabilities in its output dict, one entry per prompt position."""
    out["prompt_logprobs"] = [None] * lp.start + lp.token
    out["prompt_logprob_ranks"] = [None] * lp.start + lp.rank
    if params.prompt_logprobs:
        pairs = [list(zip(ids, vals)) for ids, vals in zip(lp.top_ids, lp.top_logprobs)]
        out["prompt_top_logprobs"] = [None] * lp.start + pairs


class LLM:
    """Load a model once, then generate for batches of prompts (continuous batching inside)."""

    def __init__(self, model_path: str | None = None, **options: Any) -> None:
        """`options` are the fields of SchedulerConfig and EngineConfig, by name or alias (e.g.
        `max_running_req=8, num_page_override=2048, max_seq_len_override=512, dtype="float32"`); an unknown
        keyword is a TypeError naming it, a value out of range a ValueError naming the field."""
        given = options if model_path is None else {"model_path": model_path, **options}
        config = build(SchedulerConfig, given)
        self.ranks: FollowerRanks | None = None
        self.scheduler: Scheduler | None = None
        self.tokenizer = None
        self._uids = itertools.count()
        if config.tp_size > 1:
            config = self._start_ranks(config)
            if config.node_rank > 0:
                return
        try:
            self.scheduler = Scheduler(config)
        except BaseException:
            if self.ranks is None:
                raise
            try:
                with self.ranks.guard():  # a follower's failure is why rank 0 failed: name it
                    raise
            finally:
                self.ranks.shutdown(kill=True)
                self.ranks = None
        self.tokenizer = _load_tokenizer(self.scheduler.engine.model_dir)
        if self.tokenizer is not None:  # the tokenizer's EOS ends generation too (e.g. <|im_end|>)
            eos = self.tokenizer.eos_token_id
            if eos is not None:
                self.scheduler.eos_token_ids.add(int(eos))

    def _start_ranks(self, config: SchedulerConfig) -> SchedulerConfig:
        """TP > 1: check the split, pick the rendezvous, spawn this node's other ranks. On a node other
        than node 0, run this node's first rank here until rank 0 stops (then the LLM is closed)."""
        model_dir = resolve_model_path(config.model_path)
        ModelConfig.from_hf(load_hf_config(model_dir)).check_tp(
            config.tp_size, config.ep_size
        )  # before any process
        addr = config.dist_init_addr or f"127.0.0.1:{free_port()}"
        tokenizer = _load_tokenizer(model_dir)  # its EOS ends generation on every rank alike
        eos = [] if tokenizer is None or tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        config = replace(
            config,
            model_path=model_dir,
            dist_init_method=f"tcp://{addr}",
            extra_eos_token_ids=[*config.extra_eos_token_ids, *eos],
        )
        first = config.node_rank * (config.tp_size // config.nnodes)
        self.ranks = FollowerRanks(config, first_rank=first + 1)
        if first == 0:
            return config
        try:
            follow_rank0(config, first)
        finally:
            self.ranks.shutdown()
            self.ranks = None
        return config

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty", "prompt")
            if self.tokenizer is None:
                raise InvalidRequest(
                    "this model has no tokenizer: pass prompts as lists of token ids", "prompt"
                )
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise InvalidRequest("each prompt must be a string or a list of token ids", "prompt")
        return list(prompt)

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[dict[str, Any]]:
        """Generate for every prompt; returns one dict per prompt, in order: `text`, `token_ids` (the
        generated ids), `finish_reason`, `prompt_tokens`; with `logprobs=True` also `logprobs` (per token) and,
        with `top_logprobs=k`, `top_logprobs` (per token, k (id, logprob) pairs); `error` when a request
        ended with finish_reason "error". With `prompt_logprobs=k` also `prompt_logprobs` (per prompt
        position: None before `prompt_logprobs_start` and at position 0, else the log-probability of that
        prompt token given the ones before), `prompt_logprob_ranks` (its rank there, 1: the most likely)
        and, for k > 0, `prompt_top_logprobs` (k (id, logprob) pairs per position, None where the others
        are); `max_tokens=0` then generates nothing.

        A SamplingParams with `json_schema`, `regex`, `ebnf` or `structural_tag` constrains its output
        (minisgl/grammar/): it ends with "stop" once the constraint is complete.

        A bad request raises InvalidRequest (a ValueError) naming the field, with the service's rules and
        messages: a prompt plus `max_tokens` beyond the maximum sequence length is rejected, and
        `max_tokens=None` generates up to the context."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of strings or of token-id lists")  # noqa: TRY004 (the API's error type)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        encoded = [self._encode(p) for p in prompts]
        for ids, p in zip(encoded, params):  # reject bad input before anything is queued
            self.scheduler.validate(ids, p)
            self._check_grammar(p)
        uids = [next(self._uids) for _ in prompts]
        index = {uid: i for i, uid in enumerate(uids)}
        p_of = dict(zip(uids, params))
        outputs: list[dict[str, Any]] = [
            {"token_ids": [], "finish_reason": None, "prompt_tokens": len(ids)} for ids in encoded
        ]
        for uid, ids, p in zip(uids, encoded, params):
            self.add_request(uid, ids, p)
        remaining = len(uids)
        while remaining:
            for res in self.step():
                if res.uid not in index:
                    continue
                out = outputs[index[res.uid]]
                if res.token_id >= 0:  # -1: the request ended with no token (an error)
                    out["token_ids"].append(res.token_id)
                if res.logprob is not None:
                    out.setdefault("logprobs", []).append(res.logprob)
                if res.top_logprobs is not None:
                    out.setdefault("top_logprobs", []).append(res.top_logprobs)
                if res.error is not None:
                    out["error"] = res.error
                if res.embedding is not None:
                    out["embedding"] = res.embedding
                if res.prompt_logprobs is not None:
                    _put_prompt_logprobs(out, res.prompt_logprobs, p_of[res.uid])
                if res.finished:
                    out["finish_reason"] = str(res.finish_reason)  # the plain value, as before
                    remaining -= 1
        while self.scheduler.has_work:  # let the in-flight step (if any) land
            self.step()
        for out in outputs:
            out["text"] = self.decode(out["token_ids"])
        return outputs

    def embed(self, prompts: Sequence[Prompt]) -> list[list[float]]:
        """One embedding per prompt (text or token ids), in order: the prompt's final hidden states pooled
        (`pooling`: last token, mean or first token; auto: the model's sentence-transformers config, else
        last) and L2-normalised, batched through the scheduler like any request."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of strings or of token-id lists")  # noqa: TRY004
        outs = self.generate(prompts, SamplingParams(max_tokens=0, embed=True))
        return [out["embedding"] for out in outs]

    def _check_grammar(self, params: SamplingParams) -> None:
        if params.grammar is not None and self.tokenizer is None:
            kind = params.grammar[0]
            raise InvalidRequest(f"'{kind}' needs the model's tokenizer; this model has none", kind)
        check_grammar(params)

    # ---- the scheduler of every rank -------------------------------------------------------------
    def add_request(self, uid: int, input_ids: list[int], params: SamplingParams) -> None:
        """Queue a request on every rank (validated already); `step` runs it."""
        self._scheduler().add_request(uid, input_ids, params)
        if self.ranks is not None:
            self.ranks.add_request(uid, input_ids, params)

    def abort_request(self, uid: int) -> None:
        """Stop a request on every rank and free its KV."""
        self._scheduler().abort_request(uid)
        if self.ranks is not None:
            self.ranks.abort_request(uid)

    def step(self) -> list[StepOutput]:
        """One scheduling step on every rank (the others first get the requests added and aborted since)."""
        scheduler = self._scheduler()
        if self.ranks is None:
            return scheduler.step()
        self.ranks.before_step()
        with self.ranks.guard():
            return scheduler.step()

    def rank_states(self) -> list[dict[str, Any]]:
        """Per rank, in rank order: free, cached and total KV pages, the idle integrity check's error
        (None: clean) and the memory plan (bytes of weights, KV pool, graphs)."""
        scheduler = self._scheduler()
        if self.ranks is None:
            return [rank_state(scheduler)]
        return self.ranks.states(scheduler)

    def _scheduler(self) -> Scheduler:
        if self.scheduler is None:
            raise RuntimeError("this LLM is shut down (or ran a node's ranks other than rank 0)")
        return self.scheduler

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def stats(self) -> dict[str, float]:
        """Prefix-cache and scheduling counters since the LLM was created."""
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Stop the other ranks (joining their processes), then free the model, the KV pool and every
        device buffer."""
        if getattr(self, "ranks", None) is not None:
            self.ranks.shutdown()
            self.ranks = None
        if getattr(self, "scheduler", None) is not None:
            self.scheduler.shutdown()
            self.scheduler = None
