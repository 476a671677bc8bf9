"""Per-token log-probs from hidden states without ever holding the (T, V) logits of a whole trace.

A 32k-token trace with a 150k vocabulary has 4.9e9 logits: 19.7 GB in fp32, before autograd keeps a second
copy for the backward. Both paths here project the hidden states through the output layer ``chunk`` rows at a
time, so memory grows with tokens (N x H hidden states), not with tokens x vocabulary:

- ``fused_token_loss`` (training, frozen output layer: the LoRA case). The loss is a sum of per-token terms, so
  each chunk's gradient with respect to its hidden states is computed right away in the forward, from logits
  turned into their own gradient in place and then dropped; the backward only scales the stored (N, H) gradient.
  Same two matmuls as the naive way, one (chunk, V) block at a time.
- ``token_logprobs`` (no-grad passes, and a trainable output layer). Under autograd each chunk is wrapped in
  activation checkpointing: the backward rebuilds one (chunk, V) block at a time, at the price of one more matmul.

``full_logits_logprobs`` is the naive version, kept as the reference for tests and the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["full_logits_logprobs", "fused_token_loss", "token_logprobs"]

Head = Callable[[torch.Tensor], torch.Tensor]  # (n, H) hidden states -> (n, V) logits
TokenLoss = Callable[[torch.Tensor, slice], torch.Tensor]  # (log-probs (c,), their slice of the N tokens) -> (c,)


def _chunk_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: Head, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()  # (c, V)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # (c,)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse  # (c,)
    if not with_entropy:
        return logp, logp.new_zeros(0)
    with torch.no_grad():  # a metric: entropy = lse - sum_v p_v * logit_v
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # (c,)
    return logp, entropy


def token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Head,
    *,
    chunk: int = 512,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)``: log-prob of ``targets`` (N,) under ``head(hidden)`` (N, H), ``chunk`` rows at a time.

    ``entropy`` (N,) of each position's distribution (no gradient) when ``with_entropy``, else empty. Logits are
    divided by ``temperature`` (the sampling temperature, so that the log-probs are those of the distribution the
    tokens were drawn from) and computed in fp32 whatever the model's dtype.
    """
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk]  # (c, H)
        t = targets[start : start + chunk]  # (c,)
        if torch.is_grad_enabled() and h.requires_grad:
            # Keep only h for the backward; the (c, V) logits are rebuilt there, one chunk at a time.
            lp, ent = checkpoint(_chunk_logprobs, h, t, head, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, t, head, temperature, with_entropy)
        logps.append(lp)
        entropies.append(ent)
    if not logps:  # (0,), still attached to the graph: a padding pass must reach every parameter for DDP
        return hidden.sum(-1).float(), hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(logps), torch.cat(entropies)  # (N,), (N,) or (0,)


_ROWS = 64  # rows of a (c, V) block whose temporaries (the log-sum-exp's, the entropy's) exist at once


def _softmax_in_place(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits z (c, V) -> their softmax, in place, ``_ROWS`` rows at a time; returns the targets' log-probs (c,) and
    the entropies (c,), or (0,) without ``with_entropy``. The row views die here, so no caller keeps z by them."""
    logp = torch.empty(len(targets), dtype=z.dtype, device=z.device)
    entropy = torch.empty_like(logp) if with_entropy else logp.new_zeros(0)
    for a in range(0, len(targets), _ROWS):
        rows = z[a : a + _ROWS]  # (r, V) view
        lse = torch.logsumexp(rows, dim=-1)  # (r,)
        logp[a : a + len(rows)] = rows.gather(-1, targets[a : a + len(rows), None]).squeeze(-1) - lse
        log_p = rows.sub_(lse[:, None])
        p = log_p.exp()
        if with_entropy:
            entropy[a : a + len(rows)] = -torch.einsum("rv,rv->r", p, log_p)  # -sum_v p_v log p_v
        rows.copy_(p)
    return logp, entropy


class _FusedTokenLoss(torch.autograd.Function):
    """``sum_t token_loss(logp)_t`` whose gradient with respect to ``hidden`` is built chunk by chunk in the forward.

    Per chunk: logits z (c, V); lse; logp = z[t] - lse; g = d loss / d logp (autograd on (c,) values); the
    softmax p, which gives both the entropy and d loss / d z = g * (onehot(t) - p); autograd takes that back
    through the output layer to the chunk's hidden states. z becomes p, then d loss / d z, in place (the output
    layer's backward needs its input, not its output): one (c, V) block a chunk, where there were three (the
    logits, z - lse and p). Then the block is dropped.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        head: Head,
        token_loss: TokenLoss,
        chunk: int,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grad_hidden = torch.zeros_like(hidden)  # (N, H)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        logps, entropies = [], []
        for start in range(0, hidden.shape[0], chunk):
            sl, t = slice(start, start + chunk), targets[start : start + chunk]  # t: (c,)
            with torch.enable_grad():
                h = hidden[sl].detach().requires_grad_()  # (c, H)
                logits = head(h).float()  # (c, V)
                if temperature != 1.0:
                    logits = logits / temperature
            z = logits.detach()  # the same storage: overwritten below
            lp, entropy = _softmax_in_place(z, t, with_entropy)  # z: the logits -> their softmax
            lp.requires_grad_()
            with torch.enable_grad():
                loss = token_loss(lp, sl).sum()
                (g,) = torch.autograd.grad(loss, lp, allow_unused=True)  # (c,) d loss / d logp
            g = torch.zeros_like(lp) if g is None else g
            grad_z = z.mul_(-g[:, None]).scatter_add_(-1, t[:, None], g[:, None])  # (c, V) g * (onehot - p)
            (grad_hidden[sl],) = torch.autograd.grad(logits, h, grad_z)
            total += loss.detach()
            logps.append(lp.detach())
            entropies.append(entropy)
            del logits, z, grad_z, h  # else this chunk's (c, V) block lives on while the next one's is built
        ctx.save_for_backward(grad_hidden)
        logp = torch.cat(logps)  # (N,)
        entropy = torch.cat(entropies)  # (N,) or (0,)
        ctx.mark_non_differentiable(logp, entropy)
        return total, logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_total: torch.Tensor, _grad_logp: torch.Tensor, _grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total, None, None, None, None, None, None


def fused_token_loss(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Head,
    token_loss: TokenLoss,
    *,
    chunk: int = 512,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, logp, entropy)``: ``loss = sum_t token_loss(logp, slice)_t``, differentiable in ``hidden`` only.

    ``token_loss`` maps a chunk's log-probs (c,) and its slice of the N tokens to per-token loss terms (c,): the
    loss must be a sum over tokens (the GRPO loss is). ``head`` must have no trainable parameters (their
    gradients are not produced); ``logp`` and ``entropy`` (N,) come without gradient.
    """
    if hidden.shape[0] == 0:  # a padding pass: zero, still attached to the graph so DDP sees every parameter
        z = hidden.sum(-1).float()
        return z.sum(), z.detach(), z.detach()
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _FusedTokenLoss.apply(  # type: ignore[no-untyped-call]
        hidden, targets, head, token_loss, chunk, temperature, with_entropy
    )
    return out


def full_logits_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: Head, *, temperature: float = 1.0
) -> torch.Tensor:
    """The naive reference: all (N, V) logits at once, then log-softmax and gather; (N,)."""
    logits = head(hidden).float() / temperature  # (N, V)
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)  # (N,)
