"""LLM: the offline interface, a thin driver of the Scheduler."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

from minisgl.core import InvalidRequest, SamplingParams
from minisgl.scheduler import Scheduler, SchedulerConfig
from minisgl.utils import init_logger
from minisgl.utils.hf import load_tokenizer
from minisgl.utils.options import build

logger = init_logger(__name__)

Prompt = str | list[int]


class LLM:
    """Load a model once, then generate for batches of prompts (continuous batching inside)."""

    def __init__(self, model_path: str | None = None, **options: Any) -> None:
        """`options` are the fields of SchedulerConfig and EngineConfig, by name or alias (e.g.
        `max_running_req=8, num_page_override=2048, max_seq_len_override=512, dtype="float32"`); an unknown
        keyword is a TypeError naming it, a value out of range a ValueError naming the field."""
        given = options if model_path is None else {"model_path": model_path, **options}
        self.scheduler = Scheduler(build(SchedulerConfig, given))
        model_dir = self.scheduler.engine.model_dir
        has_tokenizer = any(
            os.path.exists(os.path.join(model_dir, f))
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )
        self.tokenizer = load_tokenizer(model_dir) if has_tokenizer else None
        if self.tokenizer is not None:  # the tokenizer's EOS ends generation too (e.g. <|im_end|>)
            eos = self.tokenizer.eos_token_id
            if eos is not None:
                self.scheduler.eos_token_ids.add(int(eos))
        self._uids = itertools.count()

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
        with `top_logprobs=k`, `top_logprobs` (per token, k (id, logprob) pairs).

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
        uids = [next(self._uids) for _ in prompts]
        index = {uid: i for i, uid in enumerate(uids)}
        outputs: list[dict[str, Any]] = [
            {"token_ids": [], "finish_reason": None, "prompt_tokens": len(ids)} for ids in encoded
        ]
        for uid, ids, p in zip(uids, encoded, params):
            self.scheduler.add_request(uid, ids, p)
        remaining = len(uids)
        while remaining:
            for res in self.scheduler.step():
                if res.uid not in index:
                    continue
                out = outputs[index[res.uid]]
                out["token_ids"].append(res.token_id)
                if res.logprob is not None:
                    out.setdefault("logprobs", []).append(res.logprob)
                if res.top_logprobs is not None:
                    out.setdefault("top_logprobs", []).append(res.top_logprobs)
                if res.finished:
                    out["finish_reason"] = str(res.finish_reason)  # the plain value, as before
                    remaining -= 1
        while self.scheduler.has_work:  # let the in-flight step (if any) land
            self.scheduler.step()
        for out in outputs:
            out["text"] = self.decode(out["token_ids"])
        return outputs

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def stats(self) -> dict[str, float]:
        """Prefix-cache and scheduling counters since the LLM was created."""
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Free the model, the KV pool and every device buffer."""
        if getattr(self, "scheduler", None) is not None:
            self.scheduler.shutdown()
            self.scheduler = None
