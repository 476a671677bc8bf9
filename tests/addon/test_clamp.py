"""An output cap beyond the model's context (Qwen Code's 32000) is cut to it before the call goes upstream.

A real ``mitmdump`` with the addon in front of the reference server with a small context (``--max-model-len``, which
refuses a larger cap the way vLLM 0.32 does), the official SDKs as clients; tests/vllm/ checks the same on vLLM.
"""

import json

import anthropic
import openai
import pytest

from addon import clamp
from eval.sessions.procs import Mitmdump, ReferenceServer
from tests.captures import read_records

pytestmark = pytest.mark.slow

CONTEXT = 1024
ASKED = 32000  # Qwen Code's max_tokens, whatever the model
SCRIPT = [{"content": "Done.", "tool_calls": []}] * 8
QUESTION = [{"role": "user", "content": "Say done."}]


@pytest.fixture(scope="module")
def small_context(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("small")
    (tmp / "script.json").write_text(json.dumps(SCRIPT))
    with ReferenceServer(
        tiny_model_dir, script=tmp / "script.json", log=tmp / "server.log", max_model_len=CONTEXT
    ) as s:
        yield s


@pytest.fixture(scope="module")
def proxies(small_context, tmp_path_factory):
    """Two proxies in front of it: the addon's default (clamping) and with clamping turned off."""
    started = {}
    for name, options in (("on", {}), ("off", {"polar_clamp_max_tokens": "false"})):
        tmp = tmp_path_factory.mktemp(f"proxy-{name}")
        started[name] = Mitmdump(small_context.url, tmp / "captures", log=tmp / "mitmdump.log", **options)
        started[name].captures = tmp / "captures"
    yield started
    for mitm in started.values():
        mitm.stop()


def openai_client(proxy, session):
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=session, max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_call_asking_beyond_the_context_is_clamped_and_answered(proxies, stream, field):
    session = f"chat-{field}-{stream}"
    answer = openai_client(proxies["on"], session).chat.completions.create(
        model="tiny", messages=QUESTION, stream=stream, **{field: ASKED}
    )
    text = (
        "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        if stream
        else answer.choices[0].message.content
    )
    assert text == "Done."
    (record,) = read_records(proxies["on"].captures, session=session, expect=1)
    assert record["status"] == 200 and record["clamped"] == {"field": field, "asked": ASKED, "sent": CONTEXT}
    assert record["request"][field] == ASKED and record["upstream_request"][field] == CONTEXT
    assert record["upstream_request"]["messages"] == QUESTION and record["upstream_request"]["logprobs"] is True


def test_a_cap_within_the_context_goes_as_sent(proxies):
    openai_client(proxies["on"], "within").chat.completions.create(model="tiny", messages=QUESTION, max_tokens=CONTEXT)
    (record,) = read_records(proxies["on"].captures, session="within", expect=1)
    assert record["clamped"] is None and record["upstream_request"] is None  # only the token fields were added


@pytest.mark.parametrize("stream", [False, True])
def test_a_translated_anthropic_call_is_clamped_too(proxies, stream):
    client = anthropic.Anthropic(base_url=proxies["on"].url, api_key="anthropic-clamp", max_retries=0, timeout=120)
    kwargs = {"model": "tiny", "max_tokens": ASKED, "messages": QUESTION}
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.content[0].text == "Done."
    record = read_records(proxies["on"].captures, session="anthropic-clamp", expect=1 + stream)[-1]
    assert record["translated"] and record["request"]["max_tokens"] == ASKED
    assert record["clamped"] == {"field": "max_tokens", "asked": ASKED, "sent": CONTEXT}


def test_without_clamping_the_upstream_refuses_the_cap(proxies):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(proxies["off"], "unclamped").chat.completions.create(
            model="tiny", messages=QUESTION, max_tokens=ASKED
        )
    assert f"cannot be greater than max_model_len={CONTEXT}" in refused.value.body["message"]
    (record,) = read_records(proxies["off"].captures, session="unclamped", expect=1)
    assert record["status"] == 400 and record["clamped"] is None


def test_a_refusal_that_names_the_context_teaches_it():
    lengths = clamp.ContextLengths()
    url = "http://127.0.0.1:1/v1/models"  # nothing listens: the list cannot be asked for
    assert lengths.length(url, "m", {}, verify=True) is None
    lengths.learn(url, "m", "max_tokens=32000 cannot be greater than max_model_len=2048. Please request fewer")
    assert lengths.length(url, "m", {}, verify=True) == 2048
    lengths.learn(url, "other", "This model's maximum context length is 4096 tokens.")  # names no cap rule
    assert lengths.length(url, "other", {}, verify=True) == 2048  # one length known for this upstream: it


@pytest.mark.parametrize(
    ("url", "models"),
    [
        ("http://h:8000/v1/chat/completions", "http://h:8000/v1/models"),
        ("http://h/prefix/v1/chat/completions/?x=1", "http://h/prefix/v1/models"),
    ],
)
def test_the_models_list_is_asked_beside_the_chat_endpoint(url, models):
    assert clamp.models_url(url) == models


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": 5}, "max_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": 7}, "max_completion_tokens"),
        ({"max_tokens": True}, None),
        ({"max_tokens": "5"}, None),
        ([], None),
    ],
)
def test_the_cap_field_is_the_one_vllm_reads(body, field):
    assert clamp.cap_field(body) == field
