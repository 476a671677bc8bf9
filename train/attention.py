"""The trainer's attention: causal within each packed trace's bounds, with no (T, T) mask.

Packed traces restart their position ids at 0. transformers' sdpa and eager backends keep them apart with a block-
diagonal (T, T) mask, which sends SDPA to its dense path: every trace then pays for attention over the whole row, and
the (T, T) scores exist in memory at every layer. Registered under ``NAME`` (``--attn-implementation`` left unset),
transformers builds no mask at all for this backend, and the policy passes each trace's ``(start, end)`` in the row
as ``trace_spans``: one causal SDPA per trace, which takes SDPA's fused path.

Tails after a shared prefix (train/prefix.py) come as rows of L queries, keys and values, with the prefix's own
(1, H_kv, P, D) keys and values as ``shared_prefix`` (the Branch cache puts them there). Each query attends to all of
the prefix and causally within its tail. On the CPU, ``PrefixThenTail`` runs that as two unmasked fused SDPA calls
merged by their log-sum-exps; elsewhere (or with dropout or a sliding window) one SDPA call over the prefix's keys
then the tail's takes a small (L, P + L) mask.

Attention logit soft-capping (Gemma 2) is not applied here: load_policy refuses such a model on this backend.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["NAME", "PrefixThenTail", "register", "span_attention", "trace_spans"]

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


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class PrefixThenTail(torch.autograd.Function):
    """Tails after a shared prefix, on the CPU: every query of the k rows against the prefix's keys as one unmasked
    row (the prefix is not copied per row), and each row causally against its own keys; the two softmaxes merged by
    their log-sum-exps. One masked SDPA over (L, P + L) takes 1.5x as long on the Pi-shaped micro-batch
    (tests/bench/train.py). The backward hands each part the merged output and log-sum-exp: the whole softmax's
    gradient restricted to that part's keys (as ring attention splits it). Heads must match (GQA repeated before)."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,  # (k, H, L, D)
        prefix_key: torch.Tensor,  # (1, H, P, D)
        prefix_value: torch.Tensor,  # (1, H, P, D)
        key: torch.Tensor,  # (k, H, L, D)
        value: torch.Tensor,  # (k, H, L, D)
        scale: float | None,
    ) -> torch.Tensor:
        rows, heads, length, dim = query.shape
        flat = query.transpose(0, 1).reshape(1, heads, rows * length, dim)  # (1, H, k * L, D)
        out_p, lse_p = _flash(flat, prefix_key, prefix_value, 0.0, False, scale=scale)
        out_t, lse_t = _flash(query, key, value, 0.0, True, scale=scale)  # (k, H, L, D), (k, H, L)
        out_p = out_p.reshape(heads, rows, length, dim).transpose(0, 1)
        lse_p = lse_p.reshape(heads, rows, length).transpose(0, 1)  # (k, H, L) float32
        lse = torch.logaddexp(lse_p, lse_t)
        merged = torch.exp(lse_p - lse)[..., None] * out_p.float() + torch.exp(lse_t - lse)[..., None] * out_t.float()
        out: torch.Tensor = merged.to(query.dtype).contiguous()
        ctx.save_for_backward(query, prefix_key, prefix_value, key, value, out, lse.contiguous())
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, prefix_key, prefix_value, key, value, out, lse = ctx.saved_tensors
        rows, heads, length, dim = query.shape
        grad = grad.contiguous()

        def flat(t: torch.Tensor) -> torch.Tensor:  # (k, H, L, ...) -> (1, H, k * L, ...)
            return t.transpose(0, 1).reshape(1, heads, rows * length, *t.shape[3:])

        dq_p, dk_p, dv_p = _flash_backward(
            flat(grad), flat(query), prefix_key, prefix_value, flat(out), flat(lse), 0.0, False, scale=ctx.scale
        )
        dq_t, dk_t, dv_t = _flash_backward(grad, query, key, value, out, lse, 0.0, True, scale=ctx.scale)
        dq = dq_p.reshape(heads, rows, length, dim).transpose(0, 1) + dq_t
        return dq, dk_p, dv_p, dk_t, dv_t, None


def span_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    trace_spans: list[tuple[int, int]] | None = None,
    shared_prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: (B, H, L, D) queries, (B, H_kv, L, D) keys and values -> (B, L, H, D)."""
    if attention_mask is not None:  # transformers builds none for this backend: one would come from a caller
        raise ValueError(f"{NAME} attends by trace spans and takes no attention mask")
    window = getattr(module, "sliding_window", None)
    repeats = query.shape[1] // key.shape[1]  # grouped-query attention: each key/value head serves several
    if shared_prefix is not None:
        total = shared_prefix[0].shape[2] + key.shape[2]
        if query.device.type == "cpu" and dropout == 0 and (window is None or window >= total):
            prefix_kv = [t.repeat_interleave(repeats, 1) for t in shared_prefix]
            tail_kv = [t.repeat_interleave(repeats, 1) for t in (key, value)]
            out = PrefixThenTail.apply(query, *prefix_kv, *tail_kv, scaling)  # type: ignore[no-untyped-call]
            return out.transpose(1, 2).contiguous(), None
        prefix_key, prefix_value = (p.expand(key.shape[0], -1, -1, -1) for p in shared_prefix)
        key, value = torch.cat([prefix_key, key], dim=2), torch.cat([prefix_value, value], dim=2)
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    sdpa: dict[str, Any] = {"dropout_p": dropout, "scale": scaling}
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
