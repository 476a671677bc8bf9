"""reconstruct/_chat.py: every real captured answer assembled, split at its network chunks and at awkward bytes;
SGLang's shapes built from the same real answers (the reference server speaks vLLM's)."""

import itertools
import json
import random

import numpy as np
import pytest

from reconstruct._chat import ChatAssembler
from tests.reconstruct.conftest import S, oracle


def assemble(body, *, streamed, chunks=None, fast=True):
    asm = ChatAssembler(streamed=streamed, fast=fast)
    for chunk in chunks if chunks is not None else [body]:
        assert asm.decode(chunk) == []  # nothing is complete before the end
    return asm.flush(), asm


def tokens(completion):
    return completion.prompt.ids(), completion.token_ids, completion.logprobs


def vllm_records(captures):
    return [r for r in captures.records() if r["upstream"] == "vllm"]


@pytest.mark.slow
def test_every_captured_answer_gives_the_upstream_tokens(captures):
    records = vllm_records(captures)
    assert {r["streamed"] for r in records} == {True, False}
    for r in records:
        (c,), asm = assemble(r["response_body"], streamed=r["streamed"])
        assert tokens(c) == oracle(r)
        assert asm.usage["completion_tokens"] == len(c.token_ids) and not asm.torn and asm.error is None
        if not r["streamed"]:
            m = json.loads(r["response_body"])["choices"][0]["message"]
            assert c.message == {**m, "tool_calls": m["tool_calls"] or []}
            assert c.finish_reason == json.loads(r["response_body"])["choices"][0]["finish_reason"]


@pytest.mark.slow
def test_the_stream_fast_path_reads_exactly_what_the_exact_path_reads(captures):
    streams = [r for r in vllm_records(captures) if r["streamed"]]
    for r in streams:
        (fast,), asm = assemble(r["response_body"], streamed=True)
        (exact,), slow = assemble(r["response_body"], streamed=True, fast=False)
        assert (asm.path, slow.path) == ("fast", "exact")
        assert fast == exact and asm.usage == slow.usage and asm.model == slow.model


@pytest.mark.slow
def test_the_fast_path_reads_the_chunk_around_the_prompt_ids_and_the_last_finish_reason(captures):
    # The fast path scans the text around the prompt array in place: a token in the chunk that carries the
    # prompt ids (before and after the array) must count, as must a finish reason sent before the last chunk.
    (r,) = captures.records(S.streamed)[:1]
    body = r["response_body"]
    key = body.index('"prompt_token_ids"')
    second = body.index("\n\ndata: ", key) + 2
    first_token = body[second : body.index("\n\n", second)]  # the second chunk: the first sampled token
    merged = json.loads(first_token[6:])
    chunk0 = json.loads(body[6 : body.index("\n\n")])
    for before in (True, False):
        rest = {k: v for k, v in chunk0.items() if k != "choices"}
        merged_chunk = {"choices": merged["choices"], **rest} if before else {**rest, "choices": merged["choices"]}
        after = body[body.index("\n\n") : second] + body[second + len(first_token) + 2 :]  # the second chunk left out
        text = "data: " + json.dumps(merged_chunk) + after
        (fast,), asm = assemble(text, streamed=True)
        (exact,), _ = assemble(text, streamed=True, fast=False)
        assert asm.path == "fast" and fast == exact and fast.finish_reason == exact.finish_reason
    early = body.replace('"finish_reason": null', '"finish_reason": "early"', 1)
    (fast,), asm = assemble(early, streamed=True)
    (exact,), _ = assemble(early, streamed=True, fast=False)
    assert asm.path == "fast" and fast.finish_reason == exact.finish_reason


@pytest.mark.slow
def test_the_fast_path_steps_aside_when_it_cannot_be_sure(captures):
    (r,) = captures.records(S.streamed)[:1]
    body = r["response_body"]
    first = body.index('"logprobs": {"content": [{')
    top = '"top_logprobs": [{"token": "x", "logprob": -9.5, "bytes": [120]}]'
    variants = {
        "top_logprobs > 0": body.replace('"top_logprobs": []', top),  # more "logprob" keys than ids
        "a second tool call": body.replace('"index": 0', '"index": 1', 2),
        "no usage": body[: body.rindex("data: {")],
        "crlf": body.replace("\n", "\r\n"),
        "an error event": body.replace("data: [DONE]", 'data: {"error": {"message": "late"}}'),
    }
    assert first > 0
    for name, text in variants.items():
        _, asm = assemble(text, streamed=True)
        assert asm.path == "exact", name
    (c,), _ = assemble(variants["top_logprobs > 0"], streamed=True)
    assert tokens(c) == oracle(r)


@pytest.mark.slow
def test_streamed_and_non_streamed_answers_assemble_alike(captures):
    streamed, plain = captures.records(S.streamed), captures.records(S.non_streamed)
    for a, b in zip(streamed, plain, strict=True):  # the same script, once streamed, once not
        (ca,), _ = assemble(a["response_body"], streamed=True)
        (cb,), _ = assemble(b["response_body"], streamed=False)
        strip = lambda m: {**m, "tool_calls": [{**c, "id": ""} for c in m["tool_calls"]]}  # noqa: E731 - ids are random
        assert (ca.prompt.ids(), ca.token_ids, ca.finish_reason, strip(ca.message)) == (
            cb.prompt.ids(),
            cb.token_ids,
            cb.finish_reason,
            strip(cb.message),
        )
        # The server batches and caches prefixes, as vLLM does: the same tokens' log-probs agree to float noise.
        np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-4)


@pytest.mark.slow
def test_split_at_the_network_chunks_and_at_every_awkward_byte(captures):
    for r in vllm_records(captures):
        body = r["response_body"].encode()
        want = assemble(body, streamed=r["streamed"])[0]
        sizes = [n for _, n in r["chunks"]]  # the proxy's record of how the bytes arrived
        assert sum(sizes) == len(body)
        cuts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        assert (
            assemble(body, streamed=r["streamed"], chunks=[body[a:b] for a, b in itertools.pairwise(cuts)])[0] == want
        )
    # Inside multi-byte characters, inside the lifted prompt array, inside "\n\n", around "data:".
    (r,) = [r for r in captures.records(S.streamed) if "✓" in r["response_body"]]
    body = r["response_body"].encode()
    want = assemble(body, streamed=True)[0]
    spots = {body.index("é".encode()) + 1, body.index("✓".encode()) + 1, body.index("✓".encode()) + 2}
    spots |= {body.index("\ufffd".encode()) + k for k in (1, 2)}
    spots |= {body.index(b"prompt_token_ids") + k for k in range(0, 40, 3)}
    spots |= {body.index(b"\n\n") + k for k in (0, 1, 2)} | {body.index(b"data:", 10) + k for k in range(6)}
    spots |= set(random.Random(0).sample(range(len(body)), 60))
    for i in sorted(spots):
        assert assemble(body, streamed=True, chunks=[body[:i], body[i:]])[0] == want, i


@pytest.mark.slow
def test_torn_stream_keeps_the_tokens_that_arrived(captures):
    r = captures.records(S.streamed)[0]
    body = r["response_body"]
    cut = body.index("data: ", len(body) // 2) + 20  # inside an event
    (c,), asm = assemble(body[:cut], streamed=True)
    prompt, ids, logprobs = oracle(r)
    assert asm.torn and c.prompt.ids() == prompt and 0 < len(c.token_ids) < len(ids)
    assert c.token_ids == ids[: len(c.token_ids)] and c.logprobs == logprobs[: len(c.token_ids)]


def sglang_non_streamed(record):
    """SGLang's non-streamed shape: prompt ids per choice, log-probs in meta_info (no logprobs.content)."""
    body = json.loads(record["response_body"])
    prompt = body.pop("prompt_token_ids")
    choice = body["choices"][0]
    triples = [
        [t["logprob"], i, None] for t, i in zip(choice.pop("logprobs")["content"], choice["token_ids"], strict=True)
    ]
    choice.update(prompt_token_ids=prompt, meta_info={"id": "x", "output_token_logprobs": triples}, matched_stop=None)
    return json.dumps(body)


def sglang_streamed(record, *, framed):
    """SGLang's streamed shape: no ids on the chunks; one sglext chunk with input and output ids at the end
    (a named ``sglext_ids`` event with ``x-sglext-ids-framed``)."""
    events = [json.loads(b[6:]) for b in record["response_body"].split("\n\n") if b.startswith("data: {")]
    prompt = events[0].pop("prompt_token_ids")
    output = [i for e in events for c in e["choices"] for i in c.pop("token_ids", None) or []]
    ext = {"object": "chat.completion.chunk", "choices": [], "sglext": {"input_ids": prompt, "output_ids": [output]}}
    blocks = [f"data: {json.dumps(e)}\n\n" for e in events]
    blocks.insert(-1, ("event: sglext_ids\n" if framed else "") + f"data: {json.dumps(ext)}\n\n")
    return "".join(blocks) + "data: [DONE]\n\n"


@pytest.mark.slow
def test_sglang_shapes(captures):
    for r in vllm_records(captures):
        if r["streamed"]:
            for framed in (False, True):
                (c,), _ = assemble(sglang_streamed(r, framed=framed), streamed=True)
                assert tokens(c) == oracle(r)
        else:
            (c,), _ = assemble(sglang_non_streamed(r), streamed=False)
            assert tokens(c) == oracle(r)


@pytest.mark.slow
def test_ids_from_token_id_strings_when_the_ids_are_missing(captures):
    r = captures.records(S.non_streamed)[0]
    body = json.loads(r["response_body"])
    choice = body["choices"][0]
    for entry, i in zip(choice["logprobs"]["content"], choice.pop("token_ids"), strict=True):
        entry["token"] = f"token_id:{i}"  # vLLM's return_tokens_as_token_ids
    (c,), _ = assemble(json.dumps(body), streamed=False)
    assert tokens(c) == oracle(r)


@pytest.mark.parametrize("streamed", [True, False])
def test_error_answers(streamed):
    error = {"error": {"message": "boom", "type": "internal_server_error", "code": 500}}
    body = f"data: {json.dumps(error)}\n\n" if streamed else json.dumps(error)
    completions, asm = assemble(body, streamed=streamed)
    assert completions == [] and asm.error == "boom"
    completions, asm = assemble("not json", streamed=False)
    assert completions == [] and asm.torn
