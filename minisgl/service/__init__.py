"""The service: everything only `python -m minisgl` needs (CLI, launcher, ZMQ queues, the scheduler's and
the tokenizer's process loops, the shell and the OpenAI-compatible API).

It is the top of the dependency stack and needs pyzmq, fastapi and uvicorn; the offline path never imports it.
"""

from .args import ServerArgs, parse_args

__all__ = ["ServerArgs", "parse_args"]
