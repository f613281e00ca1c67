"""`python -m jaxserve.compare_hf`: passes on a correct tiny model, fails on a perturbed one, clear errors;
its scores are the server's, from the same executables."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.compare_hf import Tolerances, build_llm, compare, compare_scores, engine_scores, main, read_prompts

# Full lengths 9 and 15 (prompt + 4 HF tokens); the engines' small settings keep their buckets few.
PROMPTS = [[3, 141, 59, 26, 5], [500, 2, 71, 82, 81, 8, 28, 18, 284, 59, 45]]
ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)
OPTS = dict(max_new_tokens=4, page_size=8, **ENGINE)
NUM_POSITIONS = (9 + 4) + (15 + 4)  # every scored position, then every generated token


def test_cli_passes_on_correct_model(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("llama")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"ids: {', '.join(map(str, p))}\n" for p in PROMPTS))
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxserve.compare_hf",
            path,
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "4",
            "--page-size",
            "8",
            "--json",
            str(out),
            *(f"--setting={k}={v}" for k, v in ENGINE.items()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "overall: PASS" in proc.stdout
    report = json.loads(out.read_text())
    assert report["passed"] and [p["prompt"] for p in report["prompts"]] == PROMPTS
    positions = [q for p in report["prompts"] for q in p["positions"]]
    assert len(positions) == NUM_POSITIONS
    assert sum(q["phase"] == "generate" for q in positions) == 2 * 4
    assert max(q["max_abs"] for q in positions) < 1e-4  # measured ~1e-5
    # The server's layout on CPU: per-layer weights (not stacked), the reference attention.
    assert report["engine"]["layers"] == "per-layer" and report["engine"]["attention"] == "reference"
    assert report["engine"]["max_model_len"] == ENGINE["max_model_len"]  # --setting reached the engine


def _perturbed_copy(src, dst, name, scale):
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    tensors[name] = (tensors[name] * scale).astype(tensors[name].dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    return str(dst)


def test_perturbed_weight_fails(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("llama")
    # HF reads the original (reference_dir): with both sides on the edited copy nothing would differ.
    bad_dir = _perturbed_copy(path, tmp_path / "bad", "model.layers.1.mlp.down_proj.weight", 1.05)
    bad = compare(bad_dir, PROMPTS, reference_dir=path, **OPTS)
    assert not bad.passed and not any(p.passed for p in bad.prompts)
    failed = [q for p in bad.prompts for q in p.positions if q.status.startswith("FAIL")]
    assert {q.phase for q in failed} == {"score", "generate"}
    assert all("logprobs" in q.status for q in failed)


def test_compare_scores_classifies_near_ties_and_missing_top_ids():
    tol = Tolerances(atol=1.0, kl=1.0, tie_gap=1e-3)
    ref = np.array([[2.0, 2.0005, 0.0], [2.0, 2.5, 0.0], [2.0, 3.0, 0.0]])
    lp = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    # ours: the top-1 ids (with their HF logprobs), the first two swapped against HF's order
    ours = [{0: lp[0, 1], 1: lp[0, 0]}, {0: lp[1, 1], 1: lp[1, 0]}, {1: lp[2, 1]}]
    got = compare_scores("score", 7, ours, [1, 0, 1], ref, tol, top_n=1)
    assert [q.status for q in got] == ["near-tie", "FAIL (greedy)", "ok"]
    assert [q.pos for q in got] == [7, 8, 9] and got[2].kl == 0.0 and got[2].logprob == pytest.approx(got[2].hf_logprob)
    # Generate: our argmax is the token the engine chose; a logprob off by 2 fails; HF's top-1 absent fails.
    got = compare_scores("generate", 0, [{1: lp[2, 1] - 2}, {2: lp[2, 2]}], [1, 2], ref[[2, 2]], tol, top_n=1)
    assert got[0].status == "FAIL (logprobs, kl)" and got[1].status == "FAIL (top, greedy)"
    # Relative (bfloat16) bounds scale with the position's largest |logit|: 0.5 is a tie next to 100.
    rel = Tolerances(atol=0.01, kl=1.0, tie_gap=0.01, relative=True)
    ref = np.array([[99.5, 100.0, 0.0]])
    lp = ref - np.log(np.exp(ref - 100).sum(-1, keepdims=True)) - 100
    got = compare_scores("generate", 0, [{0: lp[0, 0], 1: lp[0, 1]}], [0], ref, rel, top_n=2)
    assert got[0].status == "near-tie"


def test_missing_directory_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err


def test_prompts_file_mixes_text_and_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n\nids: 7, 8,9\nworld hello\n")
    assert read_prompts(str(prompts), str(tmp_path)) == [[1, 2], [7, 8, 9], [2, 1]]


def test_text_prompt_without_tokenizer_is_a_clear_error(hf_model_dir, tmp_path, capsys):
    path, _ = hf_model_dir("llama")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ids: 1, 2\nhello world\n")
    assert main([path, "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prompts.txt:2" in err and "no tokenizer" in err


def test_settings_with_flags_of_their_own_are_refused(capsys):
    assert main(["some_dir", "--setting", "dtype=float32"]) == 2
    assert "use --dtype" in capsys.readouterr().err


def test_argparse_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        main(["some_dir", "--dtype", "float64"])
    assert exc.value.code == 2


def test_checker_and_server_return_the_same_scores_from_the_same_executables(hf_model_dir):
    """compare_hf's engine is the server's: the app over that engine answers a completion of the same
    ids with prompt_logprobs and logprobs, and returns exactly compare_hf's scores, compiling nothing."""
    from starlette.testclient import TestClient

    from jaxserve.engine.async_engine import AsyncLLMEngine
    from jaxserve.runner.compilation import CompileCounter
    from jaxserve.server.api import ServerOptions, create_app

    path, _ = hf_model_dir("llama")
    llm = build_llm(path, dtype="float32", page_size=8, **ENGINE)
    report = compare(path, PROMPTS[1:], llm=llm, max_new_tokens=0)  # the scoring executable only: one compile
    assert report.passed and report.engine["layers"] == "per-layer"
    full = report.prompts[0].prompt + report.prompts[0].continuation
    top_n = report.engine["top_n"]
    scores = engine_scores(llm, full, top_n)  # what compare scored: the same values again
    scored = [q for q in report.prompts[0].positions if q.phase == "score"]
    assert [q.logprob for q in scored] == [s[q.token] for s, q in zip(scores, scored)]
    compiles, executables = CompileCounter.requests, llm.engine.num_executables()

    engine = AsyncLLMEngine(llm.engine)
    engine.start()
    try:
        with TestClient(create_app(ServerOptions(served_model_names=("tiny",)), engine)) as client:
            r = client.post(
                "/v1/completions",
                json=dict(
                    model="tiny", prompt=full, max_tokens=1, temperature=0, prompt_logprobs=top_n, logprobs=top_n
                ),
            )
        assert CompileCounter.requests == compiles and llm.engine.num_executables() == executables
    finally:
        engine.shutdown()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    served = [{int(t): v["logprob"] for t, v in e.items()} for e in choice["prompt_logprobs"][1:]]
    assert served == scores[:-1]
    # The sampled token's entry (no tokenizer: tokens are named token_id:N).
    logprobs = choice["logprobs"]
    last = {int(t.removeprefix("token_id:")): lp for t, lp in logprobs["top_logprobs"][0].items()}
    token = int(logprobs["tokens"][0].removeprefix("token_id:"))
    assert last | {token: logprobs["token_logprobs"][0]} == scores[-1]
