"""The prompts `jaxserve bench` sends: seeded random prompts of chosen lengths, a built-in chat-like set,
and ShareGPT files.

`random` is vLLM's random dataset: input lengths uniform in len·(1 ± range ratio), an optional prefix
shared by every prompt, token ids (exact lengths, no tokenizer needed on the client) or words for a
chat endpoint. `chat` stands in for vLLM's ShareGPT sampling where nothing can be downloaded: seeded
conversations (an optional system prompt, earlier turns, a final user request) whose lengths are
drawn from log-normal distributions, long-tailed as real chat traffic is; token counts are estimates
until the server's `usage` reports the real ones. `sharegpt` reads a local ShareGPT JSON file.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact water room mother area money story month lot right study "
    "book job word business issue side kind head house service friend father power hour game line end member "
    "law car city community name president team minute idea kid body information back parent face others level "
    "office door health art war history party result change morning reason research girl guy moment air "
    "teacher force education"
).split()
TOKENS_PER_WORD = 1.3  # English words per BPE token, roughly: only an estimate until the server counts them

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise technical writer. Answer in plain language and keep it short.",
    "You are a patient tutor. Explain each step and check the reader's understanding.",
    "You are an assistant for a software team. Prefer lists and concrete examples.",
)
TASKS = (
    "Explain {topic} to someone who is new to it.",
    "Write a short story about {topic}.",
    "Summarize these notes about {topic}:",
    "What are the advantages and drawbacks of {topic}?",
    "Rewrite this paragraph about {topic} in simpler words:",
    "Give me a step-by-step plan for {topic}.",
    "Answer the question below about {topic}, with reasons.",
    "Draft an email to my team about {topic}.",
)
TOPICS = (
    "renewable energy",
    "learning a second language",
    "the history of the printing press",
    "remote work",
    "a city garden",
    "saving for retirement",
    "training for a marathon",
    "database indexes",
    "the water cycle",
    "a small bakery",
    "public transport",
    "sleep and memory",
    "chess openings",
    "moving to a new country",
    "volcanoes",
    "caching in web services",
    "a school science fair",
    "the first moon landing",
    "composting at home",
    "writing clean code",
)


@dataclass
class SampleRequest:
    """One request to send: `prompt` is token ids or text (completions) or a list of chat messages."""

    index: int
    prompt: Any
    input_len: int  # tokens: exact for token ids, estimated for text (the server's usage replaces it)
    output_len: int  # max_tokens


def _lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    lo = max(1, int(round(mean * (1 - range_ratio))))
    hi = max(lo, int(round(mean * (1 + range_ratio))))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    run: int | str = 0,
    text: bool = False,
    token_low: int = 10,
    token_high: int = 250,
    output_range_ratio: float | None = None,
) -> list[SampleRequest]:
    """Seeded random prompts: `prefix_len` shared tokens (or words, `text`) then input_len·(1 ± range_ratio)
    more, and output_len·(1 ± output_range_ratio, default range_ratio) tokens to generate. Each `run` (a
    sweep's rate, a warm-up) draws its own prompt bodies with the same lengths and prefix, so a run after
    another on one server does not find its prompts in the prefix cache; run 0 draws them from the
    lengths' generator. Token ids come from [token_low, token_high)."""
    rng = random.Random(seed)
    inputs = _lengths(rng, input_len, range_ratio, num_prompts)
    outputs = _lengths(rng, output_len, range_ratio if output_range_ratio is None else output_range_ratio, num_prompts)

    def make(n: int, rng: random.Random):
        if text:
            return " ".join(rng.choice(WORDS) for _ in range(n))
        return [rng.randrange(token_low, token_high) for _ in range(n)]

    prefix = make(prefix_len, rng) if prefix_len else ("" if text else [])
    bodies = rng if run == 0 else random.Random(f"{seed}/{run}")
    requests = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs)):
        body = make(n_in, bodies)
        prompt = ((prefix + " " + body).strip() if prefix else body) if text else list(prefix) + body
        requests.append(SampleRequest(i, prompt, prefix_len + n_in, n_out))
    return requests


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def _prose(rng: random.Random, words: int) -> str:
    """`words` words as sentences of 6-16 words (what a message body looks like to a tokenizer)."""
    out, left = [], words
    while left > 0:
        n = min(left, rng.randint(6, 16))
        sentence = " ".join(rng.choice(WORDS) for _ in range(n))
        out.append(sentence[0].upper() + sentence[1:] + ".")
        left -= n
    return " ".join(out)


def chat_requests(
    num_prompts: int, input_len: int = 96, output_len: int = 128, seed: int = 0, run: int | str = 0
) -> list[SampleRequest]:
    """Seeded chat conversations: a system prompt for half of them, up to two earlier user/assistant turns
    (40%), and a final user request of a task, a topic and a body of about `input_len` words (median;
    log-normal, sigma 0.8); max_tokens log-normal around `output_len` (sigma 0.6, at least 4)."""
    rng = random.Random(f"chat/{seed}/{run}")
    requests = []
    for i in range(num_prompts):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.choices((0, 1, 2), weights=(60, 25, 15))[0]):
            topic = rng.choice(TOPICS)
            messages.append(
                {
                    "role": "user",
                    "content": rng.choice(TASKS).format(topic=topic)
                    + " "
                    + _prose(rng, _lognormal(rng, max(4, input_len / 3), 0.6, 4, 4 * input_len)),
                }
            )
            messages.append(
                {
                    "role": "assistant",
                    "content": _prose(rng, _lognormal(rng, max(4, output_len / 2), 0.6, 4, 4 * output_len)),
                }
            )
        task = rng.choice(TASKS).format(topic=rng.choice(TOPICS))
        body = _prose(rng, _lognormal(rng, input_len, 0.8, 4, 8 * input_len))
        messages.append({"role": "user", "content": f"{task}\n\n{body}"})
        words = sum(len(m["content"].split()) for m in messages)
        requests.append(
            SampleRequest(
                i,
                messages,
                int(words * TOKENS_PER_WORD) + 4 * len(messages),
                _lognormal(rng, output_len, 0.6, 4, 4 * output_len),
            )
        )
    return requests


def sharegpt_requests(
    path: str,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    max_input_len: int = 1024,
    max_total_len: int = 2048,
) -> list[SampleRequest]:
    """The first user turn of ShareGPT conversations (a JSON list of {"conversations": [{"from", "value"}]}),
    shuffled by `seed`; max_tokens is the length of the recorded reply (or `output_len`). Lengths are
    estimated at four characters a token; conversations past `max_input_len` or `max_total_len`
    estimated tokens, or under 4, are skipped, as vLLM's sampler does with real counts."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(data)
    requests: list[SampleRequest] = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        n_in = max(1, len(prompt) // 4)
        n_out = output_len or max(1, len(reply) // 4)
        if n_in < 4 or n_out < 4 or n_in > max_input_len or n_in + n_out > max_total_len:
            continue
        requests.append(SampleRequest(len(requests), [{"role": "user", "content": prompt}], n_in, n_out))
        if len(requests) == num_prompts:
            break
    if len(requests) < num_prompts:
        raise ValueError(f"{path} has {len(requests)} usable conversations, fewer than --num-prompts {num_prompts}")
    return requests


def as_completion_prompt(prompt: Any) -> Any:
    """A chat conversation as one completion prompt (a completions endpoint has no messages)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in prompt) + "\nAssistant:"
    return prompt


def as_messages(prompt: Any) -> list[dict]:
    """Any prompt as chat messages (a chat endpoint takes no token ids: ids are sent as their numbers' text)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return prompt
    if isinstance(prompt, list):
        prompt = " ".join(map(str, prompt))
    return [{"role": "user", "content": prompt}]
