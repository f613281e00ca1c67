"""The README's research example runs as written."""

import pathlib
import re


def test_readme_step_api_example_runs(capsys):
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    example = next(b for b in blocks if "steps.decode" in b)
    exec(compile(example, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("greedy: [")
    assert len(out.split(",")) == 11  # 11 generated tokens


def test_readme_ragged_step_example_runs_and_matches_the_rectangle_steps(capsys):
    """The ragged-step block, run after the step-API block it continues: its two rows' logits equal
    what the rectangle steps give for the same rows alone (a's token decoded, c's prompt prefilled):
    the rows laid out by the host packer and by the steps' own layout on the device agree."""
    import jax.numpy as jnp
    import numpy as np

    from jaxserve import steps
    from jaxserve.model.kv_cache import StepBatch

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    first = next(b for b in blocks if "steps.decode" in b)
    ragged = next(b for b in blocks if "steps.ragged" in b)
    scope: dict = {}
    exec(compile(first, "README.md", "exec"), scope)
    exec(compile(ragged, "README.md", "exec"), scope)
    assert capsys.readouterr().out.splitlines()[-1].startswith("mixed step: [")
    params, cfg, cache, pages, tokens = (scope[k] for k in ("params", "cfg", "cache", "pages", "tokens"))
    MAX_PAGES = scope["MAX_PAGES"]
    # The same rows through the rectangle steps, on the cache the ragged step wrote (rewriting a
    # token's K/V writes the same values, so the logits must agree).
    decode = StepBatch.build([[tokens[-1]]], [len(tokens) - 1], [pages.page_table("a")], max_pages=MAX_PAGES)
    prefill = StepBatch.build([scope["prompt_c"]], [0], [pages.page_table("c")], chunk=8, max_pages=MAX_PAGES)
    expect_a, _ = steps.decode_nodonate(params, cache, decode, cfg=cfg)
    expect_c, _ = steps.prefill_nodonate(params, cache, prefill, cfg=cfg)
    got = np.asarray(scope["logits"])
    np.testing.assert_allclose(got[0, 0], np.asarray(expect_a[0, 0]), atol=1e-5)
    np.testing.assert_allclose(got[0, 1], np.asarray(expect_c[0, 0]), atol=1e-5)
    assert int(jnp.argmax(expect_c[0, 0])) == int(jnp.argmax(got[0, 1]))
