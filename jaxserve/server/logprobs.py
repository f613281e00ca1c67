"""Logprobs in OpenAI's shapes: completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`),
chat (`content`: one object per token with its bytes and top alternatives), and vLLM's `prompt_logprobs`.

The engine gives, per token, `{token id: logprob}` holding the chosen token and the top-N (or None where
nothing predicts the token, the prompt's first); this module turns ids into token strings."""

from __future__ import annotations

from typing import Any

from jaxserve.server.engine_protocol import ServerTokenizer

# A logprob entry: {token id: logprob} (a float, or an object with `.logprob`); None where there is none.
Entry = dict | None


def _lp_value(v: Any) -> float:
    return float(v if isinstance(v, (int, float)) else getattr(v, "logprob"))


class LogprobFormatter:
    """Token strings and logprob objects for one request."""

    def __init__(self, tokenizer: ServerTokenizer | None):
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        try:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        except Exception:  # noqa: BLE001
            return f"token_id:{token_id}"

    def top(self, entry: Entry, n: int) -> list[tuple[int, float]]:
        if not entry:
            return []
        items = sorted(((int(t), _lp_value(v)) for t, v in entry.items()), key=lambda kv: -kv[1])
        return items[:n]

    def completion_logprobs(self, ids: list[int], entries: list[Entry], n: int, offset: int) -> tuple[dict, int]:
        """The completions shape for `ids`, whose text starts at character `offset` of the choice's text;
        returns it and the offset after the last token."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(ids, entries):
            s = self.token(tid)
            out["tokens"].append(s)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                chosen = entry.get(tid, entry.get(str(tid)))
                out["token_logprobs"].append(_lp_value(chosen) if chosen is not None else None)
                top: dict[str, float] = {}
                for t, lp in self.top(entry, n):
                    top.setdefault(self.token(t), lp)
                out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(s)
        return out, offset

    def prompt_logprobs(self, entries: list[Entry]) -> list:
        """vLLM's shape: per prompt token None (the first) or {token id: {"logprob", "decoded_token"}}."""
        return [None if e is None else {str(int(t)): {"logprob": _lp_value(v), "decoded_token": self.token(int(t))}
                                        for t, v in e.items()} for e in entries]

    def chat_logprobs(self, ids: list[int], entries: list[Entry], n: int) -> list[dict]:
        content = []
        for tid, entry in zip(ids, entries):
            s = self.token(tid)
            chosen = (entry or {}).get(tid)
            content.append({
                "token": s,
                "logprob": _lp_value(chosen) if chosen is not None else -9999.0,
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": self.token(t), "logprob": lp, "bytes": list(self.token(t).encode("utf-8"))}
                    for t, lp in self.top(entry, n)
                ],
            })
        return content
