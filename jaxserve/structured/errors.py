"""GrammarError: a structured-output request the grammar library cannot serve (bad schema, regex or grammar)."""

from __future__ import annotations

from jaxserve.errors import RequestError

__all__ = ["GrammarError"]


class GrammarError(RequestError):
    """A JSON schema, regex, choice list or grammar is invalid or uses a feature the library lacks.

    The message names the kind and the problem (e.g. "regex '(a)\\1': backreferences are not
    supported"), so the server can return it as a 400 as it is.
    """
