"""The offline API: `LLM(...).generate(prompts, sampling_params)`."""

from .llm import LLM
from .ranks import RankFailed

__all__ = ["LLM", "RankFailed"]
