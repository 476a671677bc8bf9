"""Batched token-by-token generation for the reference server (eval/upstream/server.py): one scheduler thread
decodes all running requests together (continuous batching, as vLLM does it, simplified), with raw log-probs and
incremental decoding.

    engine = Engine(Path("models/tiny"), seed=0, max_batch=32)
    for piece in generate(engine, prompt_ids, Sampling(max_tokens=16, temperature=0)): ...

Each ``Piece`` is one generated token with its log-prob entry and the parsed events its text produced, so the
server streams a chunk per token. Log-probs are vLLM's default raw ones: log_softmax of the model's logits, before
temperature and top-p. With ``forced`` token ids the model is teacher-forced instead of sampled (scripted replies).

Scheduling. Requests queue for a background thread that owns the model. It prefills each newcomer alone (one forward
over its prompt), then merges that KV cache into the running batch of the same adapter, left-padding the shorter
side: one copy per join. The tokens all of a batch's rows begin with (a harness's system prompt and tools) keep
their KV once for the batch, and each decode step's attention reads it once for all rows (``_Batch``). Each decode
step is then one forward for all rows of one adapter (None: the base model), with an attention mask over the padding
and explicit position ids per row, because Llama/Qwen3 do not infer positions from the mask; batches of different
adapters take turns, step by step. A batch's KV keeps room for a quarter more tokens (at least 64), so a step writes
its column in place instead of copying the whole cache. Every row keeps its own sampling settings and random
generator. Rows leave when they finish or when their consumer stops reading (a stop string, a client that hung up):
the batch is compacted before its next step. At most ``max_batch`` rows run; further requests wait. An error in a
forward pass reaches the requests of that forward as an exception; the scheduler carries on with the others.

Linear attention (Qwen3.5, the seed's family: three Gated DeltaNet layers to one of full attention). Such a layer
keeps no KV per token but two fixed-size states per row, the causal convolution's last inputs and the recurrent
state, which sum up every token of the row. A joining row's states, computed alone with no padding, are stacked on
the batch dim beside the others', and sliced out when rows leave; the left padding stays in the full-attention
layers, as transformers gives linear attention no padding mask on single-token forwards, so a decode step updates
each row's states from its own token alone. Log-probs match one forward over the whole sequence to float noise
(about 1e-6 on the tiny Qwen3.5, tests/eval/upstream/test_engine_linear_attention.py). Sliding-window layers, whose
KV drops old tokens, are refused.

Prefix caching (vLLM's automatic prefix caching, simplified). An agent session's every prompt is the previous one
plus the answer and a tool result, and sessions share a system prompt, so most of a prompt's KV was computed before.
The scheduler keeps the KV of each prompt once prefilled, and of each row when it leaves the batch (finished or
abandoned: prompt and generated tokens, less the last sampled one, which was never fed), keyed by adapter and token
ids, in a store bounded by its total tokens that evicts the least recently used. A newcomer's prefill starts from
the entry sharing the longest common prefix with its prompt, sliced to that prefix, and runs only the rest
(at least the last prompt token, whose logits give the first output token, unless the same prompt came before:
its logits are kept too, so a repeated prompt needs no forward and gets exactly what the first one got). Entries
serve only requests of the same adapter, and loading or unloading an adapter retires its entries. Outputs match a
run without the cache up to float noise: a prefill split in two sums in another order (log-probs within 1e-4).

A linear-attention state exists only at the end of what was fed and cannot be cut back to a shorter prefix, so with
such layers an entry keeps their states at points: the end of each prompt prefilled (with its logits) and the end
of the row that left. A prompt resumes only from a point within what it shares with the entry: an agent session's
next call (its prompt extends the last prompt and answer) and a repeated prompt do, but sessions sharing only a
system prompt prefill it each (no point lies there). Each point's states take as much of the token budget as the
KV of as much memory would: 72 tokens on the tiny Qwen3.5, 816 on Qwen3.5-4B.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import queue
import sys
import threading
import time
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import Any

# Set before transformers imports huggingface_hub, which reads it once: the model is always a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eval.upstream.toolparse import Event, OutputParser, StopStrings

__all__ = ["Detokenizer", "Engine", "Piece", "PrefixCache", "Sampling", "generate"]

_STATS_EVERY_S = 30.0  # how often at most the scheduler logs the prefix cache's counters
# One layer of a cache, batch first: a full-attention layer's keys and values (B, kv_heads, T, head_dim), or a linear-
# attention layer's convolution state (B, conv_dim, kernel) and recurrent state (B, heads, k_dim, v_dim).
_Layer = tuple[torch.Tensor, torch.Tensor]


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
    generated: list[int] = dataclasses.field(default_factory=list)  # sampled (or forced) so far
    model: tuple[str | None, int] = (None, 0)  # (adapter, its load count) at prefill: the key of its cache entries

    @property
    def n_generated(self) -> int:
        return len(self.generated)

    @property
    def last_token(self) -> int:
        """The input of its next decode step."""
        return self.generated[-1]

    @property
    def position(self) -> int:
        """``last_token``'s position: the number of tokens before it, whatever padding the batch adds."""
        return len(self.prompt_ids) + self.n_generated - 1


class _GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__
    """One full-attention layer's KV with spare columns after its tokens, so that a decode step writes its token in
    place: DynamicLayer concatenates, copying the whole layer on every step, a cost that grows with the context and
    the rows of the batch. ``keys`` and ``values`` are views of the tokens held; ``replace`` swaps in new contents."""

    keys: torch.Tensor  # never None here, unlike in DynamicLayer before its first update
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.replace(keys, values)

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Holds a copy of these (B, kv_heads, n, head_dim) with room for a quarter more tokens, at least 64: the
        copies as the layer grows come once per n / 4 steps, one column per step amortized."""
        n = keys.shape[2]
        size = (keys.shape[0], keys.shape[1], n + max(64, n // 4), keys.shape[3])
        self._keys, self._values = keys.new_empty(size), values.new_empty(size)  # (B, kv_heads, capacity, head_dim)
        self._keys[:, :, :n], self._values[:, :, :n] = keys, values
        self.keys, self.values = self._keys[:, :, :n], self._values[:, :, :n]
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n, t = self.keys.shape[2], key_states.shape[2]
        if n + t > self._keys.shape[2]:
            self.replace(self.keys, self.values)
        self._keys[:, :, n : n + t], self._values[:, :, n : n + t] = key_states, value_states
        self.keys, self.values = self._keys[:, :, : n + t], self._values[:, :, : n + t]
        return self.keys, self.values

    def stacked(self, theirs: _Layer, length: int, moved: _Layer | None = None) -> _Layer:
        """These rows' KV, after ``moved`` (keys, values: (1, kv_heads, M, head_dim), columns leaving the shared
        prefix, which every row now holds), and another row's (1, kv_heads, T, head_dim), each left-padded with zeros
        to ``length`` tokens, which the batch's mask hides."""
        (keys, values), (my_keys, my_values) = theirs, (self.keys, self.values)
        if moved is not None:
            rows = my_keys.shape[0]
            my_keys = torch.cat([moved[0].expand(rows, -1, -1, -1), my_keys], 2)
            my_values = torch.cat([moved[1].expand(rows, -1, -1, -1), my_values], 2)
        return _stack_left_padded(my_keys, keys, length, 2), _stack_left_padded(my_values, values, length, 2)

    def selected(self, index: torch.Tensor, start: int) -> _Layer:
        """The KV of the rows at ``index``, from column ``start`` on."""
        return self.keys.index_select(0, index)[:, :, start:], self.values.index_select(0, index)[:, :, start:]

    def row(self, i: int, columns: torch.Tensor) -> _Layer:
        """A copy of row ``i``'s KV at ``columns`` (bool, (L,)): not a view, which would keep the whole batch's
        tensors alive."""
        return self.keys[i : i + 1, :, columns].contiguous(), self.values[i : i + 1, :, columns].contiguous()


class _StateLayer(LinearAttentionLayer):
    """One linear-attention layer's states for the rows of a batch (Qwen3.5's Gated DeltaNet): the causal
    convolution's last inputs (B, conv_dim, kernel) and the recurrent state (B, heads, k_dim, v_dim). Each row's
    states sum up all of its own tokens, so rows stack on the batch dim with no padding. The batch's mask, whose
    left padding is for full attention, never reaches them: transformers gives linear attention no padding mask on
    single-token forwards (masking_utils.create_recurrent_attention_mask), and a decode step updates both states in
    place from the row's own token alone."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        super().__init__()
        # Copies: a forward updates them in place, and the tensors given may belong to a prefix cache entry.
        self.replace(conv.clone(), recurrent.clone())

    def replace(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv_states[0], self.recurrent_states[0] = conv, recurrent
        self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
        self.has_previous_state[0] = True  # what the model checks to continue from them rather than start afresh
        self.conv_kernel_size[0] = conv.shape[-1]

    def stacked(self, theirs: _Layer, length: int, moved: _Layer | None = None) -> _Layer:
        """These rows' states and another row's; ``length`` and ``moved`` are for full attention: states have no token
        dim."""
        conv, recurrent = _tensors(self)
        return torch.cat([conv, theirs[0]]), torch.cat([recurrent, theirs[1]])

    def selected(self, index: torch.Tensor, start: int) -> _Layer:
        """The states of the rows at ``index``; ``start`` is for full attention."""
        conv, recurrent = _tensors(self)
        return conv.index_select(0, index), recurrent.index_select(0, index)

    def row(self, i: int, columns: torch.Tensor) -> _Layer:
        """A copy of row ``i``'s states, those after all its tokens; ``columns`` is for full attention."""
        conv, recurrent = _tensors(self)
        return conv[i : i + 1].clone(), recurrent[i : i + 1].clone()


def _tensors(layer: Any) -> _Layer:
    """A cache layer's contents (see ``_Layer``), batch first."""
    if isinstance(layer, LinearAttentionLayer):
        conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
        assert conv is not None and recurrent is not None  # Gated DeltaNet sets both on every forward
        return conv, recurrent
    return layer.keys, layer.values


class _OutputLayer(torch.nn.Module):
    """A bias-free output layer computing W @ h^T where nn.Linear computes h @ W^T: the same logits up to float
    rounding, but CPU BLAS (MKL) streams the (V, H) weight once for all rows this way, 1.5x faster for 2 to 32 rows
    on SmolLM2's 49152 x 576 head (an AMD EPYC core), as fast for one. It holds the same weight (tied or not)."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight  # (V, H)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
        return (self.weight @ rows.T).T.reshape(*hidden.shape[:-1], -1)  # (..., V)


class _Batch:
    """The running rows of one adapter: one cache, with the padding mask; linear-attention states one per row.

    The leading tokens all rows share (an agent's system prompt and tools: ~1,600 tokens for each Pi session) have
    their full-attention KV held once, in ``shared``; the layers of ``cache``, which the model extends, hold each row's
    columns after them, left-padded to a common length. A decode step's attention (``serving_attention``) reads the
    shared KV once for all rows instead of once per row: at 16 rows that read was most of a step's time. A row that
    joins sharing fewer tokens moves the columns past the common ones out of ``shared`` and into every row."""

    def __init__(self, seq: _Sequence, cache: Any, share: bool) -> None:
        self.rows = [seq]
        self.model = seq.model  # whose KV ``shared`` is: rows of a later load of the adapter share none of it
        n = cache.get_seq_length()
        self.shared_ids = seq.prompt_ids[: n - 1] if share else []  # at least one column stays the row's own
        keep = len(self.shared_ids)
        self.shared: list[_Layer | None] = [  # copies: the prefill's KV may be a prefix cache entry's
            None
            if isinstance(x, LinearAttentionLayer)
            else (x.keys[:, :, :keep].clone(), x.values[:, :, :keep].clone())
            for x in cache.layers
        ]
        # the cache the model reads holds these layers, replaced in place as rows come and go
        self.layers = [
            _StateLayer(*_tensors(x))
            if isinstance(x, LinearAttentionLayer)
            else _GrowingLayer(x.keys[:, :, keep:], x.values[:, :, keep:])
            for x in cache.layers
        ]
        self.cache = Cache(layers=[*self.layers])
        self.mask = torch.ones(1, n - keep, dtype=torch.long)  # (B, L): 0 on left padding

    def join(self, seq: _Sequence, cache: Any) -> None:
        """Appends a prefilled row (its cache: batch of 1). Every tensor is built before any is replaced, so a
        failure leaves the batch as it was."""
        n = cache.get_seq_length()
        same = seq.model == self.model
        keep = min(_common_prefix(torch.tensor(self.shared_ids), torch.tensor(seq.prompt_ids)), n - 1) if same else 0
        moved = len(self.shared_ids) - keep  # columns that leave the shared KV for every row's own
        length = max(self.mask.shape[1] + moved, n - keep)
        stacked = []
        for mine, theirs, shared in zip(self.layers, cache.layers, self.shared, strict=True):
            if shared is None:
                stacked.append(mine.stacked(_tensors(theirs), length))
            else:
                own = (theirs.keys[:, :, keep:], theirs.values[:, :, keep:])
                leaving = (shared[0][:, :, keep:], shared[1][:, :, keep:]) if moved else None
                stacked.append(mine.stacked(own, length, leaving))
        mask = F.pad(self.mask, (moved, 0), value=1)  # (B, L + moved)
        ones = torch.ones(1, n - keep, dtype=torch.long)  # (1, T - keep)
        mask = _stack_left_padded(mask, ones, length, 1)
        for layer, tensors in zip(self.layers, stacked, strict=True):
            layer.replace(*tensors)  # B + 1 rows
        self.shared = [None if x is None else (x[0][:, :, :keep], x[1][:, :, :keep]) for x in self.shared]
        self.shared_ids = self.shared_ids[:keep]
        self.mask = mask  # (B + 1, length)
        self.rows.append(seq)

    def row_cache(self, i: int) -> tuple[int, list[_Layer]]:
        """Row ``i``'s token count n (all it was fed) and a copy of its cache per layer: its KV, the shared columns
        and its own, or its states, which follow those n tokens."""
        columns = self.mask[i].bool()  # (L,)
        n = len(self.shared_ids) + int(columns.sum())
        layers = []
        for layer, shared in zip(self.layers, self.shared, strict=True):
            own = layer.row(i, columns)
            layers.append(
                own if shared is None else (torch.cat([shared[0], own[0]], 2), torch.cat([shared[1], own[1]], 2))
            )
        return n, layers

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
        for layer in self.layers:
            layer.replace(*layer.selected(index, start))  # B' rows, L' columns of KV


def _stack_left_padded(a: torch.Tensor, b: torch.Tensor, length: int, seq_dim: int) -> torch.Tensor:
    """``a`` and ``b`` concatenated on the batch dim (0), each zero-padded on the left of ``seq_dim`` to ``length``."""
    trailing = (0, 0) * (a.dim() - seq_dim - 1)  # F.pad takes (left, right) pairs from the last dim backwards
    return torch.cat([F.pad(x, (*trailing, length - x.shape[seq_dim], 0)) for x in (a, b)])


@dataclasses.dataclass(eq=False)
class _Entry:
    model: tuple[str | None, int]  # (adapter, its load count when the KV was computed); (None, 0): the base model
    ids: torch.Tensor  # (T,) the token ids whose KV is held
    kv: list[_Layer]  # per full-attention layer: keys, values (1, kv_heads, T, head_dim), good for any prefix
    # n -> per linear-attention layer: its states after ids[:n]. A state sums up every token before it and cannot be
    # cut back, so with such layers an entry serves only from these points; empty without them.
    states: dict[int, list[_Layer]]
    logits: dict[int, torch.Tensor]  # prompt length n -> the logits (1, V) after ids[:n], for prompts ending there
    state_tokens: int  # what one point of states costs in the budget: as many tokens as take its memory in KV

    @property
    def cost(self) -> int:
        return len(self.ids) + self.state_tokens * len(self.states)


class PrefixCache:
    """KV caches of earlier prompts and answers, for prompts that start with the same tokens: at most
    ``max_tokens`` tokens in all (0: off), the least recently used evicted first. The scheduler thread owns it;
    the counters are for tests and the stats line.

    Each prompt's logits after its last token are kept too, so a prompt seen before (a GRPO group's samples, a
    retried call) needs no forward pass at all and gets exactly what the first got.

    ``linear_layers`` says which of the model's layers are linear attention (Qwen3.5's Gated DeltaNet: fixed-size
    states, see ``_Entry.states``); their states at a point count in the budget as the tokens whose KV would take
    the same memory."""

    def __init__(self, max_tokens: int, linear_layers: list[bool]) -> None:
        if max_tokens < 0:
            raise ValueError(f"the prefix cache's token budget must be at least 0 (0: off), not {max_tokens}")
        self.max_tokens = max_tokens
        self.linear_layers = linear_layers
        self.entries: list[_Entry] = []  # least recently used first; none is a prefix of another of its model
        self.prompts = self.hits = 0  # prefills; those that started from a cached prefix
        self.reused_tokens = self.prefilled_tokens = 0  # prompt tokens taken from the cache; run through the model

    @property
    def tokens(self) -> int:
        """Held by all entries, their states' points included."""
        return sum(entry.cost for entry in self.entries)

    def match(self, model: tuple[str | None, int], prompt_ids: list[int]) -> tuple[int, Any, torch.Tensor | None]:
        """The longest cached prefix of the prompt that an entry can resume from: its length n, a cache holding its
        KV (and states), and the logits after it when it is the whole prompt (else n < len(prompt_ids): the rest
        needs a forward pass); or (0, None, None). Counts the prompt's tokens as reused or to prefill."""
        ids = torch.tensor(prompt_ids)  # (T,)
        best, n = None, 0
        for entry in self.entries:
            if entry.model == model:
                resume = self._resume_point(entry, _common_prefix(entry.ids, ids), len(prompt_ids))
                if resume > n:
                    best, n = entry, resume
        self.prompts += 1
        self.prefilled_tokens += len(prompt_ids) - n
        if best is None:
            return 0, None, None
        self._touch(best)
        self.hits += 1
        self.reused_tokens += n
        kv, states = iter(best.kv), iter(best.states.get(n, []))
        # Both kinds copy what they are given, so the forward's updates never reach the entry.
        cache = Cache(
            layers=[_StateLayer(*next(states)) if linear else _kv_layer(*next(kv), n) for linear in self.linear_layers]
        )
        return n, cache, best.logits[n] if n == len(prompt_ids) else None

    def _resume_point(self, entry: _Entry, common: int, length: int) -> int:
        """How much of a prompt of ``length`` tokens, ``common`` of which start ``entry`` too, the entry can stand
        for: all of it when it holds the logits after it; else at most all but the last token, which must run
        through the model for its logits, and with linear-attention layers only a point where it holds their
        states."""
        if common == length and length in entry.logits:
            return length
        if not any(self.linear_layers):
            return max(min(common, length - 1), 0)
        return max((n for n in entry.states if n <= min(common, length - 1)), default=0)

    def put(
        self, model: tuple[str | None, int], ids: list[int], layers: list[_Layer], logits: torch.Tensor | None = None
    ) -> None:
        """Keeps ``layers``, the cache of exactly ``ids`` (and ``logits``, those after the last of them), unless an
        entry holds them already (it then takes the states at their end, if it lacks them); entries that ``ids``
        extends are dropped, passing on their logits and the states at those points, then the least recently used
        over budget. The states where a row left, which hold no logits, are not passed on: the prompt that extends
        them was prefilled from them, and its own end is the point its session goes on from."""
        kv = [x for x, linear in zip(layers, self.linear_layers, strict=True) if not linear]
        states = [x for x, linear in zip(layers, self.linear_layers, strict=True) if linear]
        state_tokens = _state_tokens(kv, states)
        if not 0 < len(ids) + state_tokens <= self.max_tokens:
            return
        new = torch.tensor(ids)  # (T,)
        kept = {} if logits is None else {len(ids): logits}
        points = {len(ids): states} if states else {}
        for entry in [e for e in self.entries if e.model == model]:
            common = _common_prefix(entry.ids, new)
            if common == len(ids):  # this entry holds them, and maybe more
                entry.logits.update(kept)
                if states:
                    entry.states.setdefault(len(ids), states)
                self._touch(entry)
                break
            if common == len(entry.ids):  # all it could give, the new one gives
                kept.update(entry.logits)
                points.update({n: s for n, s in entry.states.items() if n in entry.logits})
                self.entries.remove(entry)
        else:
            self.entries.append(_Entry(model, new, kv, points, kept, state_tokens))
        while self.tokens > self.max_tokens:
            self.entries.remove(self.entries[0])

    def retain(self, models: set[tuple[str | None, int]]) -> None:
        """Drops the entries of any other model: adapters unloaded, or loaded again since (new weights)."""
        for entry in [e for e in self.entries if e.model not in models]:
            self.entries.remove(entry)

    def summary(self) -> str:
        total = self.reused_tokens + self.prefilled_tokens
        return (
            f"prefix cache: {self.hits} of {self.prompts} prompts hit, {self.reused_tokens} of {total} prompt tokens "
            f"reused ({self.reused_tokens / max(total, 1):.1%}); {len(self.entries)} entries hold {self.tokens} of "
            f"{self.max_tokens} tokens"
        )

    def _touch(self, entry: _Entry) -> None:
        self.entries.remove(entry)
        self.entries.append(entry)


ATTENTION = "polar_serving"
_decoding = threading.local()  # .shared: the running batch's shared KV per layer, during its decode step's forward


@contextlib.contextmanager
def _attending_to(shared: list[_Layer | None]) -> Generator[None, None, None]:
    """Within: decode steps' attention also reads these shared columns (``_Batch.shared``, per layer)."""
    _decoding.shared = shared
    try:
        yield
    finally:
        _decoding.shared = None


def serving_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa, except for the scheduler's decode steps on the CPU: there the one query of each row runs as
    matmuls over its key/value head, the softmax in fp32, and reads the KV the batch's rows share once for all rows
    (``_Batch``) before each row's own. SmolLM2 at a batch of 16 over a shared ~1,600-token prompt: a fp32 step took
    296 ms reading that KV once per row, 90 ms over a 100-token prompt. In bf16, SDPA's CPU kernel also took 3.6 ms a
    layer (64 % of the step) where the matmuls take ~1 ms (tests/bench/server.py)."""
    rows, heads, length, dim = query.shape
    shared_layers = getattr(_decoding, "shared", None)
    layer = getattr(module, "layer_idx", None)
    shared = shared_layers[layer] if shared_layers is not None and layer is not None else None
    if length != 1 or query.device.type != "cpu" or dropout or (shared is None and query.dtype == torch.float32):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    grouped = query.reshape(rows, kv_heads, groups, dim)  # (B, H_kv, G, D): query heads share a KV head
    scores = torch.matmul(grouped, key.transpose(-1, -2))  # (B, H_kv, G, L)
    if shared is not None:  # every row's queries at once against each KV head's shared columns: read once
        across = grouped.transpose(0, 1).reshape(kv_heads, rows * groups, dim)  # (H_kv, B * G, D)
        shared_scores = torch.matmul(across, shared[0][0].transpose(-1, -2))  # (H_kv, B * G, S)
        scores = torch.cat([shared_scores.reshape(kv_heads, rows, groups, -1).transpose(0, 1), scores], -1)
    scores = scores.float() * (dim**-0.5 if scaling is None else scaling)  # (B, H_kv, G, S + L)
    s = scores.shape[-1] - key.shape[2]  # the shared columns come first (S = 0 without them)
    if attention_mask is not None:  # (B, 1, 1, L): bool (True attends) or additive; the shared columns all attend
        if attention_mask.dtype == torch.bool:
            scores[..., s:].masked_fill_(~attention_mask, float("-inf"))
        else:
            scores[..., s:] += attention_mask
    probs = scores.softmax(-1).to(value.dtype)
    out = torch.matmul(probs[..., s:], value)  # (B, H_kv, G, D)
    if shared is not None:
        across = probs[..., :s].transpose(0, 1).reshape(kv_heads, rows * groups, s)  # (H_kv, B * G, S)
        out += torch.matmul(across, shared[1][0]).reshape(kv_heads, rows, groups, dim).transpose(0, 1)
    return out.reshape(rows, 1, heads, dim), None


def _register_attention() -> str:
    """``ATTENTION`` as a transformers attention backend, with sdpa's masks (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, serving_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    return ATTENTION


def _kv_layer(keys: torch.Tensor, values: torch.Tensor, n: int) -> DynamicLayer:
    """A full-attention cache layer holding a copy of the first ``n`` tokens of these keys and values."""
    layer = DynamicLayer()  # type: ignore[no-untyped-call]
    layer.update(keys[:, :, :n], values[:, :, :n])  # concatenates to nothing: a copy
    return layer


def _state_tokens(kv: list[_Layer], states: list[_Layer]) -> int:
    """How many tokens' full-attention KV take the memory of these linear-attention states (0 without them)."""
    if not states:
        return 0
    per_token = sum(x[0, :, 0].numel() * x.element_size() for layer in kv for x in layer)
    return -(-sum(x.numel() * x.element_size() for layer in states for x in layer) // per_token)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading token ids ``a`` and ``b`` (1-D) share."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()  # (k, 1)
    return int(differ[0]) if len(differ) else n


class Engine:
    """The model, driven by one scheduler thread that batches the decode steps of all running requests, and the
    tokenizer, which request threads use behind a lock."""

    def __init__(
        self,
        model_dir: Path,
        seed: int,
        max_batch: int = 32,
        prefix_cache_tokens: int = 65536,
        dtype: str = "float32",
        share_prefix: bool = True,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.cache_utils import get_layer_types_and_kwargs

        from train.precision import choose_dtype

        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        # Any: transformers types its Auto classes' results loosely, and the model becomes a PeftModel with adapters.
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # auto: bf16 where this CPU runs it >= 1.5x faster (train/precision.py, the trainer's rule); log-probs and
        # sampling stay fp32 either way (the logits are cast before the softmax).
        weights_dtype, self.dtype_reason = choose_dtype(dtype, cuda=False)
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=weights_dtype, local_files_only=True, attn_implementation=_register_attention()
        )
        self.model.eval()  # type: ignore[no-untyped-call]
        head = self.model.get_output_embeddings()  # type: ignore[no-untyped-call]
        if type(head) is torch.nn.Linear and head.bias is None:  # train/grpo.py's adapters leave it out, as vLLM's do
            self.model.set_output_embeddings(_OutputLayer(head.weight))
        # Joining rows left-pads full attention's KV to a common length, and stacks linear attention's states, one
        # per row; a sliding window drops tokens, and its KV cannot be padded into a batch this way. The tokens
        # counted and the mask's size come from full-attention layers, so there must be one.
        layer_types, layer_kwargs = get_layer_types_and_kwargs(self.model.config.get_text_config(decoder=True))
        others = set(layer_types) - {"full_attention", "linear_attention"}
        if (
            others
            or "full_attention" not in layer_types
            or any(k.get("number_of_states", 1) != 1 for k in layer_kwargs)
        ):
            raise ValueError(
                f"{model_dir}: layers {sorted(set(layer_types))} cannot be batched here: only full attention, alone "
                "or with linear attention of one state per layer (Qwen3.5's Gated DeltaNet)"
            )
        self.linear_layers = [t == "linear_attention" for t in layer_types]  # the others are full attention
        self.max_len: int = self.model.config.max_position_embeddings
        vocab = self.tokenizer.get_vocab()
        eos = {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab}
        self.eos_ids = eos | {self.tokenizer.eos_token_id}
        self.max_batch = max_batch
        self.share_prefix = share_prefix  # False: every row holds and reads its own copy of the common tokens' KV
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> the folder it was loaded from
        self._loads: dict[str | None, int] = {}  # adapter name -> loads and unloads so far: a new count retires its KV
        self.prefix_cache = PrefixCache(prefix_cache_tokens, self.linear_layers)  # the scheduler thread's alone
        self._stats_due = time.monotonic() + _STATS_EVERY_S
        self._tokenizer_lock = threading.Lock()  # fast tokenizers raise "Already borrowed" when two threads encode
        self._model_lock = threading.Lock()  # adapters are loaded and unloaded between forward passes
        self._generator = torch.Generator().manual_seed(seed)  # the scheduler thread's alone
        self._waiting: queue.Queue[_Sequence | None] = queue.Queue()  # None: wake up to stop
        self._batches: dict[str | None, _Batch] = {}  # adapter -> its running rows; the scheduler thread's alone
        self._stopping = threading.Event()
        self._scheduler = threading.Thread(target=self._schedule, name="engine-scheduler", daemon=True)
        self._scheduler.start()
        atexit.register(self._stop)
        print(
            f"engine: {torch.get_num_threads()} torch threads, up to {max_batch} requests per batch, prefix cache "
            f"{prefix_cache_tokens} tokens, {str(weights_dtype).removeprefix('torch.')} weights ({self.dtype_reason})",
            file=sys.stderr,
            flush=True,
        )

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
            self._loads[name] = self._loads.get(name, 0) + 1

    def unload_adapter(self, name: str) -> None:
        with self._model_lock:
            if len(self.adapters) == 1:  # the last one: back to the plain base model
                self.model = self.model.unload()
            else:
                self.model.delete_adapter(name)
            del self.adapters[name]
            self._loads[name] += 1

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
            text: str = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )
        return text

    def encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    def token_text(self, token_id: int) -> str:
        text: str = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        return text

    def steps(self, prompt_ids: list[int], sampling: Sampling, forced: list[int] | None) -> Generator[Step, None, None]:
        """Queues the request now; the iterator yields its tokens as the scheduler samples them (with ``forced``:
        replays them). Closing the iterator early takes the request out of the batch."""
        generator = self._generator if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
        seq = _Sequence(prompt_ids, sampling, forced, generator)
        self._waiting.put(seq)
        return self._replies(seq)

    def _replies(self, seq: _Sequence) -> Generator[Step, None, None]:
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
        """One forward over the prompt alone, or over what follows its longest cached prefix, then the row joins its
        adapter's batch unless it is already done. The prompt's KV goes to the prefix cache, so that requests queued
        behind it with the same system prompt reuse it at once."""
        adapter = seq.sampling.adapter
        try:
            with self._model_lock:  # adapters change between forward passes, so their load counts cannot here
                seq.model = (adapter, self._loads.get(adapter, 0))
                self.prefix_cache.retain({(None, 0), *((name, self._loads[name]) for name in self.adapters)})
                start, cache, logits = self.prefix_cache.match(seq.model, seq.prompt_ids)
                if logits is None:  # else the whole prompt was cached, and the logits after it
                    out = self._forward(
                        adapter,
                        input_ids=torch.tensor([seq.prompt_ids[start:]]),  # (1, T - start)
                        position_ids=torch.arange(start, len(seq.prompt_ids))[None],  # (1, T - start)
                        cache=cache,  # None: no cached prefix
                        use_cache=True,
                        logits_to_keep=1,
                    )
                    cache, logits = out.cache, out.logits[:, -1].float()  # (1, V)
            self.prefix_cache.put(seq.model, seq.prompt_ids, [_tensors(x) for x in cache.layers], logits)
            self._log_stats()
            if not self._emit([seq], logits):
                return
            if adapter in self._batches:
                self._batches[adapter].join(seq, cache)
            else:
                self._batches[adapter] = _Batch(seq, cache, self.share_prefix)
        except Exception as e:  # noqa: BLE001 - whatever it is, the request gets it instead of hanging
            seq.replies.put(e)

    def _decode(self, adapter: str | None) -> None:
        """One forward for all rows of ``adapter``'s batch; rows that finish or were abandoned leave it."""
        batch = self._batches[adapter]
        try:
            self._leave(batch, [i for i, seq in enumerate(batch.rows) if not seq.cancelled])
            if batch.rows:
                input_ids = torch.tensor([[seq.last_token] for seq in batch.rows])  # (B, 1)
                position_ids = torch.tensor([[seq.position] for seq in batch.rows])  # (B, 1)
                mask = F.pad(batch.mask, (0, 1), value=1)  # (B, L + 1)
                with self._model_lock, _attending_to(batch.shared):
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
                self._leave(batch, self._emit(batch.rows, out.logits[:, -1].float()))  # (B, V)
        except Exception as e:  # noqa: BLE001 - the batch's requests get it; the other batches carry on
            for seq in batch.rows:
                seq.replies.put(e)
            batch.rows = []
        if not batch.rows:
            del self._batches[adapter]

    def _leave(self, batch: _Batch, staying: list[int]) -> None:
        """``batch.keep(staying)``, once the KV of the rows leaving is in the prefix cache: all their tokens that
        went through the model (not the last sampled one, unless its forward ran before the row was abandoned)."""
        if self.prefix_cache.max_tokens:
            for i in sorted(set(range(len(batch.rows))) - set(staying)):
                seq = batch.rows[i]
                n, layers = batch.row_cache(i)
                self.prefix_cache.put(seq.model, (seq.prompt_ids + seq.generated)[:n], layers)
        batch.keep(staying)

    def _log_stats(self) -> None:
        """Now and then a line on stderr, the server's log, on what the prefix cache saved (vLLM logs its hit rate)."""
        if self.prefix_cache.max_tokens and time.monotonic() >= self._stats_due:
            self._stats_due = time.monotonic() + _STATS_EVERY_S
            print(f"engine: {self.prefix_cache.summary()}", file=sys.stderr, flush=True)

    def _emit(self, rows: list[_Sequence], logits: torch.Tensor) -> list[int]:
        """Picks each row's next token from its logits (B, V) and sends it; returns the indices of unfinished rows."""
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        going_on = []
        for i, (seq, row_logits, row_logp) in enumerate(zip(rows, logits, logp, strict=True)):
            if seq.cancelled:
                continue
            forced = seq.forced
            token = forced[seq.n_generated] if forced is not None else _sample(row_logits, seq.sampling, seq.generator)
            seq.generated.append(token)
            k = row_logp.shape[-1] if seq.sampling.top_logprobs == -1 else seq.sampling.top_logprobs
            top = row_logp.topk(k) if k else None
            pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
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
) -> Generator[Piece, None, None]:
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
