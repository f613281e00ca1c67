"""jaxserve's OpenAI-compatible HTTP server: `create_app(options, engine)`; run it with `python -m jaxserve.serve`."""

__all__ = ["APIError", "ServerOptions", "ServerState", "create_app"]


def __getattr__(name: str):
    # Lazily, so that `jaxserve.server.chat` (which LLM.chat uses) imports without FastAPI and the app.
    if name in __all__:
        from jaxserve.server import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
