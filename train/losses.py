"""The GRPO maths of train/grpo.py as pure functions: advantages, weights, truncation, the clipped objective.

No model and no I/O: arrays and tensors in, arrays and tensors out, so tests/train/test_losses.py checks every
formula on numbers small enough to work out by hand. Shapes: S sessions, M traces, N trained tokens (flat).

Advantages and weights are NumPy float64 (computed once per run, before any forward pass); the token-level
terms are torch tensors on the model's device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "dr_grpo_weights",
    "group_advantages",
    "grpo_loss",
    "grpo_token_loss",
    "k3_kl",
    "no_importance",
    "ppo_clip_loss",
    "session_mean_weights",
    "session_weights",
    "token_mean_weights",
    "truncate",
    "truncated_importance",
]


# ---- advantages (per session, NumPy)


def group_advantages(
    reward: np.ndarray, group: np.ndarray, *, scale_by_std: bool, sample_std: bool = True, eps: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """Leave-one-out GRPO advantages: ``(adv, usable)``, both (S,).

    ``reward`` (S,) is each session's reward and ``group`` (S,) its group label (the task). For session i in a
    group of n: ``adv_i = r_i - mean_{j != i} r_j``, divided by ``std_g + eps`` when ``scale_by_std``. std_g is
    one std shared by the group (never a per-session one, which exploded to ~1e6 for one success among failures
    in Polar's early code): the sample std (ddof 1, Polar's and torch's) or, with ``sample_std=False``, the
    population std (ddof 0; smaller by sqrt((n-1)/n)). A group's advantages sum to 0. A group whose rewards are
    all equal (including a group of one) teaches nothing: ``usable`` is False and ``adv`` is 0 for its sessions.
    """
    reward = np.asarray(reward, dtype=np.float64)  # (S,)
    group = np.asarray(group)  # (S,)
    adv = np.zeros_like(reward)  # (S,)
    usable = np.zeros(reward.shape, dtype=bool)  # (S,)
    for g in np.unique(group):
        idx = np.flatnonzero(group == g)  # (n,)
        r = reward[idx]  # (n,)
        if len(r) < 2 or np.all(r == r[0]):
            continue
        baseline = (r.sum() - r) / (len(r) - 1)  # (n,) mean of the *other* sessions
        a = r - baseline
        if scale_by_std:
            a = a / (r.std(ddof=1 if sample_std else 0) + eps)
        adv[idx] = a
        usable[idx] = True
    return adv, usable


# ---- lengths


def truncate(prompt_len: int, response_len: int, max_len: int) -> int | None:
    """How many response tokens to keep so that prompt + response fits ``max_len``: a causal prefix.

    The prompt is never trimmed (trimming the left would change every later token's context and invalidate the
    captured log-probs); the response loses its end. None when the prompt alone leaves no room for one response
    token: the trace is skipped.
    """
    keep = min(response_len, max_len - prompt_len)
    return keep if keep >= 1 else None


# ---- weights: how each trained token counts in the loss (one variant per aggregation)


def session_weights(trace_session: np.ndarray) -> np.ndarray:
    """(M,) weight ``1/k_s`` of each trace whose session s has k_s traces: a session's traces together weigh one."""
    _, inverse, counts = np.unique(trace_session, return_inverse=True, return_counts=True)
    return 1.0 / counts[inverse]


def token_mean_weights(trace_session: np.ndarray, n_tokens: np.ndarray, norm_tokens: int) -> np.ndarray:
    """Token mean (DAPO): (M,) per-token weight ``w_m / sum_m' w_m' n_m'`` with w the session weights.

    Every trained token counts alike except that a session's traces share one session's weight; with one trace
    per session this is exactly the mean over all trained tokens of the step. ``norm_tokens`` is unused.
    """
    w = session_weights(trace_session)  # (M,)
    return w / float((w * n_tokens).sum())


def dr_grpo_weights(trace_session: np.ndarray, n_tokens: np.ndarray, norm_tokens: int) -> np.ndarray:
    """Dr. GRPO (sequence mean of token sums over a constant): (M,) per-token weight ``w_m / (S * norm_tokens)``.

    S is the number of sessions in the step; no per-sequence length normalisation, so long and short answers
    are not weighted differently per token.
    """
    w = session_weights(trace_session)  # (M,)
    return w / (len(np.unique(trace_session)) * norm_tokens)


def session_mean_weights(trace_session: np.ndarray, n_tokens: np.ndarray, norm_tokens: int) -> np.ndarray:
    """Polar's averaging (slime's per-sample mean; TRL's ``grpo``): each session's token mean, then the mean over
    the step's S sessions. (M,) per-token weight ``1 / (S * N_s)``, N_s the trained tokens of all of session s's
    traces, so a session counts once whatever its length. ``norm_tokens`` is unused.
    """
    _, inverse = np.unique(trace_session, return_inverse=True)
    session_tokens = np.bincount(inverse, weights=n_tokens)  # (S,) N_s
    return 1.0 / (len(session_tokens) * session_tokens[inverse])


Aggregation = Callable[[np.ndarray, np.ndarray, int], np.ndarray]  # (trace_session, n_tokens, norm_tokens) -> (M,)
AGGREGATIONS: dict[str, Aggregation] = {
    "session_mean": session_mean_weights,
    "token_mean": token_mean_weights,
    "dr_grpo": dr_grpo_weights,
}


# ---- token-level terms (torch; all (N,))


def ppo_clip_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate with asymmetric clip: ``(loss, ratio)``, both (N,).

    ``ratio = exp(logp - old_logp)``; ``loss = -min(ratio * adv, clip(ratio, 1 - eps_low, 1 + eps_high) * adv)``.
    """
    ratio = torch.exp(logp - old_logp)  # (N,)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # (N,)
    return -torch.minimum(ratio * adv, clipped * adv), ratio


def truncated_importance(old_logp: torch.Tensor, behav_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling weight (N,): ``min(exp(old_logp - behav_logp), cap)``, no gradient.

    Corrects for the inference engine sampling from a slightly different distribution than the trainer computes.
    ``behav_logp`` is NaN where the trace has no captured log-probs: there the behaviour policy *is* the trainer
    before the update, and the weight is 1.
    """
    w = torch.exp(old_logp - behav_logp).clamp(max=cap)  # (N,)
    return torch.where(torch.isnan(behav_logp), torch.ones_like(w), w).detach()


def no_importance(old_logp: torch.Tensor, behav_logp: torch.Tensor) -> torch.Tensor:
    """Importance sampling off: weight 1 on every token (N,)."""
    return torch.ones_like(old_logp)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, cap: float = 10.0) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token (N,): ``exp(d) - d - 1`` with ``d = ref - logp``,
    clamped at ``cap`` (slime's 10).

    Non-negative and unbiased on tokens sampled from the policy (http://joschu.net/blog/kl-approx.html). The clamp
    matters where the policy has made a token far less likely than the reference did: exp(d) grows without bound
    there, and one such token would dominate the step's gradient.
    """
    d = ref_logp - logp  # (N,)
    return (torch.exp(d) - d - 1.0).clamp(max=cap)


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    weight: torch.Tensor,
    *,
    importance: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    eps_low: float,
    eps_high: float,
    kl_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each token's weighted term of the step's loss, ``weight_t * (is_t * ppo_t + kl_coef * k3_t)`` (N,), and parts.

    All inputs are (N,); ``ref_logp`` None means no KL term. ``weight`` comes from an AGGREGATIONS variant
    computed over the whole step, so the sum of these terms over every micro-batch and rank is the step's loss.
    """
    pg, ratio = ppo_clip_loss(logp, old_logp, adv, eps_low, eps_high)  # (N,), (N,)
    is_weight = importance(old_logp, behav_logp)  # (N,)
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)  # (N,)
    return weight * (is_weight * pg + kl_coef * kl), {"pg": pg, "ratio": ratio, "is_weight": is_weight, "kl": kl}


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    weight: torch.Tensor,
    **options: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """These tokens' share of the step's loss, the sum of ``grpo_token_loss``; same arguments."""
    per_token, parts = grpo_token_loss(logp, old_logp, ref_logp, behav_logp, adv, weight, **options)  # type: ignore
    return per_token.sum(), parts
