"""The requests the online and offline benchmarks share: W4's prompts and the schema of the constrained
requests."""

from __future__ import annotations

# --constrained-fraction's schema: a small object of typed fields, as an application would ask for
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
}


TOPICS = [
    "a dragon",
    "the sea",
    "a lost robot",
    "a small village",
    "the moon",
    "a detective",
    "a forest",
    "a time traveller",
    "a lighthouse keeper",
    "a chess player",
    "a mountain",
    "a city at night",
    "a music box",
    "a pirate ship",
    "a desert",
    "a secret garden",
]


def w4_prompts(n: int) -> list[str]:
    """The W4 prompts: topic i % 16, numbered i."""
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}, number {i}." for i in range(n)]
