"""`jaxserve compile [MODEL] [every serve flag]`: compile every executable a server with those flags would
use into the executable store, so the server (or every machine of a fleet sharing the store, or an
image built with it) starts without compiling; `jaxserve compile --list` shows the store.

    jaxserve compile                            the default model's executables, as `jaxserve serve` uses them
    jaxserve compile ORG/NAME --max-num-seqs 8  the same flags as the server that will use them
    jaxserve compile --list                     the store's entries, sizes and its bound

The store is the server's (`--compilation-cache-dir DIR`: DIR/executables, default
~/.cache/jaxserve/executables); docs/startup.md has the Dockerfile line and the fleet recipe.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Sequence

from jaxserve.config import EngineConfig
from jaxserve.errors import JaxServeError

logger = logging.getLogger(__name__)


def build_parser(prog: str):
    from jaxserve.serve import build_parser as serve_parser

    parser = serve_parser(prog)
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--list", action="store_true", help="list the executable store's entries and exit")
    return parser


def list_store(directory: str | None, max_bytes: int) -> int:
    from jaxserve.runner.executable_store import ExecutableStore

    if directory is None:
        print(
            "the executable store is off (--no-compilation-cache, --no-executable-store, 'none' or "
            "$JAXSERVE_EXECUTABLE_STORE=0)"
        )
        return 1
    store = ExecutableStore.open(directory, max_bytes)
    if store is None:
        return 1
    rows = store.entries()
    print(f"{directory}: {len(rows)} entries, {fmt_bytes(sum(r['bytes'] for r in rows))} of {fmt_bytes(max_bytes)}")
    for r in rows:
        name = r["path"].rsplit("/", 1)[-1][:16]
        if "error" in r:
            print(f"  {name}  {fmt_bytes(r['bytes']):>9}  unreadable: {r['error']}")
            continue
        print(
            f"  {name}  {fmt_bytes(r['bytes']):>9}  {r.get('variant', '?'):<16} bucket {r.get('bucket')}  "
            f"compiled in {r.get('compile_seconds', 0):.1f} s  {r.get('created', '')}  model {r.get('model', '?')}"
        )
    return 0


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def compile_all(settings: EngineConfig) -> int:
    """Build the engine these settings describe (its warm-up compiles or loads every executable) and
    report what the store gained."""
    from jaxserve.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(settings.replace(compile_in_background=False), warm_up=False)  # every step, now
    try:
        table = engine.runner.table
        if table.store is None:
            print("error: the executable store is off or refused (see the warning above): nothing was stored")
            return 1
        table.fresh_compiles = True  # every step compiled (not read back from JAX's cache), so stored
        engine.warm_up()
        for key, seconds, path in table.stored:
            print(f"wrote {path} ({key}): compiled in {seconds:.1f} s")
        for key, seconds in table.loaded:
            print(f"already stored: {key} (loaded in {seconds:.3f} s)")
        missing = [
            k for k in table.executables if k not in {k for k, *_ in table.stored} | {k for k, _ in table.loaded}
        ]
        for key in missing:
            print(f"not stored: {key} (see the warnings above)")
        print(
            f"{len(table.stored)} executables compiled and stored, {len(table.loaded)} already there, "
            f"{len(missing)} not storable, in {time.perf_counter() - start:.1f} s: {table.store.directory}"
        )
        return 1 if missing else 0
    finally:
        engine.close()


def main(argv: Sequence[str] | None = None, prog: str = "jaxserve compile") -> int:
    from jaxserve.runner.compilation import store_directory
    from jaxserve.serve import resolve_settings, settings_from_flags

    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, ns.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if ns.mock_engine:
        print("error: the mock engine compiles nothing", file=sys.stderr)
        return 2
    try:
        if ns.list:
            settings = settings_from_flags(ns)
            return list_store(store_directory(settings), settings.executable_store_max_size)
        settings, _, _ = resolve_settings(ns)
    except JaxServeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if store_directory(settings) is None:
        print("error: the executable store is off for these flags: nothing to compile into", file=sys.stderr)
        return 2
    return compile_all(settings)


if __name__ == "__main__":
    sys.exit(main(prog="python -m jaxserve.precompile"))
