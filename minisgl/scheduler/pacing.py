"""How many prompt tokens a CPU prefill step may take while other requests decode.

On a CPU a prefill step runs for as long as its tokens take, and every running stream waits for it. So
while requests decode, a prompt comes in chunks sized to take about `target` seconds each: the pace of
the last such steps (seconds per unit of work, measured) says how many tokens fit. A chunk's work grows
with the prefix its tokens attend to: a token costs one pass over the weights plus its attention over
`prefix` earlier tokens, and `attn_ratio` context tokens of attention cost as much as the weights
(the weights' multiply-adds per token over the attention's per context token). Measuring the pace, not
assuming it, keeps the chunks near `target` on a machine that other work slows down."""

from __future__ import annotations

from minisgl.models import ModelConfig

TARGET_S = 0.4  # one prefill step's time while others decode
FIRST_TOKENS = 256  # the first chunk, before any pace was measured
MIN_TOKENS, MAX_TOKENS = 32, 2048
SMOOTHING = 0.5  # weight of the newest measurement in the pace
# a context token's attention costs this many times its multiply-adds' share of a weight pass: a prefill
# step's attention (over a paged prefix, per request) runs far below the GEMMs' rate on a CPU; measured on
# the stall benchmark, where a 6,400-token prompt's last chunks overran the target 3x with 1
ATTENTION_SLOWDOWN = 4.0


def attention_ratio(m: ModelConfig) -> float:
    """Context tokens whose attention costs as much as one token's pass over the weights."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    inter = m.intermediate_size if m.moe is None else m.moe.intermediate_size * m.moe.top_k
    weights = m.num_layers * (m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * inter)
    per_context_token = m.num_layers * 2 * q  # q.k and p.v for every head
    return max(1.0, weights / (per_context_token * ATTENTION_SLOWDOWN))


class PrefillPacer:
    """The token budget of the next prefill step while others decode, from the pace of the last ones."""

    def __init__(self, attn_ratio: float, target: float = TARGET_S) -> None:
        self.attn_ratio, self.target = attn_ratio, target
        self.seconds_per_unit: float | None = None

    def work(self, tokens: int, prefix: int) -> float:
        """A chunk's work in units of one token's pass over the weights."""
        return tokens * (1.0 + (prefix + tokens / 2) / self.attn_ratio)

    def budget(self, prefix: int) -> int:
        """The tokens of the next chunk, whose first token follows `prefix` cached ones."""
        if self.seconds_per_unit is None:
            return FIRST_TOKENS
        units = self.target / self.seconds_per_unit
        n = units / (1.0 + prefix / self.attn_ratio)
        for _ in range(3):  # the chunk's own tokens attend to each other too
            n = units / (1.0 + (prefix + n / 2) / self.attn_ratio)
        return int(min(MAX_TOKENS, max(MIN_TOKENS, n)))

    def measured(self, seconds: float, chunks: list[tuple[int, int]]) -> None:
        """A prefill step of these (tokens, prefix) chunks took `seconds`."""
        units = sum(self.work(n, p) for n, p in chunks)
        if units <= 0:
            return
        pace = seconds / units
        old = self.seconds_per_unit
        self.seconds_per_unit = pace if old is None else SMOOTHING * pace + (1 - SMOOTHING) * old
