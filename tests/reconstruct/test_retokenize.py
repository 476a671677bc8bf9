"""reconstruct/_retokenize.py: rebuilding ids with the chat template; the end-of-turn token."""

import json

import pytest
from transformers import AutoTokenizer

from reconstruct import RetokenizeError
from reconstruct._retokenize import Retokenizer, detect_eot, parse_eot
from tests.reconstruct.conftest import oracle

pytestmark = pytest.mark.slow  # the captures fixture: a reference server and two mitmdumps


@pytest.fixture(scope="module")
def tokenizer(captures):
    return AutoTokenizer.from_pretrained(captures.model_dir)


def test_every_captured_call_retokenizes_to_what_the_server_tokenized(captures, tokenizer):
    """The reference server renders and encodes like vLLM: rebuilding from messages alone gives its ids back,
    the truncated max_tokens turn included (its end-of-turn left out, as it was never sampled)."""
    r = Retokenizer(tokenizer)
    checked = 0
    for record in captures.records():
        if record["upstream"] != "vllm":
            continue
        prompt, ids, _ = oracle(record)
        body = record["request"]
        answer = json.loads(record["response_body"])["choices"][0]["message"] if not record["streamed"] else None
        assert r.prompt_ids(body["messages"], body.get("tools"), None) == prompt
        if answer is not None:
            finish = json.loads(record["response_body"])["choices"][0]["finish_reason"]
            rebuilt = r.output_ids(body["messages"], body.get("tools"), None, answer, finish)
            if finish == "length":  # the template closes the cut "<think>": only the usage count can trim it
                assert rebuilt[: len(ids)] == ids and len(rebuilt) > len(ids)
            else:
                assert rebuilt == ids
            checked += 1
    assert checked >= 10


def test_end_of_turn_token(tokenizer):
    assert detect_eot(tokenizer) == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert parse_eot("<|im_end|>", tokenizer) == 2 and parse_eot("151645", None) == 151645
    with pytest.raises(RetokenizeError, match="not a token"):
        parse_eot("<|no such token|>", tokenizer)
    with pytest.raises(RetokenizeError, match="--tokenizer"):
        parse_eot("<|im_end|>", None)


def test_templates_that_cannot_render_are_errors(captures, tokenizer):
    raising = AutoTokenizer.from_pretrained(captures.model_dir)
    raising.chat_template = "{{ raise_exception('this template wants other roles') }}"
    assert detect_eot(raising) == tokenizer.eos_token_id  # falls back to EOS
    with pytest.raises(RetokenizeError, match=r"cannot render.*other roles"):
        Retokenizer(raising).prompt_ids([{"role": "user", "content": "hi"}], None, None)
    rewriting = AutoTokenizer.from_pretrained(captures.model_dir)
    rewriting.chat_template = (
        "{% for m in messages %}{{ m.role }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    with pytest.raises(RetokenizeError, match="extension"):
        Retokenizer(rewriting, eot_id=2).output_ids([{"role": "user"}], None, None, {"role": "assistant"}, "stop")
