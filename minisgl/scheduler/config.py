"""SchedulerConfig: the engine's options plus the scheduling policy (one flat set of fields, one name each)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.engine.config import EngineConfig
from minisgl.grammar import DEFAULT_CACHE_MB, DEFAULT_COMPILE_TIMEOUT
from minisgl.kvcache import PREFIX_CACHES
from minisgl.utils.options import OptionError, option

from .proposers import PROPOSERS

MAX_SPECULATIVE_TOKENS = 16  # rows a verify step gives one request beyond its own


def _on_off(text: str) -> bool:
    return text == "on"


@dataclass
class SchedulerConfig(EngineConfig):
    """What the Scheduler needs: the engine's options (inherited) and its own."""

    cache_type: str = option("radix", help="prefix cache", choices=PREFIX_CACHES.names(), aliases=["cache"])
    overlap: bool | None = option(
        None,
        help="overlap scheduling (default: on with a GPU unless MINISGL_DISABLE_OVERLAP_SCHEDULING=1, off on a CPU)",
        choices=["on", "off"],
        parse=_on_off,
    )
    # 1.0 never retracts; lower admits more requests and relies on retraction when decode runs out of pages
    reserve_ratio: float = option(
        1.0, help="fraction of each request's possible decode tokens reserved at admission"
    )
    grammar_compile_timeout: float = option(
        DEFAULT_COMPILE_TIMEOUT,
        help="seconds of CPU time one request's constraint (JSON schema, regex, grammar, forced tool call) "
        "may take to compile, and 3x that in wall time; longer is a 400 naming its field",
        min=0.1,
    )
    grammar_cache_mb: int = option(
        DEFAULT_CACHE_MB,
        help="MiB of compiled constraints kept for reuse; one that alone needs more is a 400 naming its field",
        min=1,
    )
    speculative: str | None = option(
        None,
        help="speculative decoding: ngram proposes the tokens that followed the latest n-gram earlier in "
        "the prompt or output, draft the greedy tokens of a small model (--speculative-draft-model); the "
        "model verifies them in one step (greedy and sampled output unchanged)",
        choices=PROPOSERS.names(),
    )
    speculative_draft_model: str | None = option(
        None,
        help="the draft model of --speculative draft: a Hugging Face directory or hub id with the "
        "model's tokenizer (vocabulary), run on the same device with its own KV pool",
        metavar="PATH",
    )
    num_speculative_tokens: int = option(
        4, help="most tokens proposed for one request a step, at most 16 (adapts per request below it)", min=1
    )
    speculative_ngram_min: int = option(1, help="shortest n-gram the ngram proposer matches", min=1)
    speculative_ngram_max: int = option(4, help="longest n-gram the ngram proposer matches", min=1)
    speculative_max_batch: int = option(
        8,
        help="speculate only while at most this many requests decode (larger batches are compute-bound: "
        "verifying proposals would cost more than it saves)",
        min=1,
    )
    extra_eos_token_ids: list[int] = field(default_factory=list)  # the launcher adds the tokenizer's EOS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise OptionError(
                "num_speculative_tokens",
                f"must be <= {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}",
            )
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise OptionError(
                "speculative_ngram_min",
                f"must be <= --speculative-ngram-max {self.speculative_ngram_max}, "
                f"got {self.speculative_ngram_min}",
            )
        if (self.speculative == "draft") != (self.speculative_draft_model is not None):
            raise OptionError(
                "speculative_draft_model", "is given exactly when --speculative is draft (the draft's path)"
            )
        if self.speculative == "draft" and self.tp_size > 1:
            raise OptionError("speculative", "draft runs with one rank (--tp-size 1)")
