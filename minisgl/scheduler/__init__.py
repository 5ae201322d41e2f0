"""The scheduler: continuous batching, prefix cache, chunked prefill, overlap scheduling, retraction."""

from .config import SchedulerConfig
from .scheduler import Scheduler, StepOutput

__all__ = ["Scheduler", "SchedulerConfig", "StepOutput"]
