"""eval.upstream.engine in-process on the tiny model: incremental decoding, teacher forcing, finish reasons."""

import pytest
import torch
import torch.nn.functional as F

from eval.upstream.engine import Detokenizer, Engine, Sampling, generate, serving_attention
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


def test_a_bf16_decode_step_attends_as_fp32_sdpa_does_and_fp32_takes_sdpa_itself():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups = 3  # 6 query heads on 2 key/value heads
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(shape, generator=g) for shape in ((3, 6, 1, 16), (3, 2, 9, 16), (3, 2, 9, 16)))
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :4] = False  # row 0 left-padded by 4
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)  # (B, 1, H, D)
    bf16 = [t.bfloat16() for t in (query, key, value)]
    out, _ = serving_attention(module, *bf16, mask, scaling=0.25)
    assert out.dtype is torch.bfloat16 and out.shape == expected.shape
    assert (out.float() - expected).abs().max() < 2e-2  # bf16's rounding of the inputs and the output
    padded = mask.clone()
    padded[0, ..., :4] = True  # the padding, attended: row 0 changes, so the mask was applied
    assert (serving_attention(module, *bf16, padded, scaling=0.25)[0][0] - out[0]).abs().max() > 1e-2
    assert torch.equal(serving_attention(module, query, key, value, mask, scaling=0.25)[0], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_reads_the_shared_columns_as_if_each_row_held_them(dtype, monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from eval.upstream import engine as engine_module

    module = torch.nn.Module()
    module.num_key_value_groups, module.layer_idx = 3, 1
    g = torch.Generator().manual_seed(0)
    shapes = ((3, 6, 1, 16), (1, 2, 5, 16), (1, 2, 5, 16), (3, 2, 9, 16), (3, 2, 9, 16))
    query, shared_k, shared_v, key, value = (torch.randn(shape, generator=g) for shape in shapes)
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :4] = False  # row 0's own columns left-padded by 4
    whole = [torch.cat([s.expand(3, -1, -1, -1), x], 2) for s, x in ((shared_k, key), (shared_v, value))]
    expected, _ = sdpa_attention_forward(module, query, *whole, F.pad(mask, (5, 0), value=True), scaling=0.25)
    inputs = [t.to(dtype) for t in (query, key, value)]
    with engine_module._attending_to([None, (shared_k.to(dtype), shared_v.to(dtype))]):
        out, _ = serving_attention(module, *inputs, mask, scaling=0.25)
    assert out.dtype is dtype and out.shape == expected.shape
    assert (out.float() - expected).abs().max() < (1e-5 if dtype is torch.float32 else 2e-2)
    alone, _ = serving_attention(module, *inputs, mask, scaling=0.25)  # outside a decode step: no shared columns
    assert (alone.float() - expected).abs().max() > 1e-2


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
