"""eval.upstream.engine's prefix cache on the tiny model: a prompt that starts like an earlier prompt (and its answer)
prefills only the rest and gets what it gets without the cache; entries serve only their own adapter, are retired
when it is loaded again, and the least recently used go first when the token budget is full.

Each test takes a fresh engine, so the counters start at zero; ``ForwardGate.lengths`` records how many tokens per
row each forward pass was fed (a prefill's length, or 1 for a decode step)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from eval.upstream.engine import Engine, Sampling, Step, generate
from tests.eval.upstream.test_engine_batching import alone, assert_same, install_gate

SYSTEM = "You are a careful shell assistant. Run one command at a time and explain nothing."
GREEDY = Sampling(max_tokens=12, temperature=0, top_logprobs=3)


def chat(engine: Engine, user: str) -> list[int]:
    return engine.encode(
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


def tool_result(engine: Engine, text: str) -> list[int]:
    """What a session appends to prompt + answer before its next call."""
    return engine.encode(
        f"\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.fixture
def engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir, seed=0)


@pytest.fixture(scope="module")
def off(tiny_model_dir) -> Engine:
    """The reference: the same model without a prefix cache."""
    return Engine(tiny_model_dir, seed=0, prefix_cache_tokens=0)


@pytest.mark.parametrize("forced", [False, True], ids=["sampled", "forced"])
def test_a_prompt_extending_an_earlier_answer_prefills_only_the_new_tokens(engine, off, monkeypatch, forced):
    first = chat(engine, "list the files")
    script = engine.encode('<tool_call>\n{"name": "ls"}\n</tool_call><|im_end|>') if forced else None
    answer = [s.token_id for s in alone(engine, first, GREEDY, script)]
    second = first + answer + tool_result(engine, "a.txt b.txt")
    reused, prefilled = engine.prefix_cache.reused_tokens, engine.prefix_cache.prefilled_tokens
    gate = install_gate(engine, monkeypatch)

    steps = alone(engine, second, GREEDY)

    # The answer's last token was sampled but never fed to the model, so its KV is computed now, with the tail's.
    assert gate.lengths[0] == len(second) - len(first) - len(answer) + 1
    assert engine.prefix_cache.reused_tokens - reused == len(first) + len(answer) - 1
    assert engine.prefix_cache.prefilled_tokens - prefilled == gate.lengths[0]
    assert_same(steps, alone(off, second, GREEDY))


def test_requests_sharing_a_system_prompt_reuse_its_kv(engine, off, monkeypatch):
    a, b = chat(engine, "list the files"), chat(engine, "what time is it")
    shared = common_prefix(a, b)
    assert len(engine.encode(SYSTEM)) < shared < len(b)
    gate = install_gate(engine, monkeypatch)
    gate.hold()
    streams = [engine.steps(ids, GREEDY, None) for ids in (a, b)]  # queued together: b's prefill follows a's
    gate.open()
    steps_a, steps_b = (list(s) for s in streams)

    assert gate.lengths[:2] == [len(a), len(b) - shared]  # a's prompt is cached as soon as it is prefilled
    assert (engine.prefix_cache.hits, engine.prefix_cache.reused_tokens) == (1, shared)
    assert f"1 of 2 prompts hit, {shared} of {len(a) + len(b)} prompt tokens reused" in engine.prefix_cache.summary()
    assert_same(steps_a, alone(off, a, GREEDY))
    assert_same(steps_b, alone(off, b, GREEDY))


def test_a_repeated_prompt_needs_no_prefill_and_gets_exactly_the_same(engine, monkeypatch):
    prompt = chat(engine, "list the files")
    first = alone(engine, prompt, GREEDY)
    gate = install_gate(engine, monkeypatch)
    assert alone(engine, prompt, GREEDY) == first  # bit for bit: the same KV and the same logits after the prompt
    assert gate.lengths == [1] * (len(first) - 1)  # decode steps only

    gate.hold()
    group = [engine.steps(prompt, GREEDY, None) for _ in range(3)]  # as a GRPO group's samples arrive
    gate.open()
    for steps in map(list, group):
        assert steps[0] == first[0]
        assert_same(steps, first)  # decoded as a batch of three: float noise from there on
    assert gate.batch_sizes[0] == 3  # no prefill: the group's first forward is its first decode step
    assert (engine.prefix_cache.hits, engine.prefix_cache.reused_tokens) == (4, 4 * len(prompt))


def test_an_abandoned_row_leaves_the_kv_of_every_token_it_was_fed(engine, monkeypatch):
    script = engine.encode(" ".join(["word"] * 40))
    prompt = chat(engine, "count")
    gate = install_gate(engine, monkeypatch)
    gate.hold()
    pieces = generate(engine, prompt, Sampling(max_tokens=100), script)
    gate.allow(3)  # the prefill and two decode steps
    assert [next(pieces).token_id for _ in range(3)] == script[:3]
    gate.wait_until_stopped()  # the third decode step, which feeds script[2], waits at the gate
    pieces.close()
    gate.open()  # the step runs on without the row, which leaves with its KV: prompt + script[:3]
    after = prompt + script[:3] + tool_result(engine, "stopped")
    alone(engine, after, Sampling(max_tokens=1))
    assert gate.lengths[-1] == len(after) - len(prompt) - 3


def _adapter(tiny_model_dir, folder, seed: int) -> str:
    """A LoRA adapter with random (not zero) B matrices, so it changes the model's log-probs."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(folder)
    return str(folder)


# peft reads what transformers 5 renamed
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_adapter_entries_serve_only_that_adapter_until_it_is_loaded_again(tiny_model_dir, tmp_path, engine):
    first, second = _adapter(tiny_model_dir, tmp_path / "a", 0), _adapter(tiny_model_dir, tmp_path / "b", 1)
    reference = Engine(tiny_model_dir, seed=0, prefix_cache_tokens=0)
    reference.load_adapter("step", second)
    engine.load_adapter("step", first)
    cache = engine.prefix_cache
    prompt = chat(engine, "list the files")
    base, tuned = GREEDY, Sampling(max_tokens=12, temperature=0, top_logprobs=3, adapter="step")

    alone(engine, prompt, base)
    alone(engine, prompt, tuned)
    assert cache.hits == 0  # the base model's entry holds the same tokens, but not the adapter's KV
    alone(engine, prompt, tuned)
    assert cache.hits == 1  # its own

    engine.unload_adapter("step")
    engine.load_adapter("step", second)  # the same name, other weights
    steps = alone(engine, prompt, tuned)
    assert cache.hits == 1
    assert [e.model[0] for e in cache.entries] == [None, "step"]  # the old weights' entry is gone
    assert_same(steps, alone(reference, prompt, tuned))

    engine.unload_adapter("step")
    alone(engine, prompt, base)
    assert cache.hits == 2
    assert [e.model[0] for e in cache.entries] == [None]


def test_the_least_recently_used_entries_go_first(tiny_model_dir, off):
    texts = ("red green blue yellow", "one two three four five", "alpha beta gamma")
    a, b, c = (off.encode(text) for text in texts)
    assert len({a[0], b[0], c[0]}) == 3  # no common prefix at all
    engine = Engine(tiny_model_dir, seed=0, prefix_cache_tokens=len(a) + len(b) + len(c) - 1)
    cache, one = engine.prefix_cache, Sampling(max_tokens=1)  # one token: each entry is the prompt alone

    for ids in (a, b, a, c):  # a's second run makes b the least recently used
        alone(engine, ids, one)
    assert [e.ids.tolist() for e in cache.entries] == [a, c]
    assert cache.tokens == len(a) + len(c)
    assert (cache.hits, cache.reused_tokens) == (1, len(a))

    too_long = off.encode("zero " * len(a + b + c))
    alone(engine, too_long, one)  # longer than the whole budget: not kept, and nothing evicted for it
    assert [e.ids.tolist() for e in cache.entries] == [a, c]


def test_with_the_cache_off_every_prompt_is_prefilled_whole(tiny_model_dir, monkeypatch):
    engine = Engine(tiny_model_dir, seed=0, prefix_cache_tokens=0)
    gate = install_gate(engine, monkeypatch)
    prompt = chat(engine, "list the files")
    first: list[Step] = alone(engine, prompt, GREEDY)
    again = alone(engine, prompt, GREEDY)
    assert again == first  # bit for bit
    assert [n for n in gate.lengths if n > 1] == [len(prompt)] * 2
    cache = engine.prefix_cache
    assert (cache.entries, cache.hits, cache.reused_tokens, cache.prefilled_tokens) == ([], 0, 0, 2 * len(prompt))


def test_a_negative_budget_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="at least 0"):
        Engine(tiny_model_dir, seed=0, prefix_cache_tokens=-1)
