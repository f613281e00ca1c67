"""jaxserve's OpenAI-compatible HTTP server: `create_app(options, engine)`; run it with `python -m jaxserve.serve`."""

from jaxserve.server.api import APIError, ServerOptions, ServerState, create_app

__all__ = ["APIError", "ServerOptions", "ServerState", "create_app"]
