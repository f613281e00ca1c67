"""Hugging Face model IDs (jaxserve.loading.hub) without the network: a cache laid out as huggingface_hub
lays it out, served with HF_HUB_OFFLINE=1; the download path with snapshot_download stubbed; and every
failure huggingface_hub raises, built as the library builds it, mapped to a ModelLoadError that says
what to do."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.utils import hf_raise_for_status

from jaxserve.errors import ModelLoadError
from jaxserve.loading import hub

try:  # the HTTP client huggingface_hub raises its errors with: httpx2 from 2.x, httpx in 1.x
    import httpx2 as httpx
except ImportError:  # pragma: no cover - huggingface_hub 1.x
    import httpx

COMMIT_1 = "1" * 40
COMMIT_2 = "2" * 40
WEIGHTS = {
    "config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}),
    "model.safetensors": "weights",
    "tokenizer.json": "{}",
}


def cache_repo(cache, repo_id, snapshots, refs):
    """huggingface_hub's cache layout: models--ORG--NAME/{blobs/<hash>, refs/<ref> (a commit hash),
    snapshots/<commit>/<file> (a relative symlink to its blob)}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, files in snapshots.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for name, text in files.items():
            blob = hashlib.sha256(text.encode()).hexdigest()
            (repo / "blobs" / blob).write_text(text)
            (snapshot / name).symlink_to(os.path.join("..", "..", "blobs", blob))
    (repo / "refs").mkdir(exist_ok=True)
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)
    return repo


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """HF_HOME=tmp, HF_HUB_OFFLINE=1. huggingface_hub reads its environment once, at import (constants),
    so the constants it reads at call time are set too, as a fresh process would have them."""
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def hub_error(status, error_code, message=None, url="https://huggingface.co/api/models/org/name/revision/main"):
    """The exception huggingface_hub raises for this Hub answer (its hf_raise_for_status)."""
    headers = {"X-Error-Code": error_code} if error_code else {}
    if message:
        headers["X-Error-Message"] = message
    response = httpx.Response(status, headers=headers, request=httpx.Request("GET", url))
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as raised:
        hf_raise_for_status(response)
    return raised.value


@pytest.mark.parametrize(
    "name",
    [
        "Qwen/Qwen3-0.6B",
        "meta-llama/Llama-3.1-8B-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "org_1/model.v2",
        "a/b",
    ],
)
def test_repo_ids(name):
    assert hub.looks_like_repo_id(name)


@pytest.mark.parametrize(
    "name",
    [
        "model",
        "a/b/c",
        "./a/b",
        "/abs/path",
        "~/a",
        "a--b/c",
        "a/b..c",
        "a/b.git",
        "-a/b",
        "a/b-",
        "a/.b",
        "a /b",
        "ünï/code",
        "",
        "a/" + "b" * 97,
    ],
)
def test_not_repo_ids(name):
    assert not hub.looks_like_repo_id(name)


def test_an_existing_path_is_not_a_repo_id(tmp_path, monkeypatch):
    (tmp_path / "models" / "llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not hub.looks_like_repo_id("models/llama") and hub.looks_like_repo_id("models/mistral")


def test_offline_serves_the_cached_snapshot_and_a_revision(offline_cache):
    repo = cache_repo(
        offline_cache, "org/name", {COMMIT_1: WEIGHTS, COMMIT_2: WEIGHTS}, refs={"main": COMMIT_1, "v2": COMMIT_2}
    )
    path = hub.download_model("org/name")
    assert path == str(repo / "snapshots" / COMMIT_1)
    assert json.load(open(os.path.join(path, "config.json")))["architectures"] == ["LlamaForCausalLM"]
    assert hub.download_model("org/name", revision=COMMIT_2) == str(repo / "snapshots" / COMMIT_2)
    assert hub.download_model("org/name", revision="v2") == str(repo / "snapshots" / COMMIT_2)  # a tag: refs/v2


def test_offline_download_dir_is_the_cache(offline_cache, tmp_path):
    other = tmp_path / "elsewhere"
    repo = cache_repo(other, "org/name", {COMMIT_2: WEIGHTS}, refs={"main": COMMIT_2})
    assert hub.download_model("org/name", download_dir=str(other)) == str(repo / "snapshots" / COMMIT_2)
    with pytest.raises(ModelLoadError, match="not in the local cache"):
        hub.download_model("org/name")  # not in the default cache


def test_offline_and_not_cached_says_so(offline_cache):
    cache_repo(offline_cache, "org/name", {COMMIT_1: WEIGHTS}, refs={"main": COMMIT_1})
    with pytest.raises(ModelLoadError) as err:
        hub.download_model("org/missing")
    message = str(err.value)
    assert "HF_HUB_OFFLINE is set" in message and "org/missing is not in the local cache" in message
    assert str(offline_cache) in message and "network access" in message
    with pytest.raises(ModelLoadError, match="at revision 'nope' is not in the local cache"):
        hub.download_model("org/name", revision="nope")


def test_offline_snapshot_without_safetensors(offline_cache):
    cache_repo(offline_cache, "org/name", {COMMIT_1: {"config.json": "{}"}}, refs={"main": COMMIT_1})
    with pytest.raises(ModelLoadError, match="no safetensors weights .*could not be read: offline"):
        hub.download_model("org/name")


def test_a_fresh_process_reads_hf_hub_offline_and_hf_home(tmp_path):
    """The environment as a user sets it, read by huggingface_hub at import."""
    repo = cache_repo(tmp_path / "hub", "org/name", {COMMIT_1: WEIGHTS}, refs={"main": COMMIT_1})
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = "from jaxserve.loading.hub import download_model; print(download_model('org/name'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(repo / "snapshots" / COMMIT_1)


def test_hub_unreachable_and_not_cached(tmp_path, monkeypatch):
    """The real library against a closed port: its connection error, then our message."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ModelLoadError) as err:
        hub.download_model("org/name", download_dir=str(tmp_path / "hub"))
    message = str(err.value)
    assert "cannot reach the Hugging Face Hub (ConnectError" in message and "not in the local cache" in message
    assert "HF_HUB_OFFLINE=1" in message


class FakeDownload:
    """snapshot_download stubbed: records its arguments and returns a snapshot directory (or raises)."""

    def __init__(self, tmp_path, files=WEIGHTS, error=None):
        self.calls, self.error = [], error
        self.path = tmp_path / "snapshot"
        self.path.mkdir(exist_ok=True)
        for name, text in files.items():
            (self.path / name).write_text(text)

    def __call__(self, repo_id, **kwargs):
        self.calls.append((repo_id, kwargs))
        if self.error is not None:
            raise self.error
        return str(self.path)


@pytest.fixture
def online(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def stub(**kwargs):
        fake = FakeDownload(**kwargs)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
        return fake

    return stub


def test_download_asks_for_the_files_the_engine_reads(online, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # huggingface_hub's own handling: nothing passed for it
    fake = online(tmp_path=tmp_path)
    assert hub.download_model("org/name", revision="v1.0", download_dir="/cache") == str(fake.path)
    [(repo_id, kwargs)] = fake.calls
    assert repo_id == "org/name" and kwargs["revision"] == "v1.0" and kwargs["cache_dir"] == "/cache"
    assert "token" not in kwargs
    allowed = set(kwargs["allow_patterns"])
    for pattern in (
        "config.json",
        "*.safetensors",
        "*.safetensors.index.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "chat_template.json",
        "generation_config.json",
    ):
        assert pattern in allowed
    assert not any(p.endswith((".bin", ".pt", ".pth", ".gguf", "*")) for p in allowed)
    # What those patterns select from a repository (huggingface_hub's own filter).
    from huggingface_hub.utils import filter_repo_objects

    repo = [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "generation_config.json",
        "README.md",
        ".gitattributes",
        "pytorch_model.bin",
        "consolidated.safetensors",
        "original/consolidated.00.pth",
        "onnx/model.safetensors",
        "params.json",
    ]
    chosen = list(
        filter_repo_objects(repo, allow_patterns=kwargs["allow_patterns"], ignore_patterns=kwargs["ignore_patterns"])
    )
    assert chosen == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "generation_config.json",
    ]
    online(tmp_path=tmp_path)
    hub.download_model("org/name")
    assert huggingface_hub.snapshot_download.calls[0][1]["revision"] is None  # main
    assert huggingface_hub.snapshot_download.calls[0][1]["cache_dir"] is None  # huggingface_hub's cache


@pytest.mark.parametrize(
    "status, code, message, expected",
    [
        (404, "RepoNotFound", None, ["no model 'org/name' on the Hugging Face Hub", "spelling", "private", "HF_TOKEN"]),
        (401, None, None, ["no model 'org/name'", "HF_TOKEN"]),  # the Hub's answer for a private repo without a token
        (401, None, "Invalid credentials in Authorization header", ["refused the token", "HF_TOKEN", "invalid"]),
        (403, "GatedRepo", None, ["gated model", "accept its licence", "https://huggingface.co/org/name", "HF_TOKEN"]),
        (
            404,
            "RevisionNotFound",
            None,
            ["no revision 'v9'", "https://huggingface.co/org/name/tree/main", "drop --revision"],
        ),
        (500, None, None, ["Hugging Face Hub failed for org/name (HTTP 500)"]),
    ],
)
def test_hub_errors_say_what_to_do(online, tmp_path, status, code, message, expected):
    error = hub_error(status, code, message)
    online(tmp_path=tmp_path, error=error)
    with pytest.raises(ModelLoadError) as err:
        hub.download_model("org/name", revision="v9")
    for text in expected:
        assert text in str(err.value)


def test_gated_is_told_apart_from_not_found(online, tmp_path):
    error = hub_error(403, "GatedRepo")
    assert isinstance(error, huggingface_hub.errors.RepositoryNotFoundError)  # GatedRepoError's base class
    online(tmp_path=tmp_path, error=error)
    with pytest.raises(ModelLoadError, match="gated"):
        hub.download_model("org/name")


def test_connection_failure_as_snapshot_download_raises_it(online, tmp_path):
    cause = httpx.ConnectError("[Errno -3] Temporary failure in name resolution")
    try:
        raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub") from cause
    except LocalEntryNotFoundError as error:
        online(tmp_path=tmp_path, error=error)
    with pytest.raises(ModelLoadError) as err:
        hub.download_model("org/name", download_dir=str(tmp_path / "c"))
    message = str(err.value)
    assert "cannot reach the Hugging Face Hub (ConnectError: [Errno -3]" in message
    assert f"not in the local cache ({tmp_path / 'c'})" in message and "HF_HUB_OFFLINE=1" in message


@pytest.mark.parametrize(
    "listed, expected",
    [
        (
            ["config.json", "qwen2.5-0.5b-instruct-q4_k_m.gguf", "qwen2.5-0.5b-instruct-q8_0.gguf"],
            [
                "holds GGUF files, not safetensors",
                "hf download org/name qwen2.5-0.5b-instruct-q4_k_m.gguf",
                "pass that .gguf file as the model",
            ],
        ),
        (
            ["config.json", "pytorch_model.bin", "tokenizer.json"],
            [
                "only pickle weights (pytorch_model.bin)",
                "unpickling runs code",
                "--revision refs/pr/N",
                "safe_serialization=True",
            ],
        ),
        (["params.json", "consolidated.safetensors"], ["Mistral's own checkpoint format"]),
        (["README.md"], ["no safetensors weights"]),
    ],
)
def test_repos_without_safetensors(online, tmp_path, monkeypatch, listed, expected):
    online(tmp_path=tmp_path, files={"config.json": "{}", "tokenizer.json": "{}"})
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, revision=None: listed)
    with pytest.raises(ModelLoadError) as err:
        hub.download_model("org/name")
    for text in expected:
        assert text in str(err.value)


def test_safetensors_without_config(online, tmp_path):
    online(tmp_path=tmp_path, files={"model.safetensors": "x"})
    with pytest.raises(ModelLoadError, match="no config.json"):
        hub.download_model("org/name")


def test_no_jax_here():
    code = "import sys, jaxserve.loading.hub; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
