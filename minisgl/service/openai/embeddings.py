"""POST /v1/embeddings: one embedding per input (a string, token ids, or a list of either), computed by the
scheduler beside generation (SamplingParams.embed: the prompt's final hidden states pooled by --pooling and
L2-normalised); `dimensions` keeps the first d values and normalises them again (Matryoshka-style, as vLLM);
`encoding_format` float or base64 (little-endian float32, as OpenAI's)."""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass
from typing import Any

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg

from .errors import APIError
from .params import Limits, prompts
from .protocol import Int64, _Body
from .render import Renderer
from .routing import ChoiceState, Generation


class EmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    model: str | None = None
    input: str | list[Int64] | list[str] | list[list[Int64]]
    encoding_format: str = "float"
    dimensions: Int64 | None = None


def embedding_msgs(req: EmbeddingRequest, limits: Limits, hidden_size: int) -> list[TokenizeMsg]:
    """One TokenizeMsg per input (HTTP 400 naming the bad field)."""
    if req.encoding_format not in ("float", "base64"):
        raise APIError(
            f"'encoding_format' must be float or base64, got {req.encoding_format!r}",
            "encoding_format",
            "invalid_value",
        )
    if req.dimensions is not None and not 1 <= req.dimensions <= hidden_size:
        raise APIError(
            f"'dimensions' must be in [1, {hidden_size}] (the model's embeddings have {hidden_size}), "
            f"got {req.dimensions}",
            "dimensions",
            "invalid_value",
        )
    params = SamplingParams(max_tokens=0, embed=True)
    return [
        TokenizeMsg(-1, params, text=text, input_ids=ids) for text, ids in prompts(req.input, "input", limits)
    ]


def shaped(vector: list[float], dimensions: int | None, encoding: str) -> list[float] | str:
    """The vector as the request asks: its first `dimensions` values normalised again, as floats or as
    base64 of little-endian float32."""
    if dimensions is not None and dimensions < len(vector):
        vector = vector[:dimensions]
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        vector = [v / norm for v in vector]
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


@dataclass
class EmbeddingRenderer(Renderer):
    """The `list` of `embedding` objects, in input order, with the prompt tokens as usage."""

    dimensions: int | None = None
    encoding: str = "float"

    def stream_delta(self, c: ChoiceState, reply: Any, offset: int) -> bytes | None:
        raise AssertionError("embeddings are not streamed")

    def full(self, gen: Generation) -> Any:
        data = [
            {
                "object": "embedding",
                "index": c.index,
                "embedding": shaped(_vector(c), self.dimensions, self.encoding),
            }
            for c in gen.choices
        ]
        tokens = sum(c.prompt_tokens for c in gen.choices)
        return {
            "object": "list",
            "data": data,
            "model": self.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _vector(c: ChoiceState) -> list[float]:
    assert c.embedding is not None, "an embedding request's reply carries its vector"
    return c.embedding
