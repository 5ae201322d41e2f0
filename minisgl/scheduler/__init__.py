"""The scheduler: continuous batching, prefix cache, chunked prefill, overlap scheduling, retraction."""

from .config import SchedulerConfig
from .output import StepOutput
from .scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerConfig", "StepOutput"]
