"""Non-blank lines of jaxserve/ at a git revision and in the working tree, both formatted the same way.

    python scripts/count_lines.py [REV]          # REV: what to compare with (default HEAD)

Each tree is copied to a temporary directory and formatted there by `ruff format` with the project's
settings (pyproject.toml's [tool.ruff]), so a difference is code, not layout. Prints the lines per
package (jaxserve/<package>/ or a top-level module), both totals and their difference.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export(rev: str | None, dest: str) -> None:
    """jaxserve/ and pyproject.toml of `rev` (None: the working tree) into `dest`."""
    if rev is None:
        shutil.copytree(
            os.path.join(ROOT, "jaxserve"),
            os.path.join(dest, "jaxserve"),
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
        shutil.copy(os.path.join(ROOT, "pyproject.toml"), dest)
        return
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", rev, "jaxserve", "pyproject.toml"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")


def formatted_counts(rev: str | None) -> dict[str, int]:
    """Non-blank lines per package of `rev`'s jaxserve/, after `ruff format` with the current settings."""
    with tempfile.TemporaryDirectory() as tmp:
        export(rev, tmp)
        shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp)  # one formatting for both trees
        subprocess.run([sys.executable, "-m", "ruff", "format", "--quiet", "jaxserve"], cwd=tmp, check=True)
        counts: dict[str, int] = collections.Counter()
        for dirpath, _, files in os.walk(os.path.join(tmp, "jaxserve")):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.join(tmp, "jaxserve"))
                package = rel.split(os.sep)[0] if os.sep in rel else rel
                with open(path, encoding="utf-8") as f:
                    counts[package] += sum(1 for line in f if line.strip())
        return dict(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", nargs="?", default="HEAD", help="the revision to compare with (default HEAD)")
    args = parser.parse_args(argv)
    before, after = formatted_counts(args.rev), formatted_counts(None)
    print(f"{'package':32s} {args.rev[:12]:>10s} {'now':>10s} {'change':>8s}")
    for package in sorted(set(before) | set(after)):
        b, a = before.get(package, 0), after.get(package, 0)
        print(f"{package:32s} {b:10d} {a:10d} {a - b:+8d}")
    b, a = sum(before.values()), sum(after.values())
    print(f"{'jaxserve/ (non-blank lines)':32s} {b:10d} {a:10d} {a - b:+8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
