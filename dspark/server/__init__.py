"""OpenAI-compatible HTTP server: ``dspark serve`` (see docs/server.md).

``dspark.server.app.build_app`` builds the FastAPI app around an engine client: ``dspark serve`` uses
``dspark.server.engine_process.ProcessEngineClient`` (the engine in its own process), embedding code with an
engine object ``dspark.server.engine_client.EngineClient`` (the engine on a thread);
``dspark.server.cli`` holds the ``serve`` subcommand. Nothing heavy is imported here, so that the main CLI
can register ``serve`` without loading FastAPI.
"""
