"""The tokenizer / detokenizer worker: chat template, tokenization, incremental detokenization."""

from .detokenize import DetokenizeManager
from .server import TokenizerWorker, tokenize_worker
from .tokenize import TokenizeManager

__all__ = ["DetokenizeManager", "TokenizeManager", "TokenizerWorker", "tokenize_worker"]
