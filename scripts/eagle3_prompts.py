"""Chat prompts for training an EAGLE-3 head, built from text available offline (scripts/corpus.py).

The head learns to predict the target's own answers, so the prompts only need to look like what the
served model is asked: questions about code, docstrings and modules, and plain instructions. They are
made from the standard-library sources, the only sizeable text on this machine.

Training and held-out prompts are kept apart twice over: held-out prompts come from corpus.py's
held-out files (5% of the stdlib, chosen by a hash of the path) *and* use templates the training
prompts never use, so a held-out score measures a head on questions it has not seen in either form.
"""

from __future__ import annotations

import ast
import random
import textwrap

from corpus import iter_texts

MAX_CODE_LINES = 30
MAX_CODE_CHARS = 1400

# kind -> templates; {code} is fenced Python, {doc} a docstring, {name}/{module} identifiers
TRAIN_TEMPLATES = {
    "function": [
        "Explain what this function does:\n\n```python\n{code}\n```",
        "Write a docstring for this function:\n\n```python\n{code}\n```",
        "Summarize this Python function in two sentences.\n\n```python\n{code}\n```",
        "Write a unit test for this function.\n\n```python\n{code}\n```",
        "Is there a bug in this code? Explain briefly.\n\n```python\n{code}\n```",
    ],
    "docstring": [
        "Summarize this docstring:\n\n{doc}",
        "Write a Python function that does what this docstring describes:\n\n{doc}",
    ],
    "module": [
        "What does this module do?\n\n```python\n{code}\n```",
    ],
    "name": [
        "Write a Python function named `{name}`.",
        "What is the `{module}` module in Python's standard library used for?",
        "Give a short example of using Python's `{module}` module.",
        "Explain, step by step, how you would implement `{name}` in Python.",
    ],
}

HELDOUT_TEMPLATES = {
    "function": [
        "Describe the purpose of the following code and the arguments it takes.\n\n```python\n{code}\n```",
        "Rewrite this function with type hints.\n\n```python\n{code}\n```",
        "What could go wrong when calling this function?\n\n```python\n{code}\n```",
    ],
    "docstring": [
        "Explain this documentation to a beginner:\n\n{doc}",
    ],
    "module": [
        "Give an overview of this file for a new contributor.\n\n```python\n{code}\n```",
    ],
    "name": [
        "How would I use `{name}` from the `{module}` module? Show an example.",
        "List three common mistakes people make with Python's `{module}` module.",
    ],
}


def _cut(source: str) -> str:
    lines = textwrap.dedent(source).splitlines()[:MAX_CODE_LINES]
    text = "\n".join(lines)
    return text[:MAX_CODE_CHARS]


def _materials(key: str, text: str) -> list[tuple[str, dict]]:
    """(kind, fields) a file offers: its functions, their docstrings, its head, its names."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    module = key[:-3].replace("/", ".").removesuffix(".__init__")
    found: list[tuple[str, dict]] = []
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
            continue
        body = lines[node.lineno - 1 : node.end_lineno]
        if 3 <= len(body) <= 60:
            found.append(("function", {"code": _cut("\n".join(body))}))
        doc = ast.get_docstring(node)
        if doc and len(doc) >= 60:
            found.append(("docstring", {"doc": doc[:MAX_CODE_CHARS]}))
        if not node.name.startswith(("_", "test")):
            found.append(("name", {"name": node.name, "module": module}))
    if len(lines) >= 10:
        found.append(("module", {"code": _cut(text)}))
    return found


# the kinds in the order prompts take them, repeated: 9 function, 5 name, 4 docstring, 2 module in 20
KIND_CYCLE = (
    "function", "name", "docstring", "function", "function", "name", "module", "function", "docstring", "name",
    "function", "function", "docstring", "name", "function", "module", "function", "name", "docstring", "function",
)  # fmt: skip


def build_prompts(split: str, count: int, seed: int) -> list[dict]:
    """`count` prompts of `split` ("train" or "heldout"), each {"id", "kind", "template", "content"}:
    kinds in the proportions of KIND_CYCLE (functions are most of the stdlib and would crowd the
    rest out), materials shuffled per kind and a template drawn for each, all fixed by the seed.
    Prefix-stable: the first n of `count` prompts are `build_prompts(split, n, seed)`, so a larger
    data set extends a smaller one (its generated shards stay valid)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, not {split!r}")
    templates = TRAIN_TEMPLATES if split == "train" else HELDOUT_TEMPLATES
    by_kind: dict[str, list[dict]] = {kind: [] for kind in templates}
    for key, text in iter_texts(split):
        for kind, fields in _materials(key, text):
            by_kind[kind].append(fields)
    rng = random.Random(f"{seed}-{split}")
    for pool in by_kind.values():
        rng.shuffle(pool)
    picks = {kind: random.Random(f"{seed}-{split}-{kind}") for kind in templates}
    next_of = dict.fromkeys(templates, 0)
    prompts: list[dict] = []
    seen: set[str] = set()
    slot = 0
    while len(prompts) < count and any(next_of[k] < len(by_kind[k]) for k in templates):
        kind = KIND_CYCLE[slot % len(KIND_CYCLE)]
        slot += 1
        while next_of[kind] < len(by_kind[kind]):
            fields = by_kind[kind][next_of[kind]]
            next_of[kind] += 1
            t = picks[kind].randrange(len(templates[kind]))
            content = templates[kind][t].format(**fields)
            if content not in seen:
                seen.add(content)
                prompts.append({"id": f"{split}-{len(prompts):06d}", "kind": kind, "template": t, "content": content})
                break
    return prompts
