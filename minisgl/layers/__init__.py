"""The building blocks of the models; every weight-holding layer has `load_shard` for its TP slice."""

from .activation import SiluAndMul
from .attention import AttentionLayer
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .norm import RMSNorm
from .rotary import RotaryEmbedding

__all__ = [
    "AttentionLayer",
    "ColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
]
