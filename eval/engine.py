"""Batched token-by-token generation for eval.serve: one scheduler thread decodes all running requests together
(continuous batching, as vLLM does it, simplified), with raw log-probs and incremental decoding.

    engine = Engine(Path("models/tiny"), seed=0, max_batch=32)
    for piece in generate(engine, prompt_ids, Sampling(max_tokens=16, temperature=0)): ...

Each ``Piece`` is one generated token with its log-prob entry and the parsed events its text produced, so the
server streams a chunk per token. Log-probs are vLLM's default raw ones: log_softmax of the model's logits, before
temperature and top-p. With ``forced`` token ids the model is teacher-forced instead of sampled (scripted replies).

Scheduling. Requests queue for a background thread that owns the model. It prefills each newcomer alone (one
forward over its prompt), then merges that KV cache into the running batch of the same adapter, left-padding the
shorter side: one copy per join. Each decode step is then one forward for all rows of one adapter (None: the base
model), with an attention mask over the padding and explicit position ids per row, because Llama/Qwen3 do not infer
positions from the mask; batches of different adapters take turns, step by step. Every row keeps its own sampling
settings and random generator. Rows leave when they finish or when their consumer stops reading (a stop string, a
client that hung up): the batch is compacted before its next step. At most ``max_batch`` rows run; further
requests wait. An error in a forward pass reaches the requests of that forward as an exception; the scheduler
carries on with the others.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import queue
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Set before transformers imports huggingface_hub, which reads it once: the model is always a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F

from eval.toolparse import Event, OutputParser, StopStrings

__all__ = ["Detokenizer", "Engine", "Piece", "Sampling", "generate"]


@dataclasses.dataclass
class Sampling:
    """What one request asks of generation."""

    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: the server's generator, seeded once at startup
    stop: list[str] = dataclasses.field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0  # -1: the whole vocabulary, as in vLLM
    parse_tools: bool = False  # vLLM parses tool calls only when there are tools and tool_choice is not "none"
    adapter: str | None = None  # a loaded LoRA adapter's name; None: the base model


@dataclasses.dataclass
class Step:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    finish: str | None  # "stop" (end of turn, end of the forced ids) | "length" | None; stop strings are generate's


@dataclasses.dataclass
class Piece:
    """One generated token and what it adds to the answer; ``finish_reason`` is set on the last one."""

    token_id: int
    logprob: dict[str, Any] | None  # OpenAI logprob entry, when asked for
    events: list[Event]
    finish_reason: str | None  # "stop" | "length" | None


@dataclasses.dataclass(eq=False)
class _Sequence:
    """One request inside the scheduler."""

    prompt_ids: list[int]
    sampling: Sampling
    forced: list[int] | None
    generator: torch.Generator
    replies: queue.SimpleQueue[Step | Exception] = dataclasses.field(default_factory=queue.SimpleQueue)
    cancelled: bool = False  # set from the consumer's thread once it stops reading
    n_generated: int = 0
    last_token: int = 0  # the input of its next decode step

    @property
    def position(self) -> int:
        """``last_token``'s position: the number of tokens before it, whatever padding the batch adds."""
        return len(self.prompt_ids) + self.n_generated - 1


class _Batch:
    """The running rows of one adapter: one KV cache, left-padded to a common length, and its padding mask."""

    def __init__(self, seq: _Sequence, cache: Any) -> None:
        self.rows = [seq]
        self.cache = cache  # DynamicCache; cache.layers[i].keys / .values: (B, kv_heads, L, head_dim)
        self.mask = torch.ones(1, cache.get_seq_length(), dtype=torch.long)  # (B, L): 0 on left padding

    def join(self, seq: _Sequence, cache: Any) -> None:
        """Appends a prefilled row (its cache: batch of 1). Every tensor is built before any is replaced, so a
        failure leaves the batch as it was."""
        length = max(self.mask.shape[1], cache.get_seq_length())
        layers = list(zip(self.cache.layers, cache.layers, strict=True))
        keys = [_stack_left_padded(mine.keys, theirs.keys, length, 2) for mine, theirs in layers]
        values = [_stack_left_padded(mine.values, theirs.values, length, 2) for mine, theirs in layers]
        ones = torch.ones(1, cache.get_seq_length(), dtype=torch.long)  # (1, T)
        mask = _stack_left_padded(self.mask, ones, length, 1)
        for layer, layer_keys, layer_values in zip(self.cache.layers, keys, values):
            layer.keys, layer.values = layer_keys, layer_values  # (B + 1, kv_heads, length, head_dim)
        self.mask = mask  # (B + 1, length)
        self.rows.append(seq)

    def keep(self, rows: list[int]) -> None:
        """Keeps only the rows at these indices, then drops the padding columns that no remaining row needs."""
        if len(rows) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in rows]
        if not rows:
            return  # the scheduler drops an empty batch
        index = torch.tensor(rows)
        mask = self.mask.index_select(0, index)  # (B', L)
        start = int(mask.any(0).nonzero()[0])  # the first column a remaining row uses
        self.mask = mask[:, start:]  # (B', L')
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]  # (B', kv_heads, L', head_dim)
            layer.values = layer.values.index_select(0, index)[:, :, start:]


def _stack_left_padded(a: torch.Tensor, b: torch.Tensor, length: int, seq_dim: int) -> torch.Tensor:
    """``a`` and ``b`` concatenated on the batch dim (0), each zero-padded on the left of ``seq_dim`` to ``length``."""
    trailing = (0, 0) * (a.dim() - seq_dim - 1)  # F.pad takes (left, right) pairs from the last dim backwards
    return torch.cat([F.pad(x, (*trailing, length - x.shape[seq_dim], 0)) for x in (a, b)])


class Engine:
    """The model, driven by one scheduler thread that batches the decode steps of all running requests, and the
    tokenizer, which request threads use behind a lock."""

    def __init__(self, model_dir: Path, seed: int, max_batch: int = 32) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
        from transformers.cache_utils import DynamicLayer

        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        self.model.eval()
        # Joining rows pads and concatenates whole caches, which is only right when every layer keeps all tokens.
        if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=self.model.config).layers):
            raise ValueError(f"{model_dir}: sliding-window or linear-attention layers cannot be batched here")
        self.max_len: int = self.model.config.max_position_embeddings
        vocab = self.tokenizer.get_vocab()
        eos = {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab}
        self.eos_ids = eos | {self.tokenizer.eos_token_id}
        self.max_batch = max_batch
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> the folder it was loaded from
        self._tokenizer_lock = threading.Lock()  # fast tokenizers raise "Already borrowed" when two threads encode
        self._model_lock = threading.Lock()  # adapters are loaded and unloaded between forward passes
        self._generator = torch.Generator().manual_seed(seed)  # the scheduler thread's alone
        self._waiting: queue.Queue[_Sequence | None] = queue.Queue()  # None: wake up to stop
        self._batches: dict[str | None, _Batch] = {}  # adapter -> its running rows; the scheduler thread's alone
        self._stopping = threading.Event()
        self._scheduler = threading.Thread(target=self._schedule, name="engine-scheduler", daemon=True)
        self._scheduler.start()
        atexit.register(self._stop)

    def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter (``train/grpo.py``'s output) under ``name``; requests for model ``name`` use
        it, others the base model, as vLLM's ``--lora-modules`` and ``/v1/load_lora_adapter`` do."""
        from peft import PeftModel

        with self._model_lock, warnings.catch_warnings():
            # peft reads `is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            if not self.adapters:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
            else:
                self.model.load_adapter(path, adapter_name=name)
            self.adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        with self._model_lock:
            if len(self.adapters) == 1:  # the last one: back to the plain base model
                self.model = self.model.unload()
            else:
                self.model.delete_adapter(name)
            del self.adapters[name]

    def _forward(self, adapter: str | None, **inputs: Any) -> Any:
        """One forward pass with ``adapter`` active (None: the base model); the caller holds the model lock."""
        if not self.adapters:
            return self.model(**inputs)
        if adapter is None:
            with self.model.disable_adapter():
                return self.model(**inputs)
        self.model.set_adapter(adapter)
        return self.model(**inputs)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation_prompt: bool
    ) -> str:
        """The chat template's text, ending in ``<|im_start|>assistant\n`` when ``generation_prompt``."""
        with self._tokenizer_lock:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )

    def encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)

    def steps(self, prompt_ids: list[int], sampling: Sampling, forced: list[int] | None) -> Iterator[Step]:
        """Queues the request now; the iterator yields its tokens as the scheduler samples them (with ``forced``:
        replays them). Closing the iterator early takes the request out of the batch."""
        generator = self._generator if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
        seq = _Sequence(prompt_ids, sampling, forced, generator)
        self._waiting.put(seq)
        return self._replies(seq)

    def _replies(self, seq: _Sequence) -> Iterator[Step]:
        try:
            while True:
                try:
                    reply = seq.replies.get(timeout=1.0)
                except queue.Empty:
                    if not self._scheduler.is_alive():  # it died of a bug; its traceback is in the log
                        raise RuntimeError("the engine's scheduler thread has stopped") from None
                    continue
                if isinstance(reply, Exception):
                    raise RuntimeError(f"generation failed: {type(reply).__name__}: {reply}") from reply
                yield reply
                if reply.finish:
                    return
        finally:
            seq.cancelled = True  # finished or abandoned: either way the scheduler drops the row

    def _schedule(self) -> None:
        """The scheduler thread: admit waiting requests while there is room, then one decode step per adapter."""
        with torch.inference_mode():
            while not self._stopping.is_set():
                self._admit()
                for adapter in list(self._batches):
                    self._decode(adapter)

    def _stop(self) -> None:
        """At interpreter exit, lets the scheduler end after its current step: a daemon thread still inside a torch
        op when Python finalizes aborts the process ("terminate called without an active exception")."""
        self._stopping.set()
        self._waiting.put(None)
        self._scheduler.join()

    def _admit(self) -> None:
        """Prefills waiting requests until ``max_batch`` rows run; blocks while none does."""
        while not self._stopping.is_set() and sum(len(b.rows) for b in self._batches.values()) < self.max_batch:
            try:
                seq = self._waiting.get(block=not self._batches)
            except queue.Empty:
                return
            if seq is None:
                return  # _stop's wake-up call
            if not seq.cancelled:
                self._prefill(seq)

    def _prefill(self, seq: _Sequence) -> None:
        """One forward over the prompt alone, then the row joins its adapter's batch unless it is already done."""
        adapter = seq.sampling.adapter
        try:
            input_ids = torch.tensor([seq.prompt_ids])  # (1, T)
            with self._model_lock:
                out = self._forward(adapter, input_ids=input_ids, use_cache=True, logits_to_keep=1)
            if not self._emit([seq], out.logits[:, -1].float()):  # (1, V)
                return
            if adapter in self._batches:
                self._batches[adapter].join(seq, out.cache)
            else:
                self._batches[adapter] = _Batch(seq, out.cache)
        except Exception as e:  # noqa: BLE001 - whatever it is, the request gets it instead of hanging
            seq.replies.put(e)

    def _decode(self, adapter: str | None) -> None:
        """One forward for all rows of ``adapter``'s batch; rows that finish or were abandoned leave it."""
        batch = self._batches[adapter]
        try:
            batch.keep([i for i, seq in enumerate(batch.rows) if not seq.cancelled])
            if batch.rows:
                input_ids = torch.tensor([[seq.last_token] for seq in batch.rows])  # (B, 1)
                position_ids = torch.tensor([[seq.position] for seq in batch.rows])  # (B, 1)
                mask = F.pad(batch.mask, (0, 1), value=1)  # (B, L + 1)
                with self._model_lock:
                    # transformers 5.24 renamed past_key_values to cache (the old name warns until 5.40).
                    out = self._forward(
                        adapter,
                        input_ids=input_ids,
                        attention_mask=mask,
                        position_ids=position_ids,
                        cache=batch.cache,  # extended in place by the forward pass
                        use_cache=True,
                        logits_to_keep=1,
                    )
                batch.mask = mask
                batch.keep(self._emit(batch.rows, out.logits[:, -1].float()))  # (B, V)
        except Exception as e:  # noqa: BLE001 - the batch's requests get it; the other batches carry on
            for seq in batch.rows:
                seq.replies.put(e)
            batch.rows = []
        if not batch.rows:
            del self._batches[adapter]

    def _emit(self, rows: list[_Sequence], logits: torch.Tensor) -> list[int]:
        """Picks each row's next token from its logits (B, V) and sends it; returns the indices of unfinished rows."""
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        going_on = []
        for i, (seq, row_logits, row_logp) in enumerate(zip(rows, logits, logp)):
            if seq.cancelled:
                continue
            forced = seq.forced
            token = forced[seq.n_generated] if forced is not None else _sample(row_logits, seq.sampling, seq.generator)
            seq.n_generated, seq.last_token = seq.n_generated + 1, token
            k = row_logp.shape[-1] if seq.sampling.top_logprobs == -1 else seq.sampling.top_logprobs
            top = row_logp.topk(k) if k else None
            pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            finish = None
            if token in self.eos_ids or (forced is not None and seq.n_generated == len(forced)):
                finish = "stop"
            elif seq.n_generated >= seq.sampling.max_tokens:
                finish = "length"
            seq.replies.put(Step(token, row_logp[token].item(), pairs, finish))
            if finish is None:
                going_on.append(i)
        return going_on


def _sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)  # (V,)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(descending=True)  # (V,), (V,)
        sorted_p[sorted_p.cumsum(-1) - sorted_p >= sampling.top_p] = 0  # tokens wholly past the nucleus
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)  # (V,)
    return int(torch.multinomial(probs, 1, generator=generator))


class Detokenizer:
    """Turns token ids into text deltas without splitting a character across deltas (vLLM's method: decode a
    window that starts one step back, and emit only once it no longer ends in U+FFFD)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._ids: list[int] = []
        self._prefix = self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._engine.decode(self._ids[self._prefix : self._read])
        text = self._engine.decode(self._ids[self._prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]

    def flush(self) -> str:
        """The rest, at the end: a character the last token left incomplete comes out as U+FFFD."""
        before = self._engine.decode(self._ids[self._prefix : self._read])
        return self._engine.decode(self._ids[self._prefix :])[len(before) :]


def generate(
    engine: Engine, prompt_ids: list[int], sampling: Sampling, forced: list[int] | None = None
) -> Iterator[Piece]:
    """Token ids -> text -> stop strings -> reasoning/tool-call parser, one token at a time. Closing it early (or a
    stop string) ends the request in the engine too."""
    detok, stops = Detokenizer(engine), StopStrings(sampling.stop)
    parser = OutputParser(parse_tools=sampling.parse_tools)
    with contextlib.closing(engine.steps(prompt_ids, sampling, forced)) as steps:
        for step in steps:
            finish = step.finish
            text, hit = stops.feed(detok.push(step.token_id) + (detok.flush() if finish else ""))
            if hit:
                finish = "stop"  # the tokens stay (vLLM returns them too); the text stops before the stop string
            elif finish:
                text += stops.flush()
            events = parser.feed(text) + (parser.flush() if finish else [])
            yield Piece(step.token_id, _logprob_entry(engine, step) if sampling.logprobs else None, events, finish)
            if finish:
                return


def _logprob_entry(engine: Engine, step: Step) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = engine.token_text(token_id)
        logprob = max(logprob, -9999.0)  # as vLLM: -inf is not valid JSON
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}

    return {**entry(step.token_id, step.logprob), "top_logprobs": [entry(t, lp) for t, lp in step.top]}
