"""Test helpers shipped with jaxserve: for tests and HTTP fuzzing, not for serving.

`jaxserve.testing.mock_engine` is a deterministic stand-in for the engine (no model, no compiling), which
`python -m jaxserve.serve --mock-engine` and the server tests put behind the HTTP layer.
"""
