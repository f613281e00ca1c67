"""`jaxserve bench {serve,latency,throughput}`: one command per benchmark, vLLM's `vllm bench` shape."""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

# benchmark -> (module, its main function, one-line description)
BENCHMARKS = {
    "serve": (
        "jaxserve.bench.serve",
        "main",
        "streamed load against an OpenAI-compatible server: TTFT/TPOT/ITL percentiles, goodput, JSON",
    ),
    "latency": (
        "jaxserve.bench.offline",
        "latency_main",
        "offline: one batch through LLM.generate, latency percentiles",
    ),
    "throughput": ("jaxserve.bench.offline", "throughput_main", "offline: N prompts through LLM.generate, tokens/s"),
}


def usage(prog: str) -> str:
    lines = [
        f"usage: {prog} {{{','.join(BENCHMARKS)}}} [flags]   ({prog} BENCHMARK --help for its flags)",
        "",
        "benchmarks:",
    ]
    lines += [f"  {name:<10}  {about}" for name, (_, _, about) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "jaxserve bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(usage(prog))
        return 2
    if argv[0] in ("-h", "--help", "help"):  # as argparse's --help in the other subcommands: exit 0
        print(usage(prog))
        raise SystemExit(0)
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"{prog}: unknown benchmark {name!r}\n\n{usage(prog)}", file=sys.stderr)
        return 2
    module, function, _ = BENCHMARKS[name]
    return getattr(importlib.import_module(module), function)(rest, prog=f"{prog} {name}")


if __name__ == "__main__":
    sys.exit(main())
