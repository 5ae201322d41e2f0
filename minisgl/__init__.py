"""minisgl: a compact, fast LLM inference engine."""

__version__ = "0.1.0"
