"""LLM.chat: conversations rendered with the server's chat template, then generated as LLM.generate would."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.loading import resources
from jaxserve.errors import RequestError
from jaxserve.server.chat import build_chat_renderer

CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(
        str(resources.small_checkpoint()),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        page_size=8,
        warm_up=False,
    ) as llm:
        yield llm


def test_chat_equals_generate_on_the_rendered_prompt(llm):
    text = build_chat_renderer(llm.tokenizer, llm.config.chat_template).render(CONVERSATION)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    want = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)[0]
    got = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert len(got) == 1 and got[0].prompt == text and got[0].prompt_token_ids == ids
    assert got[0].outputs[0].token_ids == want.outputs[0].token_ids and got[0].outputs[0].text == want.outputs[0].text


def test_chat_takes_a_list_of_conversations_and_the_template_options(llm):
    other = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    both = llm.chat([CONVERSATION, other], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in both] == [
        llm.chat(c, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for c in (CONVERSATION, other)
    ]
    assert "Hi there" in both[1].prompt
    bare = llm.chat(CONVERSATION, GREEDY, add_generation_prompt=False, use_tqdm=False)[0].prompt
    assert both[0].prompt.startswith(bare) and len(bare) < len(both[0].prompt)
    custom = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert llm.chat(CONVERSATION, GREEDY, chat_template=custom, use_tqdm=False)[0].prompt == (
        "[system] You are terse.\n[user] Name a colour.\n"
    )


def test_chat_without_sampling_params_uses_the_generation_defaults(llm):
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0  # the default model's generation_config.json: do_sample false
    got = llm.chat(CONVERSATION, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == llm.chat(CONVERSATION, defaults, use_tqdm=False)[0].outputs[0].token_ids
    assert got.outputs[0].token_ids != []


def test_chat_refuses_bad_input(llm, hf_model_dir):
    with pytest.raises(RequestError, match="role"):
        llm.chat([{"content": "no role"}], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="at least one"):
        llm.chat([], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="text content"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], GREEDY, use_tqdm=False)
    with LLM(hf_model_dir("llama")[0], dtype="float32", max_model_len=64, warm_up=False) as no_tokenizer:
        with pytest.raises(RequestError, match="no tokenizer"):
            no_tokenizer.chat(CONVERSATION, GREEDY, use_tqdm=False)


def test_the_offline_api_imports_no_web_framework():
    import subprocess
    import sys

    code = (
        "import sys, jaxserve.llm, jaxserve.server.chat; "
        "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
