"""Logprobs in OpenAI's shapes: completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`),
chat (`content`: one object per token with its bytes and top alternatives), and vLLM's `prompt_logprobs`.

The engine gives, per token, `{token id: logprob}` holding the chosen token and the top-N (or None where
nothing predicts the token, the prompt's first); this module turns ids into token strings.

Every number it returns is finite, so the responses are strict JSON (no -Infinity/NaN): an alternative
whose logprob is not finite (a token a grammar masked) is left out of the top lists (the engine already
drops them; this holds for any ServingEngine), and a token's own logprob that is not finite is given as
LOGPROB_FLOOR, as vLLM does."""

from __future__ import annotations

import math
from typing import Any

from jaxserve.server.engine_protocol import ServerTokenizer

# A logprob entry: {token id: logprob} (a float, or an object with `.logprob`); None where there is none.
Entry = dict | None


# What a token's own logprob that is not finite (-inf, NaN) is reported as (vLLM's floor, and what chat
# reports for a token without an entry).
LOGPROB_FLOOR = -9999.0


def _lp_value(v: Any) -> float:
    return float(v if isinstance(v, (int, float)) else getattr(v, "logprob"))


def _own_value(v: Any) -> float:
    """A token's own logprob as a JSON number: finite, else LOGPROB_FLOOR."""
    lp = _lp_value(v)
    return lp if math.isfinite(lp) else LOGPROB_FLOOR


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
        items = ((int(t), _lp_value(v)) for t, v in entry.items())
        return sorted(((t, lp) for t, lp in items if math.isfinite(lp)), key=lambda kv: -kv[1])[:n]

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
                out["token_logprobs"].append(_own_value(chosen) if chosen is not None else None)
                top: dict[str, float] = {}
                for t, lp in self.top(entry, n):
                    top.setdefault(self.token(t), lp)
                out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(s)
        return out, offset

    def prompt_logprobs(self, entries: list[Entry], ids: list[int] | None = None) -> list:
        """vLLM's shape: per prompt token None (the first) or {token id: {"logprob", "decoded_token"}}.
        `ids`: the prompt's token ids, whose own entries are kept whatever their value (as LOGPROB_FLOOR
        when not finite); the alternatives that are not finite are left out."""
        out: list = []
        for k, e in enumerate(entries):
            if e is None:
                out.append(None)
                continue
            own = ids[k] if ids is not None and k < len(ids) else None
            item = {}
            for t, v in e.items():
                t, lp = int(t), _lp_value(v)
                if t == own:
                    item[str(t)] = {"logprob": _own_value(lp), "decoded_token": self.token(t)}
                elif math.isfinite(lp):
                    item[str(t)] = {"logprob": lp, "decoded_token": self.token(t)}
            out.append(item)
        return out

    def chat_logprobs(self, ids: list[int], entries: list[Entry], n: int) -> list[dict]:
        content = []
        for tid, entry in zip(ids, entries):
            s = self.token(tid)
            chosen = (entry or {}).get(tid)
            content.append(
                {
                    "token": s,
                    "logprob": _own_value(chosen) if chosen is not None else LOGPROB_FLOOR,
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [
                        {"token": self.token(t), "logprob": lp, "bytes": list(self.token(t).encode("utf-8"))}
                        for t, lp in self.top(entry, n)
                    ],
                }
            )
        return content
