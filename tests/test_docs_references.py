"""The docs match the code: every `--flag` README.md and docs/*.md name exists in a parser, every repository path
and relative link they name exists (a link's #anchor too), and each figure line of BENCHMARKS.md's summary names
a machine and a date. Parsers and files only (no model, no jax work): a few seconds."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Flags of other programs the docs show in their commands, each with the program: not jaxserve's to define.
OTHER_PROGRAMS = {
    "--no-deps": "pip",
    "--dry-run": "pip",
    "--no-cache-dir": "pip",
    "--help": "every command",
    "--durations": "pytest",
    "--short": "git rev-parse",
    "--zone": "gcloud",
    "--worker": "gcloud",
    "--command": "gcloud",
    "--head": "ray start",
    "--build-arg": "docker build",
    "--profile": "vllm bench serve (docs/bench.md: a flag jaxserve bench does not have)",
    "--n_ctx": "python -m llama_cpp.server",
    "--n_threads": "python -m llama_cpp.server",
    "--chat_format": "python -m llama_cpp.server",
    "--interrupt_requests": "python -m llama_cpp.server",
}
# Not flags: words the docs write with two dashes.
NOT_FLAGS = {
    "--flag": "ARCHITECTURE.md: the general form of a setting's flag",
    "--kebab-case": "TUNING.md: the general form of a setting's flag",
}
# Paths the docs name as they were at a measured commit (BENCHMARKS.md is a log), with where they are now.
HISTORICAL_PATHS = {
    "jaxserve/step_timing.py": "moved to jaxserve/runner/step_timing.py",
    "checkpoints/default-draft": "the former 5.25M default model's draft, removed with that model",
}
TOP_DIRS = ("jaxserve/", "scripts/", "configs/", "docs/", "tests/", "checkpoints/", "pallas_kernels/", ".ci/")
MACHINE = re.compile(r"CPU|cores|Xeon|EPYC|H100|H200|A100|L4|GPU|TPU")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def parser_flags() -> set[str]:
    """Every option string of jaxserve's command lines (the real parsers; compare_hf builds its own inside main),
    and of jaxserve/, scripts/ and .ci/ as their add_argument calls spell them (no script is imported)."""
    from jaxserve import plan, serve
    from jaxserve.bench import offline as bench_offline, serve as bench_serve
    from jaxserve.serving.ray import cli as ray_cli

    parsers = [
        serve.build_parser(),
        ray_cli.build_parser(),
        plan.build_parser(),
        plan.build_capacity_parser(),
        bench_serve.build_parser(),
    ]
    parsers += [bench_offline.build_latency_parser(), bench_offline.build_throughput_parser()]
    flags = {"--version"}  # jaxserve --version (cli.py)
    for parser in parsers:
        flags |= set(parser._option_string_actions)
    for path in [*(REPO / "jaxserve").rglob("*.py"), *(REPO / "scripts").rglob("*.py"), *(REPO / ".ci").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return {f for f in flags if f.startswith("--")}


def superseded_lines(path: pathlib.Path) -> set[int]:
    """BENCHMARKS.md's sections marked "> **Superseded**" (to the next heading of their level or above): a log
    of what was measured then, whose paths may have moved since."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: set[int] = set()
    level = None
    for i, line in enumerate(lines, 1):
        heading = re.match(r"^(#+) ", line)
        if heading:
            depth = len(heading.group(1))
            if level is not None and depth <= level:
                level = None
            following = next((l for l in lines[i:] if l.strip()), "")
            if level is None and following.startswith("> **Superseded**"):
                level = depth
        if level is not None:
            out.add(i)
    return out


def doc_lines():
    for path in DOCS:
        skip = superseded_lines(path) if path.name == "BENCHMARKS.md" else set()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            yield path, number, line, number in skip


def test_every_flag_the_docs_name_exists():
    known = parser_flags()
    missing = []
    for path, number, line, _ in doc_lines():
        for match in re.finditer(r"(?<![\w-])--[A-Za-z][\w-]*", line):
            flag = match.group(0).rstrip("-")
            if flag.startswith("--xla_"):  # XLA_FLAGS
                continue
            # --max_model_len: vLLM's spelling, which jaxserve serve takes too
            if flag.replace("_", "-") in known or flag in OTHER_PROGRAMS or flag in NOT_FLAGS:
                continue
            missing.append(f"{path.relative_to(REPO)}:{number}: {flag}")
    assert not missing, "flags no parser defines:\n" + "\n".join(missing)


def test_the_vllm_page_names_only_flags_jaxserve_serve_takes():
    """docs/coming-from-vllm.md promises that `jaxserve serve` takes each vLLM flag it lists."""
    from jaxserve import serve

    taken = set(serve.build_parser()._option_string_actions)
    text = (REPO / "docs" / "coming-from-vllm.md").read_text(encoding="utf-8")
    table = text[text.index("## The flag map") : text.index("## Benchmarks")]
    named = {f.replace("_", "-") for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", table)} - {"--help"}
    assert len(named) > 60 and not sorted(named - taken)


def test_every_path_and_link_the_docs_name_exists():
    missing = []
    for path, number, line, historical in doc_lines():
        where = f"{path.relative_to(REPO)}:{number}"
        for match in re.finditer(r"(?<![\w./~-])((?:%s)[\w./-]*\w)" % "|".join(map(re.escape, TOP_DIRS)), line):
            name = match.group(1)
            if historical or any(c in name for c in "*{") or name in HISTORICAL_PATHS:
                continue
            if not (REPO / name).exists():
                missing.append(f"{where}: {name}")
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                missing.append(f"{where}: link {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                missing.append(f"{where}: link {target} (no such heading)")
    assert not missing, "named but absent:\n" + "\n".join(missing)
    for old in HISTORICAL_PATHS:
        assert not (REPO / old).exists(), f"{old} exists again: drop it from HISTORICAL_PATHS"


def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for heading in re.findall(r"^#+ (.*)$", path.read_text(encoding="utf-8"), re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def test_benchmarks_summary_lines_name_machine_and_date():
    text = (REPO / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert text.startswith("# Benchmarks\n\n## Summary (")
    summary = text[text.index("## Summary") : text.index("\n## ", text.index("## Summary") + 5)]
    rows = [l for l in summary.splitlines() if l.startswith("| ") and not l.startswith("| what") and "---" not in l]
    assert len(rows) >= 5
    for row in rows:
        assert MACHINE.search(row) and DATE.search(row), row
    assert "**Not measured**" in summary
    superseded = text.count("> **Superseded**")
    assert superseded >= 8


def test_no_placeholders_and_no_registry_install():
    """No placeholder organisations; and the registry's `jaxserve` is another project, so every `pip install
    jaxserve...` is of a git URL (`"jaxserve[tpu] @ git+..."`), never of the bare name."""
    files = DOCS + sorted((REPO / "configs").rglob("*.yaml")) + [REPO / "configs" / "kuberay" / "Dockerfile"]
    files += sorted((REPO / "jaxserve").rglob("*.py"))  # the errors that tell a user what to install
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert "YOUR_ORG" not in text and "YOUR-ORG" not in text, path
        for match in re.finditer(r"pip install (?:-\S+ )*[\"']?jaxserve(\[[\w,]*\])?[\"']?( @)?", text):
            said_not_to = "never `" in text[max(0, match.start() - 8) : match.start()]  # "never `pip install jaxserve`"
            assert match.group(2) or said_not_to, f"{path.relative_to(REPO)}: {match.group(0)}"
