"""eval.upstream.engine's scheduler on the tiny model: concurrent requests share forward passes and get what they would
get alone (greedy, seeded, forced, LoRA), rows join mid-generation and leave when their consumer stops.

A ``ForwardGate`` wraps the model's forward: it records each call's input shape and, while held, lets calls through
only as permits are given, so a test can queue requests behind a paused scheduler or stop it at a known step.

The prefix cache is off here: these tests count forward passes and compare each batched row with the same request
run alone before, which the cache would answer without a prefill (tests/eval/upstream/test_prefix_cache.py tests it).
"""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from eval.upstream.engine import Engine, Sampling, Step, generate

WORDS = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()


class ForwardGate:
    def __init__(self, model: torch.nn.Module) -> None:
        self._forward = model.forward
        self._cond = threading.Condition()
        self._permits: int | None = None  # None: open
        self._waiting = 0  # forward passes stopped at the gate
        self.batch_sizes: list[int] = []  # one per forward pass, in order
        self.lengths: list[int] = []  # tokens per row fed to each forward pass: 1 for a decode step
        self.errors: dict[int, Exception] = {}  # forward pass number -> what it raises instead of running

    def __call__(self, *args, **kwargs):
        with self._cond:
            self._waiting += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._permits is None or self._permits > 0)
            self._waiting -= 1
            if self._permits is not None:
                self._permits -= 1
            call = len(self.batch_sizes)
            self.batch_sizes.append(kwargs["input_ids"].shape[0])
            self.lengths.append(kwargs["input_ids"].shape[1])
        if call in self.errors:
            raise self.errors[call]
        return self._forward(*args, **kwargs)

    def hold(self) -> None:
        """Stops every forward pass from now on until ``allow`` or ``open``; clears the record."""
        with self._cond:
            self._permits = 0
            self.batch_sizes.clear()
            self.lengths.clear()

    def allow(self, n: int) -> None:
        with self._cond:
            self._permits += n
            self._cond.notify_all()

    def wait_until_stopped(self) -> None:
        """Returns once a forward pass waits at the gate: the scheduler is paused at a known point."""
        with self._cond:
            assert self._cond.wait_for(lambda: self._waiting > 0, timeout=60)

    def open(self) -> None:
        with self._cond:
            self._permits = None
            self._cond.notify_all()


def install_gate(engine: Engine, monkeypatch) -> ForwardGate:
    gate = ForwardGate(engine.model)
    monkeypatch.setattr(engine.model, "forward", gate)
    return gate


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir, seed=0, prefix_cache_tokens=0)


@pytest.fixture
def gate(engine, monkeypatch):
    gate = install_gate(engine, monkeypatch)
    yield gate
    gate.open()  # a failed test must not leave the scheduler waiting


def prompt(engine: Engine, n_words: int) -> list[int]:
    return engine.encode(f"<|im_start|>user\n{' '.join(WORDS[:n_words])}<|im_end|>\n<|im_start|>assistant\n")


def alone(engine: Engine, prompt_ids: list[int], sampling: Sampling, forced: list[int] | None = None) -> list[Step]:
    return list(engine.steps(prompt_ids, sampling, forced))


def together(gate: ForwardGate, engine: Engine, requests: list[tuple]) -> list[list[Step]]:
    """Queues every request behind the held gate, so the scheduler admits them all before its first decode step."""
    gate.hold()
    streams = [engine.steps(*request) for request in requests]
    gate.open()
    return [list(s) for s in streams]


def assert_same(batched: list[Step], single: list[Step]) -> None:
    """Token ids exactly; log-probs to 1e-4: a batch runs its matrix products on B rows at once, which CPU BLAS
    blocks differently from one row, so sums come out in another order (SmolLM2 differs by about 1e-5,
    tests/bench/results/server.md)."""
    assert [s.token_id for s in batched] == [s.token_id for s in single]
    assert [s.finish for s in batched] == [s.finish for s in single]
    assert [s.logprob for s in batched] == pytest.approx([s.logprob for s in single], abs=1e-4)
    assert [[t for t, _ in s.top] for s in batched] == [[t for t, _ in s.top] for s in single]
    assert [lp for s in batched for _, lp in s.top] == pytest.approx([lp for s in single for _, lp in s.top], abs=1e-4)


def test_concurrent_greedy_requests_match_single_runs(engine, gate):
    sampling = Sampling(max_tokens=24, temperature=0, top_logprobs=3)
    requests = [(prompt(engine, n), sampling, None) for n in (1, 4, 9, 15)]  # different lengths: left padding
    singles = [alone(engine, *r) for r in requests]
    batched = together(gate, engine, requests)
    assert max(gate.batch_sizes) == len(requests)
    for b, s in zip(batched, singles, strict=True):
        assert_same(b, s)


def test_concurrent_requests_share_forward_passes(engine, gate):
    n, t = 8, 16
    sampled = [Sampling(max_tokens=t, temperature=1.0, top_p=0.9, seed=i) for i in range(n)]
    requests = [(prompt(engine, 2 + i), sampling, None) for i, sampling in enumerate(sampled)]
    singles = [alone(engine, *r) for r in requests]
    batched = together(gate, engine, requests)
    # One prefill per request, then at most t - 1 decode steps shared by all: far from n * t = 128 alone.
    assert len(gate.batch_sizes) <= n + t - 1
    for b, s in zip(batched, singles, strict=True):  # each row samples with its own seeded generator
        assert_same(b, s)


def test_a_request_joining_mid_generation_gets_its_own_output(engine, gate):
    first = (prompt(engine, 2), Sampling(max_tokens=30, temperature=0), None)
    joiner = (prompt(engine, 15), Sampling(max_tokens=12, temperature=0), None)  # longer than the first's cache
    first_alone, joiner_alone = alone(engine, *first), alone(engine, *joiner)
    assert len(first_alone) == 30  # so it is still running when the joiner comes

    gate.hold()
    stream = engine.steps(*first)
    gate.allow(6)  # the prefill and five decode steps; the seventh forward waits
    head = [next(stream) for _ in range(6)]
    gate.wait_until_stopped()
    joined = engine.steps(*joiner)
    gate.open()
    first_steps, joiner_steps = head + list(stream), list(joined)

    assert gate.batch_sizes[:8] == [1] * 8  # the first alone (7 forwards), then the joiner's prefill
    assert gate.batch_sizes[8] == 2  # then one forward for both
    assert_same(first_steps, first_alone)
    assert_same(joiner_steps, joiner_alone)


def test_rows_outgrowing_their_cache_room_keep_their_output(engine, gate):
    """The batch's KV has room for a quarter more tokens (at least 64) before it is copied into a larger buffer:
    150 decode steps grow it several times, with both rows and after one leaves."""
    script = engine.encode(" ".join(WORDS * 12))[:150]
    requests = [
        (prompt(engine, 4), Sampling(max_tokens=150, top_logprobs=2), script),
        (prompt(engine, 12), Sampling(max_tokens=150, top_logprobs=2), script[:100]),
    ]
    singles = [alone(engine, *r) for r in requests]
    batched = together(gate, engine, requests)
    assert gate.batch_sizes.count(2) == 99  # together for the shorter answer's decode steps
    for b, s in zip(batched, singles, strict=True):
        assert_same(b, s)


def test_forced_tokens_come_back_exactly(engine, gate):
    forced = [engine.encode("Sure: ls -la<|im_end|>"), engine.encode("<think>\nhm\n</think>\n\nNo.<|im_end|>")]
    sampling = Sampling(max_tokens=100)
    requests = [(prompt(engine, 3), sampling, forced[0]), (prompt(engine, 11), sampling, forced[1])]
    requests.append((prompt(engine, 6), Sampling(max_tokens=20, temperature=0), None))  # a sampled row beside them
    singles = [alone(engine, *r) for r in requests]
    batched = together(gate, engine, requests)
    assert max(gate.batch_sizes) == 3
    for steps, ids in zip(batched, forced, strict=False):  # the third row is sampled, not forced
        assert [s.token_id for s in steps] == ids
        assert [s.finish for s in steps] == [None] * (len(ids) - 1) + ["stop"]
    for b, s in zip(batched, singles, strict=True):
        assert_same(b, s)


def test_rows_sharing_a_system_prompt_hold_its_kv_once_and_get_their_own_output(engine, gate):
    """The rows' common leading tokens are held once (``_Batch.shared``); a row that shares fewer of them moves the
    rest into every row's own columns."""
    system = f"<|im_start|>system\n{' '.join(WORDS * 6)}<|im_end|>\n"

    def chat(system: str, n_words: int) -> list[int]:
        return engine.encode(
            f"{system}<|im_start|>user\n{' '.join(WORDS[:n_words])}<|im_end|>\n<|im_start|>assistant\n"
        )

    sampling = Sampling(max_tokens=20, temperature=0, top_logprobs=2)
    first = [(chat(system, n), sampling, None) for n in (2, 7, 12)]
    joiner = (chat("<|im_start|>system\nBe brief.<|im_end|>\n", 3), sampling, None)
    singles = [alone(engine, *r) for r in [*first, joiner]]
    common = len(engine.encode(f"{system}<|im_start|>user\n one"))  # through the first word all three share

    gate.hold()
    streams = [engine.steps(*r) for r in first]
    gate.allow(3 + 4)  # three prefills, four decode steps
    heads = [[next(s) for _ in range(5)] for s in streams]
    gate.wait_until_stopped()
    batch = engine._batches[None]
    assert len(batch.shared_ids) >= common - 1 > 60 and batch.mask.shape[1] < 40  # the system prompt is shared
    shared_keys = next(x for x in batch.shared if x is not None)[0]
    assert shared_keys.shape[:3] == (1, engine.model.config.num_key_value_heads, len(batch.shared_ids))
    joined = engine.steps(*joiner)
    gate.allow(2)  # its prefill and the first step of all four
    joined_head = next(joined)
    gate.wait_until_stopped()
    assert len(batch.rows) == 4 and len(batch.shared_ids) < 6  # only "<|im_start|>system\n" is common now
    gate.open()
    batched = [h + list(s) for h, s in zip(heads, streams, strict=True)] + [[joined_head, *joined]]
    for b, s in zip(batched, singles, strict=True):
        assert_same(b, s)


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir, tmp_path_factory) -> Engine:
    """An engine serving a LoRA adapter with random (not zero) B matrices, so it changes the model's log-probs."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    folder = tmp_path_factory.mktemp("adapter") / "step-1"
    get_peft_model(base, config).save_pretrained(folder)
    engine = Engine(tiny_model_dir, seed=0, prefix_cache_tokens=0)
    engine.load_adapter("step-1", str(folder))
    return engine


# peft reads what transformers 5 renamed
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_adapter_and_base_requests_each_get_their_model(lora_engine, monkeypatch):
    gate = install_gate(lora_engine, monkeypatch)
    short, long = prompt(lora_engine, 3), prompt(lora_engine, 10)
    requests = [
        (ids, Sampling(max_tokens=10, temperature=0, adapter=adapter), None)
        for ids in (short, long)
        for adapter in (None, "step-1")
    ]
    singles = [alone(lora_engine, *r) for r in requests]
    batched = together(gate, lora_engine, requests)
    assert max(gate.batch_sizes) == 2  # one batch per adapter, taking turns
    for b, s in zip(batched, singles, strict=True):
        assert_same(b, s)
    base, tuned = batched[0], batched[1]  # the same prompt, without and with the adapter
    assert abs(base[0].logprob - tuned[0].logprob) > 1e-3


def test_closing_a_generator_frees_its_row(engine, gate):
    script = engine.encode(" ".join(WORDS * 10))  # far longer than the test lets it run
    gate.hold()
    pieces = generate(engine, prompt(engine, 5), Sampling(max_tokens=500), script)
    gate.allow(3)
    assert [next(pieces).token_id for _ in range(3)] == script[:3]
    gate.wait_until_stopped()  # in the row's fourth forward pass
    pieces.close()  # as the server does when the client hangs up
    gate.open()
    after = list(generate(engine, prompt(engine, 7), Sampling(max_tokens=8), script[:8]))
    assert [p.token_id for p in after] == script[:8]
    assert set(gate.batch_sizes) == {1}  # the abandoned row never shared a forward pass with the next request


def test_a_failed_forward_reaches_its_requests_and_the_engine_goes_on(engine, gate):
    gate.hold()
    streams = [engine.steps(prompt(engine, n), Sampling(max_tokens=5, temperature=0), None) for n in (2, 8)]
    gate.errors[2] = RuntimeError("out of memory")  # the first decode step of both, after their two prefills
    gate.open()
    for stream in streams:
        next(stream)  # the token from its prefill
        with pytest.raises(RuntimeError, match="generation failed: RuntimeError: out of memory"):
            next(stream)
    script = engine.encode(" ".join(WORDS[:6]))
    assert [s.token_id for s in alone(engine, prompt(engine, 3), Sampling(max_tokens=100), script)] == script


def test_requests_beyond_max_batch_wait_for_a_row(tiny_model_dir, monkeypatch):
    engine = Engine(tiny_model_dir, seed=0, max_batch=2, prefix_cache_tokens=0)
    gate = install_gate(engine, monkeypatch)
    scripts = [engine.encode(" ".join(WORDS[:n])) for n in (3, 5, 7)]
    requests = [(prompt(engine, 2), Sampling(max_tokens=50), script) for script in scripts]
    batched = together(gate, engine, requests)
    assert max(gate.batch_sizes) == 2
    assert [[s.token_id for s in steps] for steps in batched] == scripts
