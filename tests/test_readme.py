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
