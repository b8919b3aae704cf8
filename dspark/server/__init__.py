"""OpenAI-compatible HTTP server: ``dspark serve`` (see docs/server.md)."""

from dspark.server.app import build_app
from dspark.server.engine_client import EngineClient

__all__ = ["build_app", "EngineClient"]
