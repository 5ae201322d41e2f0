"""SchedulerConfig: the engine's options plus the scheduling policy (one flat set of fields, one name each)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.engine.config import EngineConfig
from minisgl.grammar import DEFAULT_CACHE_MB, DEFAULT_COMPILE_TIMEOUT
from minisgl.kvcache import PREFIX_CACHES
from minisgl.utils.options import option


def _on_off(text: str) -> bool:
    return text == "on"


@dataclass
class SchedulerConfig(EngineConfig):
    """What the Scheduler needs: the engine's options (inherited) and its own."""

    cache_type: str = option("radix", help="prefix cache", choices=PREFIX_CACHES.names(), aliases=["cache"])
    overlap: bool | None = option(
        None,
        help="overlap scheduling (default: on unless MINISGL_DISABLE_OVERLAP_SCHEDULING=1)",
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
    extra_eos_token_ids: list[int] = field(default_factory=list)  # the launcher adds the tokenizer's EOS
