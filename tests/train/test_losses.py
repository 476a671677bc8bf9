"""train/losses.py on numbers small enough to check by hand."""

import math

import numpy as np
import pytest
import torch

from train import losses


def test_leave_one_out_advantages_with_one_std_per_group():
    reward = np.array([1.0, 0.0, 0.0, 0.5, 0.5, 2.0, 0.0, 1.0])
    group = np.array([0, 0, 0, 1, 1, 2, 3, 3])
    adv, usable = losses.group_advantages(reward, group, scale_by_std=True, sample_std=False, eps=0.0)
    std0 = math.sqrt(2 / 9)  # population std of [1, 0, 0]
    # group 0: baselines 0, 0.5, 0.5; group 1 equal rewards and group 2 a single session: skipped; group 3: +-1 / 0.5
    np.testing.assert_allclose(adv, [1 / std0, -0.5 / std0, -0.5 / std0, 0, 0, 0, -2, 2])
    assert usable.tolist() == [True, True, True, False, False, False, True, True]


def test_advantages_without_std_are_reward_minus_the_others_mean():
    adv, usable = losses.group_advantages(np.array([3.0, 1.0, 2.0]), np.array(["a", "a", "a"]), scale_by_std=False)
    np.testing.assert_allclose(adv, [3 - 1.5, 1 - 2.5, 2 - 2.0])
    assert usable.all()


def test_sample_or_population_std():
    reward, group = np.array([1.0, 0.0, 0.0, 0.0]), np.zeros(4, dtype=int)
    sample, _ = losses.group_advantages(reward, group, scale_by_std=True, eps=0.0)
    population, _ = losses.group_advantages(reward, group, scale_by_std=True, sample_std=False, eps=0.0)
    raw, _ = losses.group_advantages(reward, group, scale_by_std=False)
    np.testing.assert_allclose(sample, raw / math.sqrt(0.75 / 3))  # squared deviations 0.75 over n - 1
    np.testing.assert_allclose(population, raw / math.sqrt(0.75 / 4))
    np.testing.assert_allclose(population / sample, math.sqrt(4 / 3))  # 1.155 at n = 4
    assert abs(sample.sum()) < 1e-12


def test_one_success_among_failures_stays_bounded():
    # Polar's early per-trajectory std turned this into ~1e6; one std per group gives ~4.
    reward = np.array([1.0] + [0.0] * 15)
    adv, _ = losses.group_advantages(reward, np.zeros(16, dtype=int), scale_by_std=True)
    std = math.sqrt((15 / 16) / 15)  # sample std: squared deviations 15/16 over n - 1 = 15
    np.testing.assert_allclose(adv[0], 1 / (std + 1e-6))
    np.testing.assert_allclose(adv[1:], -(1 / 15) / (std + 1e-6))
    assert np.abs(adv).max() < 5


@pytest.mark.parametrize(
    ("prompt", "response", "max_len", "keep"),
    [(3, 5, 10, 5), (3, 10, 10, 7), (9, 5, 10, 1), (10, 5, 10, None), (12, 5, 10, None)],
)
def test_truncate_keeps_the_prompt_and_a_response_prefix(prompt, response, max_len, keep):
    assert losses.truncate(prompt, response, max_len) == keep


def test_a_sessions_traces_weigh_one_session():
    w = losses.session_weights(np.array([0, 0, 1, 2, 2, 2]))
    np.testing.assert_allclose(w, [1 / 2, 1 / 2, 1, 1 / 3, 1 / 3, 1 / 3])


def test_token_mean_weights():
    w = losses.token_mean_weights(np.array([0, 0, 1]), np.array([2, 4, 3]), norm_tokens=999)
    # session weights 1/2, 1/2, 1; weighted token count 1 + 2 + 3 = 6
    np.testing.assert_allclose(w, [1 / 12, 1 / 12, 1 / 6])
    assert (w * np.array([2, 4, 3])).sum() == pytest.approx(1.0)
    # one trace per session: the plain mean over tokens
    np.testing.assert_allclose(losses.token_mean_weights(np.array([0, 1]), np.array([1, 3]), 0), [1 / 4, 1 / 4])


def test_dr_grpo_weights_divide_by_sessions_times_a_constant():
    w = losses.dr_grpo_weights(np.array([0, 0, 1]), np.array([2, 4, 3]), norm_tokens=10)
    np.testing.assert_allclose(w, [0.5 / 20, 0.5 / 20, 1 / 20])
    assert set(losses.AGGREGATIONS) == {"session_mean", "token_mean", "dr_grpo"}


def test_session_mean_weights_are_each_sessions_token_mean_then_the_mean_over_sessions():
    # session 0: traces of 2 and 4 tokens (6 in all); session 1: one trace of 3 tokens
    w = losses.session_mean_weights(np.array([0, 0, 1]), np.array([2, 4, 3]), norm_tokens=999)
    np.testing.assert_allclose(w, [1 / (2 * 6), 1 / (2 * 6), 1 / (2 * 3)])
    per_token_loss = {0: [1.0, 1.0], 1: [4.0, 4.0, 4.0, 4.0], 2: [7.0, 7.0, 7.0]}  # trace -> its tokens' terms
    loss = sum(w[m] * sum(terms) for m, terms in per_token_loss.items())
    assert loss == pytest.approx(((2 * 1 + 4 * 4) / 6 + 7) / 2)  # (mean of session 0 + mean of session 1) / 2


def test_ppo_clip_is_asymmetric_and_stops_gradients_only_where_clipped():
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0, 1.2])
    adv = torch.tensor([2.0, -2.0, 2.0, -2.0, 3.0, 1.0])
    logp = torch.log(ratio).requires_grad_()
    loss, r = losses.ppo_clip_loss(logp, torch.zeros(6), adv, eps_low=0.2, eps_high=0.28)
    # 1.5 > 1.28 with A > 0: clipped to 1.28; 0.5 < 0.8 with A < 0: clipped to 0.8; the rest unclipped
    np.testing.assert_allclose(loss.detach(), [-2.56, 3.0, -1.0, 1.6, -3.0, -1.2], rtol=1e-6)
    np.testing.assert_allclose(r.detach(), ratio, rtol=1e-6)
    loss.sum().backward()
    grad = logp.grad
    assert grad[0] == 0 and grad[3] == 0  # clipped: no gradient
    np.testing.assert_allclose(grad[[1, 2, 4, 5]], (-ratio * adv)[[1, 2, 4, 5]], rtol=1e-6)  # d(-rho A)/dlogp


def test_truncated_importance_caps_and_treats_missing_log_probs_as_on_policy():
    old = torch.tensor([math.log(3.0), math.log(0.5), -1.0], requires_grad=True)
    behav = torch.tensor([0.0, 0.0, math.nan])
    w = losses.truncated_importance(old, behav, cap=2.0)
    np.testing.assert_allclose(w, [2.0, 0.5, 1.0], rtol=1e-6)
    assert not w.requires_grad
    assert losses.no_importance(old, behav).tolist() == [1.0, 1.0, 1.0]


def test_k3_kl_is_clamped_where_the_policy_left_the_reference_far_behind():
    logp, ref = torch.tensor([-20.0, -1.0]), torch.tensor([-1.0, -1.0])  # d = 19: e^19 - 20 would be 1.8e8
    np.testing.assert_allclose(losses.k3_kl(logp, ref), [10.0, 0.0])
    logp.requires_grad_(True)
    losses.k3_kl(logp, ref).sum().backward()
    assert logp.grad[0] == 0  # a clamped token pushes nothing


def test_k3_kl():
    logp, ref = torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.25, 0.3]))
    d = math.log(0.5)
    np.testing.assert_allclose(losses.k3_kl(logp, ref), [math.exp(d) - d - 1, 0.0], atol=1e-7)


def test_grpo_loss_combines_clip_importance_kl_and_weights():
    logp = torch.log(torch.tensor([1.5, 0.9, 1.0]))  # ratios against old = 0
    old = torch.zeros(3)
    behav = torch.tensor([math.log(1 / 3), math.nan, 0.0])  # IS weights min(3, 2) = 2; 1 (not captured); 1
    ref = torch.log(torch.tensor([1.5, 0.9, 0.5]))  # KL only on the third token: d = log 0.5
    adv = torch.tensor([1.0, -1.0, 2.0])
    weight = torch.tensor([0.5, 0.25, 0.25])
    loss, parts = losses.grpo_loss(
        logp,
        old,
        ref,
        behav,
        adv,
        weight,
        importance=lambda o, b: losses.truncated_importance(o, b, 2.0),
        eps_low=0.2,
        eps_high=0.28,
        kl_coef=0.1,
    )
    d = math.log(0.5)
    by_hand = 0.5 * 2 * -1.28 + 0.25 * 1 * 0.9 + 0.25 * (1 * -2.0 + 0.1 * (math.exp(d) - d - 1))
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    np.testing.assert_allclose(parts["is_weight"], [2.0, 1.0, 1.0], rtol=1e-6)
    loss_no_kl, parts = losses.grpo_loss(
        logp, old, None, behav, adv, weight, importance=losses.no_importance, eps_low=0.2, eps_high=0.28, kl_coef=0.1
    )
    assert loss_no_kl.item() == pytest.approx(0.5 * -1.28 + 0.25 * 0.9 + 0.25 * -2.0, rel=1e-6)
    assert parts["kl"].tolist() == [0.0, 0.0, 0.0]
