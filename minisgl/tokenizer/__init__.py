"""Tokenization and incremental detokenization (chat template, stop strings, UTF-8 boundaries).

The worker process that drives these over ZMQ is the service's: `minisgl/service/tokenizer_worker.py`.
"""

from .detokenize import DetokenizeManager
from .tokenize import TokenizeManager, chat_text

__all__ = ["DetokenizeManager", "TokenizeManager", "chat_text"]
