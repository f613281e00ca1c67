"""The package's shape, read from its imports: no import cycles between jaxserve's modules, the
host-only packages never reach jax, and no module passes 600 lines. Imports anywhere in a file count
(a function-level import is still an edge), except under `if TYPE_CHECKING:`."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxserve"
# Host only: plain Python and NumPy, unit-testable without a device.
HOST_PACKAGES = ("jaxserve.engine", "jaxserve.config", "jaxserve.sampling", "jaxserve.server", "jaxserve.kv_transfer")
DEVICE_ROOTS = ("jax", "jaxlib", "flax")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _import_nodes(node: ast.AST):
    """Every import in `node`, but those under `if TYPE_CHECKING:` (annotations only, never run)."""
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
        children = node.orelse
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
        return
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        yield from _import_nodes(child)


def _longest_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges(module: str) -> tuple[set[str], bool]:
    """The jaxserve modules `module` imports, and whether it imports jax/flax itself."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    edges, device = set(), False
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            if node.level:
                base = module.split(".")[: len(module.split(".")) - (node.level - (1 if is_package else 0))]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]
        for name in names:
            device |= name.split(".")[0] in DEVICE_ROOTS
            target = _longest_module(name) if name.startswith("jaxserve") else None
            # a package's __init__ runs on the way to its modules: not an edge of its own
            if (
                target
                and target != module
                and not (module.startswith(target + ".") and MODULES[target].name == "__init__.py")
            ):
                edges.add(target)
    return edges, device


GRAPH = {m: _edges(m) for m in MODULES}


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(GRAPH[m][0])
    return seen


def test_no_import_cycles():
    cycles = sorted({tuple(sorted((m, e))) for m in MODULES for e in GRAPH[m][0] if m in _reach(e)})
    assert not cycles, f"modules that import each other (directly or through others): {cycles[:5]}"


def test_host_packages_reach_no_module_that_imports_jax():
    host = [m for m in MODULES if m.startswith(HOST_PACKAGES)]
    assert any(m.endswith(".scheduler") for m in host) and any(m.endswith(".core") for m in host)
    leaks = {m: sorted(x for x in _reach(m) if GRAPH[x][1]) for m in host}
    assert not {m: v for m, v in leaks.items() if v}


def test_importing_the_engine_core_and_server_loads_no_jax():
    code = (
        "import sys, jaxserve.engine.core, jaxserve.engine.async_engine, jaxserve.server.api; "
        "print(sorted(m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_module_over_600_lines():
    long = {m: n for m, p in MODULES.items() if (n := p.read_text().count("\n")) > MAX_LINES}
    assert not long, long
