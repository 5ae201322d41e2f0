"""Every message passed between the processes of the service, and their serialization.

API server --TokenizeMsg/AbortMsg/FlushCacheMsg--> tokenizer --UserMsg/AbortMsg/FlushCacheMsg--> scheduler
rank 0 (--BatchBackendMsg--> other ranks) --TokenBatch/StatsMsg--> detokenizer --ReplyBatch/StatsMsg--> API
server. On the per-token path each boundary carries one message per scheduler step, of columns (a list of
uids, a list of token ids, ...): no object per request per token is serialized.
"""

from minisgl.core import SamplingParams

from .backend import AbortMsg, BackendMsg, BatchBackendMsg, FlushCacheMsg, UserMsg
from .frontend import ReplyBatch, TokenLogprob, UserReply
from .serialize import dumps, loads, serializable
from .tokenizer import DetokenizeMsg, DetokenizeStartMsg, StatsMsg, TokenBatch, TokenizeMsg

serializable(SamplingParams)  # travels inside TokenizeMsg and UserMsg

__all__ = [
    "AbortMsg",
    "BackendMsg",
    "BatchBackendMsg",
    "DetokenizeMsg",
    "DetokenizeStartMsg",
    "FlushCacheMsg",
    "ReplyBatch",
    "StatsMsg",
    "TokenBatch",
    "TokenLogprob",
    "TokenizeMsg",
    "UserMsg",
    "UserReply",
    "dumps",
    "loads",
    "serializable",
]
