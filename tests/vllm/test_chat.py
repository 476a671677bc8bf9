"""Chat Completions through the proxy to real vLLM: token-faithful records, multi-turn sessions, and what vLLM
does that the reference server did not (issue 15): constrained decoding, text swallowed from a stream,
an output cap beyond the context."""

import json

import openai
import pytest
from transformers import AutoTokenizer

from addon import clamp
from eval.upstream.vllm import MAX_MODEL_LEN
from reconstruct._extract import CONSTRAINED
from tests.vllm.conftest import MODEL_DIR
from tests.vllm.helpers import SERVED_NAME, TOOLS, openai_client, read_records, rebuild, tokens_of

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def ask(client, messages, *, stream, **kwargs):
    """The assistant message as the SDK assembles it, streamed or not."""
    kwargs = {"model": SERVED_NAME, "messages": messages, "max_tokens": 24, "temperature": 0, **kwargs}
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message
    text, calls = [], {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                calls.setdefault(call.index, []).append(call)
    return "".join(text), calls


def test_streamed_and_not_record_the_same_tokens_as_the_chat_template_renders(proxy, tokenizer, tmp_path):
    client = openai_client(proxy, "chat-plain")
    whole = ask(client, QUESTION, stream=False)
    streamed, _ = ask(client, QUESTION, stream=True)
    assert streamed == whole.content and whole.content
    plain, stream = read_records(proxy.captures, session="chat-plain", expect=2)
    assert [plain["streamed"], stream["streamed"]] == [False, True]
    (p1, a1, l1), (p2, a2, l2) = tokens_of(plain), tokens_of(stream)
    assert p1 == p2 == tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    assert a1 == a2 and len(l1) == len(a1) and max(abs(x - y) for x, y in zip(l1, l2, strict=True)) < 1e-4
    df, stats = rebuild(proxy.captures, "chat-plain", tmp_path, calls=2)
    # Two identical prompts: siblings, each its own trace, trainable tokens exactly the sampled ids.
    assert df.height == 2 and stats.breaks["sibling"] == 1
    for row in df.iter_rows(named=True):
        assert row["prompt_ids"] == p1 and row["response_ids"] == a1 and row["loss_mask"] == [1] * len(a1)
        assert row["logprobs"] == pytest.approx(l1, abs=1e-4)


def test_a_multi_turn_session_merges_into_one_trace(proxy, tmp_path):
    client = openai_client(proxy, "chat-turns")
    messages = list(QUESTION)
    for follow_up in ("And of Italy?", "And of Spain?"):
        answer = ask(client, messages, stream=True, max_tokens=16)[0]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
    ask(client, messages, stream=False, max_tokens=16)
    records = read_records(proxy.captures, session="chat-turns", expect=3)
    df, stats = rebuild(proxy.captures, "chat-turns", tmp_path, calls=3)
    # A turn cut by max_tokens re-renders the same (the template adds <|im_end|>): exact edges, one trace.
    assert df.height == 1 and df["n_calls"][0] == 3 and stats.breaks == dict.fromkeys(stats.breaks, 0)
    row = df.row(0, named=True)
    sampled = [i for m, i in zip(row["loss_mask"], row["response_ids"], strict=True) if m]
    assert sampled == [i for r in records for i in tokens_of(r)[1]]


def test_tool_use_over_turns_with_a_forced_call_drops_its_log_probs(proxy, tmp_path):
    """tool_choice "required" makes vLLM decode under a grammar: forced tokens come back with log-prob 0.0, so the
    record lists the constraint and reconstruction hands the trainer null log-probs for that trace."""
    client = openai_client(proxy, "chat-tools")
    messages = [{"role": "user", "content": "List the files in the current directory."}]
    first = client.chat.completions.create(
        model=SERVED_NAME, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=48, temperature=0
    ).choices[0]
    assert first.finish_reason in ("tool_calls", "stop") and first.message.tool_calls
    call = first.message.tool_calls[0]
    assert call.function.name == "bash" and isinstance(json.loads(call.function.arguments), dict)
    messages += [
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "README.md\nsetup.py"},
    ]
    ask(client, messages, stream=True, tools=TOOLS, max_tokens=24)  # auto: free decoding again
    forced, free = read_records(proxy.captures, session="chat-tools", expect=2)
    assert forced["constrained"] == ["tool_choice"] and free["constrained"] == []
    df, stats = rebuild(proxy.captures, "chat-tools", tmp_path, calls=2)
    assert stats.notes.get(CONSTRAINED) == 1
    first_trace = df.filter(df["exchange_ids"].list.first() == forced["id"]).row(0, named=True)
    assert first_trace["logprobs"] is None  # the trainer recomputes them
    # vLLM's forced arguments come back re-serialised, so the next prompt renders the call differently.
    assert stats.traces == 2 and stats.breaks["drift"] == 1


def test_structured_output_is_marked_constrained(proxy, tmp_path):
    client = openai_client(proxy, "chat-schema")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    answer = client.chat.completions.create(
        model=SERVED_NAME,
        messages=QUESTION,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        max_tokens=24,
        temperature=0,
    )
    assert answer.choices[0].message.content.lstrip().startswith("{")
    (record,) = read_records(proxy.captures, session="chat-schema", expect=1)
    assert record["constrained"] == ["response_format"]
    df, stats = rebuild(proxy.captures, "chat-schema", tmp_path, calls=1)
    assert df["logprobs"][0] is None and stats.notes.get(CONSTRAINED) == 1


def test_text_the_tool_parser_swallows_is_a_classified_break(proxy, tmp_path):
    """vLLM's hermes parser holds back text from ``<tool_call`` on; when no call parses, a streamed client never
    sees it (empty deltas while token ids flow). The harness sends back what it saw, the next prompt renders a
    different turn than was sampled, and reconstruction names the break ``swallowed_text``, not plain drift."""
    client = openai_client(proxy, "chat-swallowed")
    messages = [{"role": "user", "content": "Repeat exactly this text: <tool_call> oops"}]
    seen, calls = ask(client, messages, stream=True, tools=TOOLS)
    assert not calls
    (record,) = read_records(proxy.captures, session="chat-swallowed", expect=1)
    sampled = tokens_of(record)[1]
    whole = (  # another session: a sibling of the streamed call would take the next call's parent slot
        openai_client(proxy, "chat-swallowed-whole")
        .chat.completions.create(model=SERVED_NAME, messages=messages, tools=TOOLS, max_tokens=24, temperature=0)
        .choices[0]
    )
    assert len(seen) < len(whole.message.content or "")  # the stream lost text the non-streamed answer has
    messages += [{"role": "assistant", "content": seen}, {"role": "user", "content": "Thanks."}]
    ask(client, messages, stream=True, tools=TOOLS, max_tokens=8)
    assert sampled
    _, stats = rebuild(proxy.captures, "chat-swallowed", tmp_path, calls=2)
    assert stats.breaks["swallowed_text"] == 1 and stats.breaks["drift"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_cap_beyond_the_context_is_clamped_not_refused(proxy, proxy_factory, stream):
    """Qwen Code asks max_tokens 32000 of any model. vLLM refuses a cap beyond the whole context; the addon cuts it
    to max_model_len (from vLLM's /v1/models) and vLLM cuts it further to the room the prompt leaves."""
    session = f"chat-clamp-{stream}"
    answer = ask(openai_client(proxy, session), QUESTION, stream=stream, max_tokens=32000)
    assert (answer[0] if stream else answer.content).strip()
    (record,) = read_records(proxy.captures, session=session, expect=1)
    assert record["status"] == 200 and record["clamped"] == {"field": "max_tokens", "asked": 32000, "sent": 2048}
    assert record["upstream_request"]["max_tokens"] == MAX_MODEL_LEN == 2048
    unclamped = proxy_factory(polar_clamp_max_tokens="false")
    with pytest.raises(openai.BadRequestError) as refused:
        ask(openai_client(unclamped, session), QUESTION, stream=stream, max_tokens=32000)
    # The rule and its wording, which addon/clamp.py reads a context length from.
    assert clamp.REFUSAL.search(refused.value.body["message"]).group(1) == str(MAX_MODEL_LEN)
