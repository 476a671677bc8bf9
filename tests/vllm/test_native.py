"""Anthropic, Responses and Google calls through the proxy to real vLLM, translated (streamed and not) and the
Responses API passed through: the official SDKs take the answers, every record rebuilds with vLLM's own ids."""

import anthropic
import pytest
from google import genai
from google.genai import types
from transformers import AutoTokenizer

from tests.vllm.conftest import MODEL_DIR
from tests.vllm.helpers import SERVED_NAME, openai_client, read_records, rebuild, tokens_of

PROMPT = "Name a primary colour."
BASH = {
    "name": "bash",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    "description": "Run a shell command.",
}


def anthropic_text(proxy, session, *, stream, **kwargs):
    client = anthropic.Anthropic(base_url=proxy.url, api_key=session, max_retries=0, timeout=600)
    kwargs = {"model": "claude-sonnet-4-5", "max_tokens": 16, "temperature": 0, **kwargs}
    kwargs.setdefault("messages", [{"role": "user", "content": PROMPT}])
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    return "".join(block.text for block in message.content if block.type == "text")


def responses_text(proxy, session, *, stream):
    """Streamed, the events themselves: an answer cut by max_output_tokens ends with ``response.incomplete`` (vLLM's
    own stream, passed through: ``response.completed`` with status incomplete), which the SDK's accumulator
    refuses."""
    client = openai_client(proxy, session)
    kwargs = {"model": SERVED_NAME, "input": PROMPT, "max_output_tokens": 16, "temperature": 0}
    if not stream:
        return client.responses.create(**kwargs).output_text
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return events[-1].response.output_text


def google_text(proxy, session, *, stream):
    options = types.HttpOptions(base_url=proxy.url, timeout=600_000, retry_options=types.HttpRetryOptions(attempts=1))
    client = genai.Client(api_key=session, http_options=options)
    config = types.GenerateContentConfig(temperature=0, max_output_tokens=16)
    if stream:
        chunks = client.models.generate_content_stream(model="gemini-2.5-pro", contents=PROMPT, config=config)
        return "".join(c.text or "" for c in chunks)
    return client.models.generate_content(model="gemini-2.5-pro", contents=PROMPT, config=config).text


ASK = {"anthropic": anthropic_text, "responses": responses_text, "google": google_text}


@pytest.mark.parametrize("api", sorted(ASK))
def test_translated_calls_streamed_and_not_carry_vllms_ids(api, proxy, tmp_path):
    session = f"native-{api}"
    whole = ASK[api](proxy, session, stream=False)
    streamed = ASK[api](proxy, session, stream=True)
    assert whole and streamed == whole  # temperature 0: the same answer, assembled by the SDK from events
    records = read_records(proxy.captures, session=session, expect=2)
    assert [(r["api"], r["translated"], r["streamed"]) for r in records] == [(api, True, False), (api, True, True)]
    (p1, a1, l1), (p2, a2, _) = map(tokens_of, records)
    assert p1 == p2 and a1 == a2 and len(l1) == len(a1)
    df, _ = rebuild(proxy.captures, session, tmp_path, calls=2)
    assert df.height == 2 and set(df["token_source"]) == {"captured"} and set(df["api"]) == {api}
    assert df["response_ids"].to_list() == [a1, a1]


def test_translated_tools_render_as_vllm_renders_them(proxy):
    """vLLM re-orders each tool's keys (name, description, parameters) before its chat template; the translator
    sends that order, so the prompt retokenized from the record is token for token the one vLLM sampled from."""
    anthropic_text(proxy, "native-tools", stream=False, tools=[BASH], system="You are a coding agent.")
    (record,) = read_records(proxy.captures, session="native-tools", expect=1)
    sent = record["upstream_request"]
    assert list(sent["tools"][0]["function"]) == ["name", "description", "parameters"]
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    rendered = tokenizer.apply_chat_template(
        sent["messages"], tools=sent["tools"], add_generation_prompt=True, return_dict=False
    )
    assert rendered == tokens_of(record)[0]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_passed_through_carry_vllms_own_ids(stream, proxy_factory, tmp_path):
    """polar_translate=never: the Responses call goes to vLLM's own /v1/responses, which the addon asks for the
    prompt's and the sampled ids (enable_response_messages)."""
    passthrough = proxy_factory(polar_translate="never")
    session = f"passthrough-{stream}"
    assert responses_text(passthrough, session, stream=stream)
    (record,) = read_records(passthrough.captures, session=session, expect=1)
    assert record["api"] == "responses" and not record["translated"] and record["path"].endswith("/v1/responses")
    df, stats = rebuild(passthrough.captures, session, tmp_path, calls=1)
    assert df.height == 1 and df["token_source"][0] == "captured" and len(df["response_ids"][0]) > 0
    assert stats.dropped == {}
