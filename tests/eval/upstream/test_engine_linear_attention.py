"""eval.upstream.engine on the tiny Qwen3.5 (Gated DeltaNet x 3, full attention x 1), whose linear-attention layers
keep a convolution state and a recurrent state per row instead of a KV per token: every log-prob the engine gives,
batched, joining, leaving, or resumed from the prefix cache, is the one a single forward over the whole sequence gives
(teacher-forced, no cache), to 1e-4; and the prefix cache resumes only from a point where it holds the states.

The tiny model as built forgets almost everything its recurrent state holds from one token to the next (its random
decay rates make each token keep about e^-9 of the state before it), so that a wrong state would change its log-probs
by about 1e-4 only; these tests run a copy with slow decay instead (``long_memory_qwen35_dir``, tests/conftest.py),
where the state carries the context and a wrong one shows.

``ForwardGate`` (tests/eval/upstream/test_engine_batching.py) records each forward pass's rows and tokens per row."""

import json
import math
import shutil
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import LinearAttentionLayer

from eval.upstream.engine import Engine, Sampling, Step
from tests import http
from tests.eval.upstream.test_engine_batching import WORDS, alone, install_gate, prompt
from tests.eval.upstream.test_prefix_cache import GREEDY, chat, common_prefix, tool_result


@pytest.fixture(scope="module")
def batching(long_memory_qwen35_dir) -> Engine:
    """Without the prefix cache, so that every request is prefilled."""
    return Engine(long_memory_qwen35_dir, seed=0, prefix_cache_tokens=0)


@pytest.fixture
def engine(long_memory_qwen35_dir) -> Engine:
    """A fresh prefix cache per test: its counters start at zero."""
    return Engine(long_memory_qwen35_dir, seed=0)


def scored(model: torch.nn.Module, prompt_ids: list[int], answer: list[int]) -> torch.Tensor:
    """Each answer token's log-prob under one forward over prompt + answer."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + answer])).logits[0, len(prompt_ids) - 1 : -1]  # (T, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(answer)[:, None])[:, 0]  # (T,)


def error(engine: Engine, prompt_ids: list[int], steps: list[Step]) -> float:
    """The largest difference between the steps' log-probs and the teacher-forced ones."""
    served = torch.tensor([s.logprob for s in steps])
    return float((served - scored(engine.model, prompt_ids, [s.token_id for s in steps])).abs().max())


def test_the_recurrent_states_carry_the_context(batching):
    """What makes the other tests sharp: halving the recurrent states after a prompt moves the next log-probs by
    far more than the 1e-4 they allow."""
    ids = prompt(batching, 15)
    with torch.no_grad():
        expected = scored(batching.model, ids[:-1], ids[-1:])
        out = batching.model(input_ids=torch.tensor([ids[:-2]]), use_cache=True)
        for layer in out.cache.layers:
            if isinstance(layer, LinearAttentionLayer):
                layer.recurrent_states[0].mul_(0.5)
        logits = batching.model(input_ids=torch.tensor([ids[-2:-1]]), cache=out.cache).logits[0, -1]  # (V,)
    assert abs(float(torch.log_softmax(logits, -1)[ids[-1]] - expected[0])) > 1e-2


def test_rows_joining_and_leaving_at_different_times_get_the_log_probs_of_one_forward(batching, monkeypatch):
    gate = install_gate(batching, monkeypatch)
    text = batching.encode(" ".join(WORDS * 4))
    # Prompts of different lengths, so that the full-attention KV of each side gets left padding as rows join;
    # answers of different lengths, so that rows leave one by one. Forced answers make the counts below exact.
    forced = Sampling(max_tokens=100)
    first = (prompt(batching, 2), forced, text[:40])
    pair = [(prompt(batching, 15), forced, text[5:17]), (prompt(batching, 6), forced, text[:25])]
    last = (prompt(batching, 9), Sampling(max_tokens=30, temperature=1.0, top_p=0.9, seed=1), None)  # sampled

    gate.hold()
    streams = [batching.steps(*first)]
    gate.allow(6)  # its prefill and five decode steps
    got: list[list[Step]] = [[next(streams[0]) for _ in range(6)]]
    gate.wait_until_stopped()
    streams += [batching.steps(*request) for request in pair]
    gate.allow(1 + 2 + 4)  # the first's next step, the pair's prefills, four decode steps of all three
    got[0] += [next(streams[0]) for _ in range(5)]
    got += [[next(stream) for _ in range(5)] for stream in streams[1:]]
    gate.wait_until_stopped()
    streams.append(batching.steps(*last))
    gate.open()
    got[:3] = [head + list(stream) for head, stream in zip(got, streams, strict=False)]
    got.append(list(streams[3]))

    assert gate.batch_sizes[:9] == [1] * 9  # the first alone (7 forwards), then the pair's prefills
    assert gate.batch_sizes[9:13] == [3] * 4
    assert max(gate.batch_sizes) == 4  # the last joined them; then they left, the pair's first row after 12 tokens
    assert [[s.token_id for s in steps] for steps in got[:3]] == [first[2], pair[0][2], pair[1][2]]
    errors = [error(batching, request[0], steps) for request, steps in zip([first, *pair, last], got, strict=True)]
    assert max(errors) < 1e-4, errors


def test_requests_queued_together_match_single_runs(batching, monkeypatch):
    gate = install_gate(batching, monkeypatch)
    sampling = Sampling(max_tokens=16, temperature=0, top_logprobs=3)
    requests = [(prompt(batching, n), sampling, None) for n in (1, 5, 11, 15)]
    singles = [alone(batching, *r) for r in requests]
    gate.hold()
    streams = [batching.steps(*r) for r in requests]
    gate.open()
    batched = [list(s) for s in streams]
    assert max(gate.batch_sizes) == len(requests)
    for (ids, _, _), b, s in zip(requests, batched, singles, strict=True):
        assert [x.token_id for x in b] == [x.token_id for x in s]  # greedy: the same tokens as alone
        assert error(batching, ids, b) < 1e-4


@pytest.mark.parametrize("forced", [False, True], ids=["sampled", "forced"])
def test_a_prompt_extending_the_last_prompt_and_answer_resumes_from_their_states(engine, monkeypatch, forced):
    first = chat(engine, "list the files")
    script = engine.encode('<tool_call>\n{"name": "ls"}\n</tool_call><|im_end|>') if forced else None
    answer = alone(engine, first, GREEDY, script)
    second = first + [s.token_id for s in answer] + tool_result(engine, "a.txt b.txt")
    gate = install_gate(engine, monkeypatch)

    steps = alone(engine, second, GREEDY)

    # Where the answer's row left: its states follow every token it was fed, all but the last one sampled.
    resumed = len(first) + len(answer) - 1
    assert gate.lengths[0] == len(second) - resumed
    assert (engine.prefix_cache.hits, engine.prefix_cache.reused_tokens) == (1, resumed)
    assert error(engine, first, answer) < 1e-4
    assert error(engine, second, steps) < 1e-4


def test_rows_leaving_a_batch_leave_their_own_states(engine, monkeypatch):
    gate = install_gate(engine, monkeypatch)
    firsts = [chat(engine, "list the files"), chat(engine, "what time is it now, and where am I")]
    scripts = [engine.encode(" ".join(WORDS[:n])) for n in (9, 4)]  # the second row leaves first
    gate.hold()
    streams = [engine.steps(ids, Sampling(max_tokens=100), script) for ids, script in zip(firsts, scripts, strict=True)]
    gate.open()
    answers = [list(stream) for stream in streams]
    assert max(gate.batch_sizes) == 2
    seconds = [ids + script + tool_result(engine, "done") for ids, script in zip(firsts, scripts, strict=True)]
    hits = engine.prefix_cache.hits

    for first, second, script, answer in zip(firsts, seconds, scripts, answers, strict=True):
        gate.lengths.clear()
        steps = alone(engine, second, GREEDY)
        assert gate.lengths[0] == len(second) - len(first) - len(script) + 1
        assert error(engine, first, answer) < 1e-4
        assert error(engine, second, steps) < 1e-4
    assert engine.prefix_cache.hits == hits + 2


def test_a_prompt_sharing_only_part_of_an_entry_is_prefilled_whole(engine, monkeypatch):
    a, b = chat(engine, "list the files"), chat(engine, "what time is it")
    assert 0 < common_prefix(a, b) < len(b)  # the system prompt: the dense model prefills only the rest there
    alone(engine, a, GREEDY)
    shorter = a[:-3]  # within the entry, but where it holds no states
    gate = install_gate(engine, monkeypatch)

    for ids in (b, shorter):
        steps = alone(engine, ids, GREEDY)
        assert gate.lengths[0] == len(ids)
        assert error(engine, ids, steps) < 1e-4
        gate.lengths.clear()
    assert engine.prefix_cache.hits == 0


def test_a_repeated_prompt_resumes_from_the_point_where_it_ended(engine, monkeypatch):
    prompt_ids = chat(engine, "list the files")
    first = alone(engine, prompt_ids, GREEDY)  # its row leaves: the entry runs on into the answer
    gate = install_gate(engine, monkeypatch)

    assert alone(engine, prompt_ids, GREEDY) == first  # bit for bit: the same states, KV and logits
    assert gate.lengths == [1] * (len(first) - 1)  # decode steps only

    gate.hold()
    group = [engine.steps(prompt_ids, GREEDY, None) for _ in range(3)]  # as a GRPO group's samples arrive
    gate.open()
    for steps in map(list, group):
        assert [s.token_id for s in steps] == [s.token_id for s in first]
        assert error(engine, prompt_ids, steps) < 1e-4
    assert gate.batch_sizes[0] == 3  # no prefill: the group's first forward is its first decode step


def test_states_count_in_the_token_budget_as_the_kv_of_as_much_memory(long_memory_qwen35_dir, engine):
    config = engine.model.config
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    conv_dim += config.linear_num_value_heads * config.linear_value_head_dim
    per_layer = conv_dim * config.linear_conv_kernel_dim
    per_layer += config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    kinds = config.layer_types
    per_token = 2 * config.num_key_value_heads * config.head_dim * kinds.count("full_attention")
    states = math.ceil(per_layer * kinds.count("linear_attention") / per_token)
    ids = chat(engine, "list the files")

    alone(engine, ids, Sampling(max_tokens=1))  # done at its prefill: the entry is the prompt and its end's states
    assert engine.prefix_cache.tokens == len(ids) + states

    small = Engine(long_memory_qwen35_dir, seed=0, prefix_cache_tokens=len(ids) + states - 1)
    alone(small, ids, Sampling(max_tokens=1))
    assert small.prefix_cache.entries == []


def test_sliding_window_layers_are_refused(tiny_model_dir, tmp_path):
    model = shutil.copytree(tiny_model_dir, tmp_path / "sliding")
    config = json.loads((model / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layers \['full_attention', 'sliding_attention'\] cannot be batched here"):
        Engine(model, seed=0)


@pytest.mark.slow  # a reference server (python -m eval serve)
def test_served_log_probs_match_one_forward_under_concurrent_requests(reference_server, long_memory_qwen35_dir):
    url = reference_server(long_memory_qwen35_dir, seed=1)
    folder = long_memory_qwen35_dir
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    users = ["hi", "list the files in this folder please", "what time is it", " ".join(WORDS)]
    answers: dict[int, dict] = {}

    def ask(i: int, user: str, max_tokens: int) -> None:
        body = {"messages": [{"role": "user", "content": user}], "max_tokens": max_tokens, "seed": i}
        body |= {"logprobs": True, "return_token_ids": True}
        answers[i] = http.post(url + "/v1/chat/completions", json=body).json()

    threads = []
    for i, user in enumerate(users + users[:1]):  # the last repeats the first prompt: a prefix cache hit
        threads.append(threading.Thread(target=ask, args=(i, user, 8 + 6 * i)))
        threads[-1].start()
        time.sleep(0.05)  # so that they join the running batch at different steps
    for thread in threads:
        thread.join()

    for answer in answers.values():
        prompt_ids, ids = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
        served = torch.tensor([e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]])
        assert torch.allclose(served, scored(model, prompt_ids, ids), atol=1e-4)
