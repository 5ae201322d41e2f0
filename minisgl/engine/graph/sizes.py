"""The sizes graphs are captured at: batch sizes for decode, token counts for prefill, and their defaults."""

from __future__ import annotations

DEFAULT_MAX_BS = 256  # on a GPU when --cuda-graph-max-bs is not given
DEFAULT_MAX_PREFILL = 8192  # tokens, on a GPU when --cuda-graph-max-prefill is not given
MAX_PREFILL_REQS = 64  # requests a captured prefill batch holds at most


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 128 and every 16 beyond, up to max_bs (always included): padding
    wastes at most 15 rows of a large batch, where the step time grows slowly with the batch size."""
    sizes = [1, 2, 4, 8] + list(range(16, 129, 8)) + list(range(144, max_bs + 1, 16))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


def prefill_sizes(max_tokens: int) -> list[int]:
    """Token counts captured for prefill: 16, 32, .., 1024, then every 1024 up to max_tokens (always
    included). Above 1024 tokens padding adds at most a third, where the step time is ~linear."""
    sizes = [16 << i for i in range(7)] + list(range(2048, max_tokens + 1, 1024))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})
