"""`python -m jaxserve.compare_hf`: passes on a correct tiny model, fails on a perturbed one, clear errors."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.compare_hf import Tolerances, compare, compare_logits, main, read_prompts

# Every run here shares these shapes (page 8, full lengths 9 and 15), so the steps compile once.
PROMPTS = [[3, 141, 59, 26, 5], [500, 2, 71, 82, 81, 8, 28, 18, 284, 59, 45]]
OPTS = dict(max_new_tokens=4, page_size=8)
NUM_POSITIONS = (9 + 4) + (15 + 4)  # every prefill position, then every decode step


def test_cli_passes_on_correct_model(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("llama")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"ids: {', '.join(map(str, p))}\n" for p in PROMPTS))
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.compare_hf", path, "--prompts", str(prompts), "--max-new-tokens", "4",
         "--page-size", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "overall: PASS" in proc.stdout
    report = json.loads(out.read_text())
    assert report["passed"] and [p["prompt"] for p in report["prompts"]] == PROMPTS
    positions = [q for p in report["prompts"] for q in p["positions"]]
    assert len(positions) == NUM_POSITIONS
    assert sum(q["phase"] == "decode" for q in positions) == 2 * 4
    assert max(q["max_abs"] for q in positions) < 1e-4  # measured ~2e-5


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
    assert {q.phase for q in failed} == {"prefill", "decode"}
    assert all("logits" in q.status for q in failed)


def test_compare_logits_classifies_near_ties():
    tol = Tolerances(atol=1.0, kl=1.0, tie_gap=1e-3)
    ref = np.array([[2.0, 2.0005, 0.0], [2.0, 2.5, 0.0], [2.0, 3.0, 0.0]])
    ours = np.array([[2.0005, 2.0, 0.0], [2.5, 2.0, 0.0], [2.0, 3.0, 0.0]])
    got = compare_logits("prefill", 7, ours, ref, tol)
    assert [q.status for q in got] == ["near-tie", "FAIL (greedy)", "ok"]
    assert [q.pos for q in got] == [7, 8, 9] and got[2].kl == 0.0
    # Relative (bfloat16) bounds scale with the position's largest |logit|: 0.5 is a tie next to 100.
    rel = Tolerances(atol=0.01, kl=1.0, tie_gap=0.01, relative=True)
    got = compare_logits("decode", 0, np.array([[100.0, 99.5, 0.0]]), np.array([[99.5, 100.0, 0.0]]), rel)
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


def test_argparse_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        main(["some_dir", "--dtype", "float64"])
    assert exc.value.code == 2
