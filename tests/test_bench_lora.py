"""scripts/bench_lora.py on a tiny random Llama: the adapters it writes are PEFT directories the engine
reads as written (A = lora_A.T, B = lora_B.T), its bytes arithmetic is lora_bytes', and a tiny run
reports every variant with the LoRA-off rows equal to the base. No timing assertions."""

import json
import math
import os

import bench_lora as bl
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.lora.peft_adapter import _read_safetensors, load_peft_adapter
from jaxserve.lora.peft_adapter import lora_stack_bytes as lora_bytes


def test_written_adapter_loads_as_peft_would(hf_model_dir, tmp_path):
    model_dir, _ = hf_model_dir("llama")
    cfg = ModelConfig.from_dir(model_dir)
    path = bl.write_peft_adapter(str(tmp_path / "a"), cfg, rank=4, modules=("q", "v", "down"), seed=3)
    adapter = load_peft_adapter(path, cfg, max_rank=8)
    assert adapter.rank == 4 and adapter.scaling == 1.0 and adapter.target_modules == ("q", "v", "down")
    tensors = _read_safetensors(os.path.join(path, "adapter_model.safetensors"))
    assert len(tensors) == 2 * 3 * cfg.num_layers
    a = tensors[f"base_model.model.model.layers.{cfg.num_layers - 1}.mlp.down_proj.lora_A.weight"]
    b = tensors[f"base_model.model.model.layers.{cfg.num_layers - 1}.mlp.down_proj.lora_B.weight"]
    np.testing.assert_array_equal(adapter.modules["down"][0][-1], a.T)
    np.testing.assert_array_equal(adapter.modules["down"][1][-1], b.T)


def test_bytes_rows_are_lora_bytes_against_the_weights_a_step_reads():
    cfg = ModelConfig.from_dir(os.path.join(bl.ROOT, "configs", "models", "llama3-8b"))
    rows = bl.bytes_rows(cfg, 2, points=((4, 16), (8, 64)))
    table = cfg.vocab_size * cfg.hidden_size * 2  # untied: a step only gathers rows of the embedding table
    assert [r["lora_bytes"] for r in rows] == [lora_bytes(cfg, 4, 16, 2), lora_bytes(cfg, 8, 64, 2)]
    assert rows[0]["lora_bytes"] == 32 * 4 * 16 * 2 * (2 * 4096 + 2 * (4096 + 1024) + 2 * 4096 + 3 * (4096 + 14336))
    assert rows[0]["base_bytes"] == cfg.param_bytes(2) - table
    assert rows[1]["fraction"] == pytest.approx(rows[1]["lora_bytes"] / rows[1]["base_bytes"])


def test_tiny_run_reports_every_variant(hf_model_dir, tmp_path):
    model_dir, _ = hf_model_dir("llama")
    out = tmp_path / "report.json"
    report = bl.main(
        [
            "--model",
            model_dir,
            "--batch-sizes",
            "3",
            "--adapters",
            "2",
            "--rank",
            "4",
            "--tokens",
            "3",
            "--prompt-len",
            "5",
            "--repeats",
            "1",
            "--std",
            "0.2",
            "--modules",
            "q,v,down",
            "--bytes-model",
            "",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["results"] == report["results"]
    rows = {r["variant"]: r for r in report["results"]}
    assert list(rows) == ["base", "lora-off", "2 adapters", "1 adapter"]
    assert rows["lora-off"]["equal_to_base"] == 1.0  # zero stacks change nothing
    assert rows["2 adapters"]["equal_to_base"] < 1.0  # random adapters do move the tokens
    # a figure for each (its sign is noise on a tiny model: (3-token - 1-token time) / 2 on busy cores)
    assert all(math.isfinite(r["step_ms"]) and r["batch"] == 3 for r in rows.values())
    # the stacks hold every adaptable module, not only the three the adapters target
    assert report["bytes"]["stacked_modules"] == ["q", "k", "v", "o", "gate", "up", "down"]
    assert report["bytes"]["lora_stacks"] == lora_bytes(ModelConfig.from_dir(model_dir), 2, 4, 4)
    assert "| 3 | 2 adapters |" in bl.markdown(report)


def test_bad_arguments_exit_before_any_run():
    for bad in (["--modules", "q,lm_head"], ["--tokens", "1"], ["--adapters", "4", "--max-loras", "2"]):
        with pytest.raises(SystemExit):
            bl.parse_args(bad)
