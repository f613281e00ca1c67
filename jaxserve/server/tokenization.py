"""vLLM's POST /tokenize and /detokenize: text or chat messages -> token ids, token ids -> text, with
the tokenizer and chat template the generation routes use. Bad input is a 400 that names it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxserve.server.errors import APIError
from jaxserve.server.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.server.requests import render_chat

if TYPE_CHECKING:
    from jaxserve.server.state import ServerState


def _tokenizer(state: ServerState, param: str) -> Any:
    tok = state.tokenizer
    if tok is None:
        raise APIError(
            400, "this model has no tokenizer, so it cannot tokenize or detokenize", param=param, code="no_tokenizer"
        )
    return tok


def tokenize(state: ServerState, body: TokenizeRequest) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens"[, "token_strs"]}: as /v1/completions (a prompt, with special
    tokens by default) or /v1/chat/completions (messages, rendered, without) would tokenize it."""
    chat = body.messages is not None
    tok = _tokenizer(state, "messages" if chat else "prompt")
    text = render_chat(state, body) if chat else body.prompt
    if not text:
        raise APIError(400, "the prompt is empty", param="prompt", code="empty_prompt")
    add_special = body.add_special_tokens if body.add_special_tokens is not None else not chat
    ids = [int(t) for t in tok.encode(text, add_special_tokens=add_special)]
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if body.return_token_strs:
        to_str = getattr(tok, "id_to_token", None)
        out["token_strs"] = [to_str(t) if to_str else tok.decode([t], skip_special_tokens=False) for t in ids]
    return out


def detokenize(state: ServerState, body: DetokenizeRequest) -> dict[str, str]:
    """{"prompt": the text of `tokens`}, special tokens kept (vLLM's)."""
    tok = _tokenizer(state, "tokens")
    if not body.tokens:
        raise APIError(400, "tokens is empty", param="tokens", code="empty_prompt")
    vocab = getattr(tok, "vocab_size", None) or len(tok)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400,
            f"token id(s) {bad[:5]} are outside the tokenizer's vocabulary [0, {vocab})",
            param="tokens",
            code="invalid_token_ids",
        )
    try:
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
    except (ValueError, IndexError, TypeError, OverflowError) as err:  # a tokenizer that refuses an id in range
        raise APIError(
            400, f"the tokenizer cannot decode these tokens: {err}", param="tokens", code="invalid_token_ids"
        ) from None
