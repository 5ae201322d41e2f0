"""Low-level helpers shared by every module: logging, registry, device abstraction, HF helpers."""

from .logger import init_logger
from .registry import Registry

__all__ = ["Registry", "init_logger"]
