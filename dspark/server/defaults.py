"""Server defaults shared by the CLI and the app (kept import-light: the CLI imports this at start-up)."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
