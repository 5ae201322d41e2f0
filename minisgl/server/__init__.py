"""The service: command-line arguments, the launcher and the OpenAI-compatible API server.

Only `python -m minisgl` imports this package (it needs pyzmq, fastapi and uvicorn); the offline path never does.
"""

from .args import ServerArgs, parse_args

__all__ = ["ServerArgs", "parse_args"]
