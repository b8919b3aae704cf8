"""OpenAI-compatible HTTP server: ``dspark serve`` (see docs/server.md).

``dspark.server.app.build_app`` builds the FastAPI app around a ``dspark.server.engine_client.EngineClient``;
``dspark.server.cli`` holds the ``serve`` subcommand. Nothing heavy is imported here, so that the main CLI
can register ``serve`` without loading FastAPI.
"""
