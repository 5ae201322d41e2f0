"""Messages to the scheduler (rank 0 receives them and forwards them verbatim to the other ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisgl.core import SamplingParams

from .serialize import serializable


@serializable
@dataclass
class UserMsg:
    """A tokenized request. `sampling_params.max_tokens=None` runs up to the context. With `max_tokens_auto`
    (the shell) max_tokens is only a ceiling: when prompt + max_tokens exceed the context, the request runs
    up to the context instead of being rejected."""

    uid: int
    input_ids: torch.Tensor  # [prompt_len] int32
    sampling_params: SamplingParams
    max_tokens_auto: bool = False


@serializable
@dataclass
class AbortMsg:
    """Stop a request and free its slot and KV (a client went away, or a stop string was hit)."""

    uid: int


@serializable
@dataclass
class FlushCacheMsg:
    """Empty the prefix cache (SGLang's /flush_cache); done only while no request runs or waits."""

    reason: str = "flush_cache"


BackendMsg = UserMsg | AbortMsg | FlushCacheMsg


@serializable
@dataclass
class BatchBackendMsg:
    """Everything rank 0 received in one loop iteration; the other ranks apply exactly this list."""

    msgs: list[BackendMsg] = field(default_factory=list)
    stop: bool = False  # rank 0 is stopping: the other ranks stop too (ranks on other nodes learn it here)
