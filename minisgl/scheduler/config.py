"""SchedulerConfig: the engine's config plus the scheduling policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.engine.config import EngineConfig


@dataclass
class SchedulerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache_type: str = "radix"  # naive | radix
    max_prefill_length: int = 8192  # token budget of one prefill step (the chunk size)
    overlap: bool | None = None  # None: on unless MINISGL_DISABLE_OVERLAP_SCHEDULING=1
    # Fraction of each request's possible decode tokens reserved at admission. 1.0 never retracts;
    # lower admits more requests and relies on retraction when decode runs out of pages.
    reserve_ratio: float = 1.0
    extra_eos_token_ids: list[int] = field(default_factory=list)
