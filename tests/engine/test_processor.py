"""The one way in (`jaxserve.engine.processor`): every request check once, with a fake tokenizer and
limits (no jax), and the same refusal offline and served (the server over the mock engine)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from jaxserve.engine.intake import Abort, Intake
from jaxserve.engine.processor import EngineRequest, Limits, Processor, Prompt, PromptError, claim
from jaxserve.errors import EngineClosedError, RequestError
from jaxserve.sampling.params import SamplingParams
from jaxserve.server.chat import ChatRenderer
from jaxserve.structured import StructuredSpec
from jaxserve.testing.mock_engine import MockAsyncLLMEngine, MockTokenizer, mock_settings

LIMITS = Limits(vocab_size=260, max_model_len=64, page_size=8, usable_pages=6, max_num_seqs=4)


class WordTokenizer:
    """One token per character (its code point mod 256): enough to count a prompt's length."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) % 256 for c in text]


def processor(**limits) -> Processor:
    import dataclasses

    return Processor(dataclasses.replace(LIMITS, **limits), WordTokenizer())


def refusal(call, *args, **kwargs) -> PromptError:
    with pytest.raises(PromptError) as info:
        call(*args, **kwargs)
    return info.value


def test_text_and_ids_become_one_request_with_ids_made_once():
    p = processor()
    params = SamplingParams(max_tokens=4)
    from_text = p.process("a", "hi", params, arrival_time=1.5)
    assert from_text == EngineRequest("a", [1, ord("h"), ord("i")], params, "hi", None, None, 1.5)
    ids = (5, 6, 7)
    from_ids = p.process("b", None, params, ids, lora_request="adapter")
    assert from_ids.prompt_token_ids == [5, 6, 7] and from_ids.prompt is None and from_ids.lora_request == "adapter"
    made = p.prompt(token_ids=[9, 10])
    assert p.process("c", made, params).prompt_token_ids is made.token_ids  # not copied again
    with pytest.raises(AttributeError):
        from_ids.request_id = "other"  # frozen


def test_exactly_one_of_prompt_and_ids_and_a_tokenizer_for_text():
    p = processor()
    assert "exactly one" in str(refusal(p.process, "a"))
    assert "exactly one" in str(refusal(p.process, "a", "text", None, [1]))
    assert "exactly one" in str(refusal(p.process, "a", Prompt([1]), None, [1]))
    bare = Processor(LIMITS)
    err = refusal(bare.process, "a", "text")
    assert err.code == "no_tokenizer" and "no tokenizer" in str(err)
    assert bare.process("a", None, None, [1]).prompt_token_ids == [1]  # ids need none
    assert refusal(bare.chat_prompt, [{"role": "user", "content": "x"}], None).code == "no_tokenizer"


def test_empty_prompt_and_ids_outside_the_vocabulary():
    p = processor()
    err = refusal(p.process, "a", None, None, [])
    assert err.code == "empty_prompt" and "at least one token" in str(err)
    assert "outside the vocabulary [0, 260)" in str(refusal(p.process, "a", None, None, [1, 260]))
    assert "outside the vocabulary" in str(refusal(p.process, "a", None, None, [-1]))
    bias = SamplingParams(logit_bias={300: 1.0})
    assert "logit_bias token id(s) [300]" in str(refusal(p.process, "a", None, bias, [1]))


def test_the_context_length_rule_refuses_prompt_plus_max_tokens_past_max_model_len():
    p = processor(usable_pages=100)
    assert len(p.process("fits", None, SamplingParams(max_tokens=4), [1] * 60).prompt_token_ids) == 60
    err = refusal(p.process, "a", None, SamplingParams(max_tokens=5), [1] * 60)  # 65 > 64: refused, not capped
    assert err.code == "context_length_exceeded"
    assert str(err) == (
        "this model's maximum context length is 64 tokens; the request asks for 65 (60 in the prompt, 5 to generate)"
    )
    assert refusal(p.process, "a", None, SamplingParams(max_tokens=1), [1] * 64).code == "context_length_exceeded"
    # an unset max_tokens' fill (the server's chat): what is left of the context, at least 1
    assert p.room(Prompt([1] * 60)) == 4 and p.room(Prompt([1] * 64)) == 1


def test_pages_n_and_feature_refusals():
    p = processor()  # 6 usable pages of 8 tokens
    assert "needs 7 KV pages" in str(refusal(p.process, "a", None, SamplingParams(max_tokens=30), [1] * 20))
    windowed = processor(sliding_window=8)  # decode pages behind the window are released
    assert windowed.process("a", None, SamplingParams(max_tokens=30), [1] * 20)
    assert "n=5 exceeds max_num_seqs=4" in str(refusal(p.process, "a", None, SamplingParams(n=5), [1]))
    assert "n=4 samples of a 40-token prompt need 8 KV pages" in str(
        refusal(p.process, "a", None, SamplingParams(n=4, max_tokens=1), [1] * 40)
    )
    structured = SamplingParams(structured=StructuredSpec.json_object())
    assert (
        str(refusal(processor(structured_refusal="no grammars here").process, "a", None, structured, [1]))
        == "no grammars here"
    )
    assert "enable_prompt_logprobs" in str(refusal(p.process, "a", None, SamplingParams(prompt_logprobs=1), [1]))
    capped = processor(max_logprobs=2)
    assert "max_logprobs=2 " in str(refusal(capped.process, "a", None, SamplingParams(logprobs=3), [1]))


def test_structured_output_starts_its_grammar_once():
    compiled = []

    def grammars(spec):
        compiled.append(spec)
        future = concurrent.futures.Future()
        future.set_result("grammar")
        return future

    p = Processor(LIMITS, WordTokenizer(), grammars=grammars)
    params = SamplingParams(structured=StructuredSpec.json_object())
    request = p.process("a", None, params, [1])
    assert request.grammar.result() == "grammar" and compiled == [params.structured]
    assert p.process("b", None, SamplingParams(), [1]).grammar is None and len(compiled) == 1


def test_chat_is_rendered_and_tokenized_without_special_tokens():
    p = processor()
    chatml = ChatRenderer(None)
    prompt = p.chat_prompt([{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}], chatml)
    assert prompt.text == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.token_ids == [ord(c) % 256 for c in prompt.text]  # no BOS added: the template writes its own
    assert "role" in str(refusal(p.chat_prompt, [{"content": "x"}], chatml))
    assert "text content" in str(refusal(p.chat_prompt, [{"role": "user", "content": [{"type": "image"}]}], chatml))
    assert "cannot both" in str(
        refusal(p.chat_prompt, [{"role": "user", "content": "x"}], chatml, continue_final_message=True)
    )
    err = refusal(p.chat_prompt, [{"role": "user", "content": "x"}], chatml, chat_template_kwargs={"messages": 1})
    assert err.code == "chat_template_error"


def test_the_engine_state_checks_and_the_typed_intake():
    claim("a", {"b"})
    with pytest.raises(RequestError, match="request id 'a' is already in use"):
        claim("a", {"a"})
    with pytest.raises(EngineClosedError, match="closed"):
        claim("new", (), closed=True)
    intake = Intake()
    add = EngineRequest("a", [1], SamplingParams())
    for item in (add, Abort("a"), EngineRequest("b", [2], SamplingParams())):
        intake.put(item)
    assert intake.take_arrivals() == [add]  # up to the first abort
    assert [type(item) for item in intake.take_all()] == [Abort, EngineRequest]


def test_the_same_refusal_offline_and_served():
    """The mock engine's processor (what the server uses) and one over the same limits (what LLM uses)
    give the same message; the server answers it as a 400 naming the field and the rule."""
    from starlette.testclient import TestClient

    from jaxserve.server.api import ServerOptions, create_app

    engine = MockAsyncLLMEngine(mock_settings(max_model_len=64), token_delay=0.001)
    offline = Processor(engine.limits, MockTokenizer())
    with pytest.raises(PromptError) as info:
        offline.process("x", "x" * 60, SamplingParams(max_tokens=10))
    engine.start()
    with TestClient(create_app(ServerOptions(), engine)) as client:
        r = client.post("/v1/completions", json={"prompt": "x" * 60, "max_tokens": 10})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["message"] == str(info.value) and err["code"] == "context_length_exceeded"
        assert err["param"] == "prompt"
        r = client.post("/v1/completions", json={"prompt": [1, 2, 999], "max_tokens": 2})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "x" * 50, "max_tokens": 10})
        assert r.status_code == 200, r.text

    async def direct():  # the engine's own generate goes through the same processor
        with pytest.raises(PromptError) as again:
            async for _ in engine.generate("y", "x" * 60, SamplingParams(max_tokens=10)):
                pass
        return again.value

    try:
        assert str(asyncio.run(direct())) == str(info.value)
    finally:
        engine.shutdown()
