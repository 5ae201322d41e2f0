"""Every message passed between the processes of the service, and their serialization.

API server --TokenizeMsg/AbortMsg/FlushCacheMsg--> tokenizer --UserMsg/AbortMsg/FlushCacheMsg--> scheduler
rank 0 (--BatchBackendMsg--> other ranks) --BatchDetokenizeMsg/StatsMsg--> detokenizer
--BatchFrontendMsg/StatsMsg--> API server.
"""

from minisgl.core import SamplingParams

from .backend import AbortMsg, BackendMsg, BatchBackendMsg, FlushCacheMsg, UserMsg
from .frontend import BatchFrontendMsg, TokenLogprob, UserReply
from .serialize import dumps, loads, serializable
from .tokenizer import BatchDetokenizeMsg, DetokenizeMsg, DetokenizeStartMsg, StatsMsg, TokenizeMsg

serializable(SamplingParams)  # travels inside TokenizeMsg and UserMsg

__all__ = [
    "AbortMsg",
    "BackendMsg",
    "BatchBackendMsg",
    "BatchDetokenizeMsg",
    "BatchFrontendMsg",
    "DetokenizeMsg",
    "DetokenizeStartMsg",
    "FlushCacheMsg",
    "StatsMsg",
    "TokenLogprob",
    "TokenizeMsg",
    "UserMsg",
    "UserReply",
    "dumps",
    "loads",
    "serializable",
]
