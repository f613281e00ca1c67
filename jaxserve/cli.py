"""The `jaxserve` command: one entry point, a subcommand per tool.

    jaxserve serve [MODEL] [flags]  the OpenAI-compatible server (= python -m jaxserve.serve); MODEL a
                                  directory, a GGUF file or a Hugging Face ID, as `vllm serve ORG/NAME`
    jaxserve serve-ray [MODEL] [flags]  the same server over replicas on Ray Serve (= jaxserve.serving.ray.cli)
    jaxserve disagg-proxy --prefill URL.. --decode URL..  prefill then decode on separate servers (docs/disaggregation.md)
    jaxserve compile [MODEL] [flags]  every executable `serve` with these flags uses, into the executable store
                                  (= python -m jaxserve.precompile); `jaxserve compile --list` shows the store
    jaxserve plan [flags]           will a model fit, how many sequences, how fast (= python -m jaxserve.plan)
    jaxserve compare-hf [flags]     greedy tokens and logprobs against Hugging Face (= python -m jaxserve.compare_hf)
    jaxserve bench {serve,latency,throughput} [flags]  benchmarks, as `vllm bench` (= python -m jaxserve.bench.cli)

Each subcommand takes exactly the flags of its module (`jaxserve serve --help`); the modules stay
runnable with `python -m`, so scripts and docs written for either spelling keep working.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

# subcommand -> (module with main(argv, prog=...), one-line description)
SUBCOMMANDS = {
    "serve": ("jaxserve.serve", "OpenAI-compatible HTTP server: serve [MODEL], a directory, .gguf or ORG/NAME"),
    "serve-ray": (
        "jaxserve.serving.ray.cli",
        "the same server over engine replicas on Ray Serve (needs jaxserve[ray])",
    ),
    "disagg-proxy": (
        "jaxserve.serving.disagg_proxy",
        "one OpenAI endpoint over prefill and decode servers (docs/disaggregation.md)",
    ),
    "compile": (
        "jaxserve.precompile",
        "compile every executable `serve` with the same flags uses into the executable store; --list shows it",
    ),
    "plan": ("jaxserve.plan", "memory and roofline planner: fit, capacity, bounds, replicas for a rate"),
    "compare-hf": ("jaxserve.compare_hf", "parity check against Hugging Face transformers (needs jaxserve[hf])"),
    "bench": ("jaxserve.bench.cli", "benchmarks as `vllm bench`: serve (any OpenAI server), latency, throughput"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [
        "usage: jaxserve {" + ",".join(SUBCOMMANDS) + "} [flags]   (jaxserve SUBCOMMAND --help for its flags)",
        "",
        "subcommands:",
    ]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in SUBCOMMANDS.items()]
    lines += ["", "  --version  print jaxserve's version"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script (argv None: the process's arguments) or a call from Python (no re-exec)."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"jaxserve {version('jaxserve')}")
        except PackageNotFoundError:
            print("jaxserve (not installed as a distribution)")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"jaxserve: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    if name == "serve" and from_command_line:
        module.preload_tcmalloc(rest)  # re-executes as `python -m jaxserve.serve` under tcmalloc when available
    return module.main(rest, prog=f"jaxserve {name}")


if __name__ == "__main__":
    sys.exit(main())
