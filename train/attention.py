"""The trainer's attention: causal within each packed trace's bounds, with no (T, T) mask.

Packed traces restart their position ids at 0. transformers' sdpa and eager backends keep them apart with a block-
diagonal (T, T) mask, which sends SDPA to its dense path: every trace then pays for attention over the whole row, and
the (T, T) scores exist in memory at every layer. Registered under ``NAME`` (``--attn-implementation`` left unset),
transformers builds no mask at all for this backend, and the policy passes each trace's ``(start, end)`` in the row
as ``trace_spans``: one causal SDPA per trace, which takes SDPA's fused path.

Attention logit soft-capping (Gemma 2) is not applied here: load_policy refuses such a model on this backend.
A 4D mask given explicitly (``--share-prefix``'s, train/data.py) is applied as given.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["NAME", "register", "span_attention", "trace_spans"]

NAME = "polar_trace_spans"


def trace_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each trace of a packed row (1, T), found where its positions restart at 0."""
    starts = [*(position_ids[0] == 0).nonzero()[:, 0].tolist(), position_ids.shape[1]]
    return list(itertools.pairwise(starts))


def _causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int | None, **sdpa: Any) -> Any:
    """Causal SDPA of one trace; a sliding window (when the trace is longer than it) as a (L, L) band."""
    length = query.shape[2]
    if window is None or length <= window:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, **sdpa)
    i = torch.arange(length, device=query.device)
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)  # (L, L)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=band, **sdpa)


def span_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    trace_spans: list[tuple[int, int]] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: (B, H, L, D) queries, (B, H_kv, L, D) keys and values -> (B, L, H, D)."""
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key/value head serves several query heads
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    sdpa: dict[str, Any] = {"dropout_p": dropout, "scale": scaling}
    if attention_mask is not None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, **sdpa)
    else:
        window = getattr(module, "sliding_window", None)
        spans = trace_spans or [(0, query.shape[2])]
        parts = [_causal(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], window, **sdpa) for a, b in spans]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ``NAME`` a transformers attention backend (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, span_attention)
    return NAME
