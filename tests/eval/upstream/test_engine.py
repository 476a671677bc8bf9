"""eval.upstream.engine in-process on the tiny model: incremental decoding, teacher forcing, finish reasons."""

import pytest
import torch

from eval.upstream.engine import Detokenizer, Engine, Sampling, generate
from eval.upstream.toolparse import Content, ToolCall


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir, seed=0)


def test_detokenizer_never_splits_a_character(engine):
    text = "naïve café: 日本語 🙂 done"
    ids = engine.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    detok = Detokenizer(engine)
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)


def test_forced_tokens_are_replayed_with_real_logprobs(engine):
    prompt = engine.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    answer = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call><|im_end|>'
    forced = engine.encode(answer)
    pieces = list(generate(engine, prompt, Sampling(max_tokens=100, logprobs=True, parse_tools=True), forced))
    assert [p.token_id for p in pieces] == forced
    assert [p.finish_reason for p in pieces] == [None] * (len(forced) - 1) + ["stop"]
    assert [e for p in pieces for e in p.events] == [ToolCall("ls", "{}")]
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + forced])).logits[0, len(prompt) - 1 : -1]  # (T, V)
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(forced)[:, None])[:, 0]  # (T,)
    assert torch.allclose(torch.tensor([p.logprob["logprob"] for p in pieces]), expected, atol=1e-4)


def test_max_tokens_finishes_with_length(engine):
    prompt = engine.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    forced = engine.encode("one two three four<|im_end|>")
    pieces = list(generate(engine, prompt, Sampling(max_tokens=3), forced))
    assert [p.finish_reason for p in pieces] == [None, None, "length"]
    assert "".join(e.text for p in pieces for e in p.events if isinstance(e, Content)) == engine.decode(forced[:3])
    assert pieces[0].logprob is None  # only computed when asked for


def test_top_logprobs_minus_one_is_the_whole_vocabulary(engine):
    prompt = engine.encode("hello")
    [piece] = generate(engine, prompt, Sampling(max_tokens=1, temperature=0, logprobs=True, top_logprobs=-1))
    top = piece.logprob["top_logprobs"]
    assert len(top) == engine.model.config.vocab_size
    assert top[0]["logprob"] == piece.logprob["logprob"]  # greedy picks the best token
    assert abs(sum(torch.tensor([t["logprob"] for t in top]).exp().tolist()) - 1) < 1e-4


def test_bf16_weights_serve_fp32_log_probs_near_the_fp32_ones(tiny_model_dir, engine):
    # What --dtype bfloat16 (or auto on a CPU with bf16 units) changes: the weights' rounding, not the log-prob's
    # dtype. The gap to fp32 is what the trainer's truncated importance sampling absorbs (docs/training.md).
    bf16 = Engine(tiny_model_dir, seed=0, dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype is torch.bfloat16 and bf16.dtype_reason == "--dtype bfloat16"
    prompt = engine.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    forced = engine.encode("one two three four<|im_end|>")
    logps = {}
    for name, e in (("fp32", engine), ("bf16", bf16)):
        logps[name] = torch.tensor(
            [p.logprob["logprob"] for p in generate(e, prompt, Sampling(max_tokens=10, logprobs=True), forced)]
        )
    assert logps["bf16"].dtype is torch.float32 and torch.isfinite(logps["bf16"]).all()
    gap = (logps["bf16"] - logps["fp32"]).abs().max()
    assert 0 < gap < 0.1  # bf16 rounds (so it did run in bf16), and stays close
