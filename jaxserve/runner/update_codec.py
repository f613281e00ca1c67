"""A step's `BatchUpdate` as bytes, for the other processes of a multi-host job.

Followers keep a running batch of their own (`runner.running_batch`) and apply the leader's updates to
it, so an engine step sends what changed (a decode row: its slot, positions and one token) rather than
the step's packed inputs. Two things a follower cannot rebuild travel with it: each new row's
sampling as the device reads it (the leader's `RowSampling` fields; the follower's penalty history is
its batch's own token lists) and, for rows sampling under a grammar, the mask words the leader's
matchers filled (`SentMask`: the follower holds no matcher). The structure is compact JSON; the mask
words follow it as raw int32s.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import types
from typing import Any

import numpy as np

from jaxserve.engine.scheduler_output import BatchUpdate, NewRow, RowUpdate
from jaxserve.sampling.fields import DEVICE_FIELDS

_LENGTHS = struct.Struct("<II")  # JSON bytes, mask rows
_SAMPLING = tuple(f.name for f in DEVICE_FIELDS)


@dataclasses.dataclass(frozen=True)
class SentMask:
    """A constrained row's mask words as the leader filled them (what a follower's step applies in
    place of a grammar matcher: `GrammarMasks.fill` copies them)."""

    words: np.ndarray  # int32[ceil(vocab / 32)]


def _sampling(params: Any) -> list:
    bias = None if params.logit_bias is None else {str(k): v for k, v in params.logit_bias.items()}
    return [getattr(params, name) for name in _SAMPLING] + [bias, params.logprobs]


def _params(values: list) -> Any:
    *device, bias, logprobs = values
    return types.SimpleNamespace(
        **dict(zip(_SAMPLING, device)),
        logit_bias=None if bias is None else {int(k): v for k, v in bias.items()},
        logprobs=logprobs,
    )


def encode_update(update: BatchUpdate, masks: dict[int, np.ndarray]) -> bytes:
    """`update` and the mask words of its constrained rows (`masks`: row index -> words)."""
    body = dict(
        new=[
            [
                n.slot,
                n.replica,
                list(n.token_ids),
                n.prompt_len,
                _sampling(n.params),
                n.seed,
                list(n.page_ids),
                -1 if n.lora is None else n.lora.slot,
                n.scores_prompt,
                n.wants_logprobs,
            ]
            for n in update.new_rows
        ],
        rows=[
            [
                u.slot,
                u.start,
                u.num_tokens,
                u.lookahead,
                u.tokens_from,
                None if u.tokens is None else list(u.tokens),
                u.pages_from,
                None if u.page_ids is None else list(u.page_ids),
                u.drafts,
                u.draft_lag,
            ]
            for u in update.rows
        ],
        finished=update.finished,
        logprobs=update.logprobs,
        masked=sorted(masks),
    )
    text = json.dumps(body, separators=(",", ":")).encode()
    words = b"".join(np.asarray(masks[i], np.int32).tobytes() for i in sorted(masks))
    return _LENGTHS.pack(len(text), len(masks)) + text + words


def decode_update(data: bytes, offset: int = 0) -> tuple[BatchUpdate, dict[int, SentMask]]:
    """The update and each masked row's `SentMask`, from `encode_update`'s bytes at `offset`."""
    size, num_masks = _LENGTHS.unpack_from(data, offset)
    offset += _LENGTHS.size
    body = json.loads(data[offset : offset + size])
    offset += size
    new_rows = [
        NewRow(
            slot,
            replica,
            tokens,
            prompt_len,
            _params(sampling),
            seed,
            pages,
            None if lora < 0 else types.SimpleNamespace(slot=lora),
            None,
            scores_prompt,
            wants_logprobs,
        )
        for slot, replica, tokens, prompt_len, sampling, seed, pages, lora, scores_prompt, wants_logprobs in body["new"]
    ]
    rows = [RowUpdate(*row) for row in body["rows"]]
    words = np.frombuffer(data, np.int32, offset=offset)
    if num_masks and words.size % num_masks:
        raise ValueError(f"{words.size} mask words do not split into {num_masks} rows")
    per_row = words.reshape(num_masks, -1) if num_masks else words.reshape(0, 0)
    masks = {i: SentMask(per_row[k].copy()) for k, i in enumerate(body["masked"])}
    return BatchUpdate(new_rows, rows, body["finished"], body["logprobs"]), masks
