"""The Engine (model, KV pool, attention backend, sampler) and the CUDA-graph runner."""

from .config import EngineConfig
from .engine import Engine, ForwardOutput
from .sampler import Sampler, SamplingInfo

__all__ = ["Engine", "EngineConfig", "ForwardOutput", "Sampler", "SamplingInfo"]
