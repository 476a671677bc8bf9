"""The trainer's attention: causal within each packed trace's bounds, with no (T, T) mask.

Packed traces restart their position ids at 0. transformers' sdpa and eager backends keep them apart with a block-
diagonal (T, T) mask, which sends SDPA to its dense path: every trace then pays for attention over the whole row, and
the (T, T) scores exist in memory at every layer. Registered under ``NAME`` (``--attn-implementation`` left unset),
transformers builds no mask at all for this backend, and the policy passes each trace's ``(start, end)`` in the row
as ``trace_spans``: one causal SDPA per trace, which takes SDPA's fused path.

Keys longer than the queries are tails after a shared prefix (train/prefix.py): the prefix's keys come first, and
each query attends to all of them and causally within its tail, through a small (L, P + L) mask.

Attention logit soft-capping (Gemma 2) is not applied here: load_policy refuses such a model on this backend.
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
    """Causal SDPA, the last query aligned with the last key: one trace (as many keys as queries), or tails after a
    prefix (more keys). A sliding window, where some query reaches past it, as a band."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if kv_len == q_len and (window is None or q_len <= window):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, **sdpa)
    i = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)  # each query's own key
    j = torch.arange(kv_len, device=query.device)[None, :]
    allowed = j <= i  # (L, P + L)
    if window is not None:
        allowed &= i - j < window
    # An additive float mask: SDPA's CPU kernels take it on their fused path.
    mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, **sdpa)


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
    if attention_mask is not None:  # transformers builds none for this backend: one would come from a caller
        raise ValueError(f"{NAME} attends by trace spans and takes no attention mask")
    sdpa: dict[str, Any] = {"dropout_p": dropout, "scale": scaling}
    window = getattr(module, "sliding_window", None)
    if trace_spans is None:
        out = _causal(query, key, value, window, **sdpa)
    else:
        parts = [_causal(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], window, **sdpa) for a, b in trace_spans]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ``NAME`` a transformers attention backend (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, span_attention)
    return NAME
