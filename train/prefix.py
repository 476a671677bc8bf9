"""Shared-prefix training (``--share-prefix``): a family's prompt computed once, branched into each trace's tail.

The samples of a task begin with one prompt. A *family* of such traces runs in two passes instead of one row each:

1. The prefix, one (1, P) row, through a ``Record`` cache: each attention layer keeps its keys and values, each
   linear-attention layer (Qwen3.5's Gated DeltaNet) the last inputs of its convolution and its recurrent state.
2. The tails, right-padded rows (k, L) at positions P.., through a ``Branch`` cache: every attention layer hands
   the prefix's keys and values to the attention function, which attends to all of the prefix and causally within
   the tail (train/attention.py), the prefix stored once for all rows; every linear-attention layer starts its
   convolution and its recurrence from the prefix's (views, expanded over the rows). Causal layers never read the
   padding after a token.

So each unique token is computed once, the prefix's once per family, with no (T, T) tensor anywhere, and each trace
gets what it would get alone, up to float rounding.

A family whose tails do not fit one micro-batch is split into chunks, consecutive micro-batches of one rank (train/
data.py). The first chunk computes the prefix, with its graph, and trains the tokens inside it; it and the chunks
before the last read detached copies of the prefix's states, whose ``.grad`` gathers what their losses send back.
The last chunk's tails read the live states, and its loss's backward also hands them what was gathered
(``bridge_gradient``): one forward and one backward pass through the prefix for the whole family. The prefix's graph
lives from the first chunk to the last one's backward; under gradient checkpointing it holds each layer's input,
beside the keys and values the tails read (about 90 MB for 1,600 tokens of SmolLM2 in bf16).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Branch", "PrefixStates", "Record", "SharedPrefix", "bridge_gradient"]


@dataclasses.dataclass
class SharedPrefix:
    """A micro-batch's family prefix, and where the micro-batch stands among the family's chunks."""

    input_ids: torch.Tensor  # (1, P)
    family: int  # the family's index in its optimizer step: the chunks of one family share its computed prefix
    first: bool  # this chunk computes the prefix, and trains the tokens inside it
    last: bool  # this chunk ends the family: it sends the prefix its gradient

    def to(self, device: torch.device) -> SharedPrefix:
        return dataclasses.replace(self, input_ids=self.input_ids.to(device))


@dataclasses.dataclass
class PrefixStates:
    """What the tails need of a computed prefix, by layer index."""

    keys: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # (1, H_kv, P, D)
    values: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # (1, H_kv, P, D)
    conv: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # (1, C, K - 1) last convolution inputs
    recurrent: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # (1, heads, D_k, D_v)
    hidden: torch.Tensor | None = None  # (P, H) the decoder's output on the prefix, for its trained tokens

    def tensors(self) -> list[torch.Tensor]:
        parts = [self.keys, self.values, self.conv, self.recurrent]
        found = [t for part in parts for _, t in sorted(part.items())]
        return found + ([self.hidden] if self.hidden is not None else [])

    def detached(self, requires_grad: bool) -> PrefixStates:
        """Leaf copies; with ``requires_grad`` their ``.grad`` gathers what the chunks that read them send back."""

        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().requires_grad_(requires_grad)

        return PrefixStates(
            keys={i: leaf(t) for i, t in self.keys.items()},
            values={i: leaf(t) for i, t in self.values.items()},
            conv={i: leaf(t) for i, t in self.conv.items()},
            recurrent={i: leaf(t) for i, t in self.recurrent.items()},
            hidden=None if self.hidden is None else leaf(self.hidden),
        )


class _Bridge(torch.autograd.Function):
    """The identity on a loss, whose backward also hands each live prefix tensor the gradient gathered for it: as
    gathered, already scaled as every chunk's loss is (the scripts scale each by the process count), so it is not
    scaled again by the loss it rides on."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, gathered: tuple[torch.Tensor, ...], *live: torch.Tensor) -> torch.Tensor:
        ctx.gathered = gathered
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, None, *ctx.gathered)


def bridge_gradient(loss: torch.Tensor, live: PrefixStates, read: PrefixStates) -> torch.Tensor:
    """``loss``, through whose backward the live prefix also gets what the earlier chunks sent its detached copies
    ``read`` (their ``.grad``): one backward pass through the prefix for every chunk of the family."""
    pairs = [
        (t, r.grad)
        for t, r in zip(live.tensors(), read.tensors(), strict=True)
        if r.grad is not None and t.requires_grad
    ]
    if not pairs:
        return loss
    gathered = tuple(g for _, g in pairs)
    bridged: torch.Tensor = _Bridge.apply(loss, gathered, *(t for t, _ in pairs))  # type: ignore[no-untyped-call]
    return bridged


class Record:
    """The cache of the prefix's pass: it keeps what each layer computes and changes nothing, since the prefix is a
    whole sequence. Only the methods transformers' layers call are here. A layer replayed by gradient checkpointing
    stores again, by assignment, what it stored the first time."""

    def __init__(self, states: PrefixStates) -> None:
        self.states = states

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.states.keys[layer_idx], self.states.values[layer_idx] = key, value
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # never the single-token decode kernel, which updates a state in place

    def update_conv_state(self, mixed: torch.Tensor, layer_idx: int, conv_kernel_size: int) -> torch.Tensor:
        """(1, C, P) convolution inputs: keep the last K - 1 (zeros before the start), return them unchanged."""
        self.states.conv[layer_idx] = F.pad(mixed, (conv_kernel_size - 1, 0))[:, :, mixed.shape[2] :]
        return mixed

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int) -> None:
        self.states.recurrent[layer_idx] = state


class Branch:
    """The cache of the tails' pass: every row continues from the one prefix in ``states``."""

    def __init__(self, states: PrefixStates, rows: int) -> None:
        self.states, self.rows = states, rows

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.expand(self.rows, *t.shape[1:])  # a view: the prefix is stored once

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tails' (k, H_kv, L, D) keys and values, unchanged; the prefix's go to the attention function as
        ``shared_prefix``, through ``kwargs``: the attention layer's own keyword arguments, which transformers'
        layers pass here and then to the attention function."""
        if kwargs is None:
            raise TypeError(f"layer {layer_idx}'s attention passes the cache no kwargs: --share-prefix cannot reach it")
        kwargs["shared_prefix"] = (self.states.keys[layer_idx], self.states.values[layer_idx])
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.states.hidden is None else self.states.hidden.shape[0]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self._rows(self.states.conv[layer_idx])

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self._rows(self.states.recurrent[layer_idx])

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # the expanded states are views: never the kernel that updates them in place

    def update_conv_state(self, mixed: torch.Tensor, layer_idx: int, conv_kernel_size: int) -> torch.Tensor:
        """(k, C, L) convolution inputs -> (k, C, K - 1 + L), the prefix's last inputs first (the layer keeps the
        last L outputs)."""
        return torch.cat([self._rows(self.states.conv[layer_idx]), mixed], dim=2)

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int) -> None:
        return None  # the tails' final states are not needed
