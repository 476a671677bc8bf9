"""Token-by-token generation for eval.serve: sampling over the KV cache, raw log-probs, incremental decoding.

    engine = Engine(Path("models/tiny"), seed=0)
    for piece in generate(engine, prompt_ids, Sampling(max_tokens=16, temperature=0)): ...

Each ``Piece`` is one generated token with its log-prob entry and the parsed events its text produced, so the
server streams a chunk per token. Log-probs are vLLM's default raw ones: log_softmax of the model's logits, before
temperature and top-p. With ``forced`` token ids the model is teacher-forced instead of sampled (scripted replies).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Set before transformers imports huggingface_hub, which reads it once: the model is always a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

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


@dataclasses.dataclass
class Piece:
    """One generated token and what it adds to the answer; ``finish_reason`` is set on the last one."""

    token_id: int
    logprob: dict[str, Any] | None  # OpenAI logprob entry, when asked for
    events: list[Event]
    finish_reason: str | None  # "stop" | "length" | None


class Engine:
    """Model and tokenizer behind one lock, so concurrent requests interleave forward passes safely."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        self.model.eval()
        self.max_len: int = self.model.config.max_position_embeddings
        vocab = self.tokenizer.get_vocab()
        eos = {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab}
        self.eos_ids = eos | {self.tokenizer.eos_token_id}
        self._lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(seed)
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> the folder it was loaded from

    def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter (``train/grpo.py``'s output) under ``name``; requests for model ``name`` use
        it, others the base model, as vLLM's ``--lora-modules`` and ``/v1/load_lora_adapter`` do."""
        from peft import PeftModel

        with self._lock, warnings.catch_warnings():
            # peft reads `is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            if not self.adapters:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
            else:
                self.model.load_adapter(path, adapter_name=name)
            self.adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if len(self.adapters) == 1:  # the last one: back to the plain base model
                self.model = self.model.unload()
            else:
                self.model.delete_adapter(name)
            del self.adapters[name]

    def _forward(self, adapter: str | None, **inputs: Any) -> Any:
        """One forward pass with ``adapter`` active (None: the base model); the caller holds the lock."""
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
        with self._lock:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )

    def encode(self, text: str) -> list[int]:
        with self._lock:  # fast tokenizers raise "Already borrowed" when two threads encode at once
            return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)

    def steps(self, prompt_ids: list[int], sampling: Sampling, forced: list[int] | None) -> Iterator[Step]:
        """Samples (or, with ``forced``, replays) one token per iteration, reusing the KV cache."""
        generator = self._generator if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
        k = self.model.config.vocab_size if sampling.top_logprobs == -1 else sampling.top_logprobs
        input_ids, cache = torch.tensor([prompt_ids]), None  # (1, T)
        i = 0
        while forced is None or i < len(forced):
            with self._lock, torch.inference_mode():
                # transformers 5.24 renamed past_key_values to cache (the old name warns until 5.40).
                out = self._forward(sampling.adapter, input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
                logits = out.logits[0, -1].float()  # (V,)
                token = forced[i] if forced is not None else _sample(logits, sampling, generator)
            cache = out.cache
            logp = torch.log_softmax(logits, dim=-1)  # (V,)
            top = logp.topk(k) if k else None
            pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            yield Step(token, logp[token].item(), pairs)
            input_ids, i = torch.tensor([[token]]), i + 1  # (1, 1)


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
    """Token ids -> text -> stop strings -> reasoning/tool-call parser, one token at a time."""
    detok, stops = Detokenizer(engine), StopStrings(sampling.stop)
    parser = OutputParser(parse_tools=sampling.parse_tools)
    for n, step in enumerate(engine.steps(prompt_ids, sampling, forced), start=1):
        finish = None
        if step.token_id in engine.eos_ids or (forced is not None and n == len(forced)):
            finish = "stop"
        elif n >= sampling.max_tokens:
            finish = "length"
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
