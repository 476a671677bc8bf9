"""train/attention.py on tails after a shared prefix: both of its paths against one plain masked SDPA over every key,
values and gradients."""

import types

import pytest
import torch
import torch.nn.functional as F

from train.attention import span_attention


def tails(rows: int = 3, heads: int = 4, kv_heads: int = 2, length: int = 7, shared: int = 11, dim: int = 8):
    """Queries of ``rows`` tails, their own keys/values, and the prefix's (one for every row) as the Branch cache
    hands them over."""
    torch.manual_seed(0)
    query = torch.randn(rows, heads, length, dim, requires_grad=True)
    prefix = [torch.randn(1, kv_heads, shared, dim, requires_grad=True) for _ in range(2)]
    own = [torch.randn(rows, kv_heads, length, dim, requires_grad=True) for _ in range(2)]
    return query, prefix, own, [query, *prefix, *own]


@pytest.mark.parametrize("window", [None, 9], ids=["prefix-then-tail", "sliding-window-mask"])
def test_tails_attend_to_the_whole_prefix_and_causally_to_themselves(window):
    query, prefix, own, leaves = tails()
    module = types.SimpleNamespace(sliding_window=window)
    out, _ = span_attention(module, query, *own, None, scaling=0.3, shared_prefix=tuple(prefix))  # (k, L, H, D)
    key, value = (torch.cat([p.expand(len(query), -1, -1, -1), o], dim=2) for p, o in zip(prefix, own, strict=True))
    # the reference: query i of a tail is token P + i; it sees keys j <= P + i (within the window)
    length, total = query.shape[2], key.shape[2]
    i = torch.arange(length)[:, None] + (total - length)
    j = torch.arange(total)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    reps = query.shape[1] // key.shape[1]
    expected = F.scaled_dot_product_attention(
        query, key.repeat_interleave(reps, 1), value.repeat_interleave(reps, 1), attn_mask=allowed, scale=0.3
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), leaves)
    want = torch.autograd.grad((expected * weights).sum(), leaves)
    for name, g, w in zip(["query", "prefix key", "prefix value", "tail key", "tail value"], got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
