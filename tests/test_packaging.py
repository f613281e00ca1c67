"""What `pip install .` ships: every package of the source tree, the default model and the configs.

CI's fresh-install check (.ci/fresh_install.py) proves the same end to end in a new virtualenv; these
are the quick checks that name the missing piece."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib
import zipfile

import pytest

from jaxserve.loading import resources

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def source_packages() -> set[str]:
    return {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("jaxserve", "pallas_kernels")
        for p in (ROOT / top).rglob("__init__.py")
    }


def test_every_source_package_is_listed():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    data = set(PYPROJECT["tool"]["setuptools"]["package-dir"])
    assert data == {"jaxserve._checkpoints", "jaxserve._configs"}
    assert listed - data == source_packages()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (path,) = out.glob("jaxserve-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_carries_the_default_model_and_configs(wheel):
    names = set(wheel.namelist())
    shipped = {
        f"jaxserve/_checkpoints/{p.relative_to(ROOT / 'checkpoints')}"
        for p in (ROOT / "checkpoints").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert shipped <= names, sorted(shipped - names)[:5]
    for need in (
        "jaxserve/_configs/default.yaml",
        "jaxserve/_configs/small.yaml",
        "jaxserve/_configs/models/smollm2-135m/config.json",
        "jaxserve/_checkpoints/small/generation_config.json",
        "jaxserve/_checkpoints/default/generation_config.json",
        "jaxserve/cli.py",
    ):
        assert need in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    entry_points = wheel.read([n for n in names if n.endswith("entry_points.txt")][0]).decode()
    assert "jaxserve = jaxserve.cli:main" in entry_points


def test_resources_prefer_the_installed_copy(tmp_path, monkeypatch):
    assert resources.small_checkpoint() == ROOT / "checkpoints" / "small"  # this checkout (editable)
    (tmp_path / "_checkpoints" / "small").mkdir(parents=True)
    (tmp_path / "_configs").mkdir()
    (tmp_path / "_configs" / "small.yaml").write_text("page_size: 16\n")
    monkeypatch.setattr(resources, "PACKAGE_DIR", tmp_path)
    monkeypatch.chdir(tmp_path / "_configs")  # where no configs/ folder is
    assert resources.small_checkpoint() == tmp_path / "_checkpoints" / "small"
    assert resources.resolve_config("small") == str(tmp_path / "_configs" / "small.yaml")
    assert resources.resolve_config("configs/small.yaml") == str(tmp_path / "_configs" / "small.yaml")
    assert resources.resolve_config("nowhere.yaml") == "nowhere.yaml"  # the loader's error names it
    assert resources.resolve_shipped_path("checkpoints/small") == str(tmp_path / "_checkpoints" / "small")
