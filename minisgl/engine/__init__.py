"""The Engine (model, KV pool, attention backend, sampler) and the CUDA-graph runners (decode, prefill)."""

from .config import EngineConfig
from .engine import Engine, ForwardOutput, Logits
from .graph import DECODE_INPUTS
from .sampler import Sampler, SamplingInfo

__all__ = ["DECODE_INPUTS", "Engine", "EngineConfig", "ForwardOutput", "Logits", "Sampler", "SamplingInfo"]
