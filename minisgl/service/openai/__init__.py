"""The OpenAI-compatible HTTP API (FastAPI + uvicorn), in the launcher's main process, split by concern:
request bodies (protocol), their translation to SamplingParams (params), reply routing by uid (routing),
one renderer per endpoint kind (render), metrics, errors and the routes."""

from .routes import create_app

__all__ = ["create_app"]
