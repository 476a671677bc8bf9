"""eval/stats.py: the paired test over tasks checked by simulation (its false-positive rate under no effect, its power
against Fisher's when tasks differ in difficulty) and on hand-made cases (McNemar's exact p, the Monte Carlo path,
the join on task ids)."""

import math
from fractions import Fraction

import numpy as np
import pytest

from eval import stats

ALPHA = 0.05
PRIOR = (0.5, 2.3)  # tasks of very different difficulty, mean pass rate 0.18 (the demo's held-out SFT rate)


def binomial_band(n: int, p: float, level: float = 0.99) -> tuple[int, int]:
    """The central ``level`` band of Bin(n, p): counts outside it have probability below 1 - level together."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    cdf = np.cumsum(pmf)
    return int(np.searchsorted(cdf, (1 - level) / 2)), int(np.searchsorted(cdf, (1 + level) / 2))


def false_positives(samples: int, sims: int, seed: int) -> tuple[int, int]:
    """(paired, Fisher) rejections at ALPHA in ``sims`` experiments of 64 tasks where both stages have the same
    per-task rates: the tasks differ, the stages do not."""
    rng, paired, fisher = np.random.default_rng(seed), 0, 0
    for _ in range(sims):
        p = rng.beta(*PRIOR, size=64)
        before, after = rng.binomial(samples, p), rng.binomial(samples, p)
        paired += stats.sign_flip_p([int(x) for x in after - before])[0] < ALPHA
        n = 64 * samples
        fisher += stats.fisher_exact(int(after.sum()), n, int(before.sum()), n) < ALPHA
    return paired, fisher


def test_under_no_effect_the_paired_test_rejects_about_5_percent():
    sims = 400
    paired, _ = false_positives(samples=4, sims=sims, seed=1)
    lo, hi = binomial_band(sims, ALPHA)  # 99 %: [9, 32] of 400
    assert lo <= paired <= hi, f"{paired}/{sims} false positives, outside [{lo}, {hi}]"
    # At one sample a task it is McNemar's exact test: valid, conservative (few tasks differ, the p-values are coarse).
    paired, _ = false_positives(samples=1, sims=sims, seed=2)
    assert paired <= hi


def test_when_tasks_differ_in_difficulty_the_paired_test_has_more_power_than_fishers():
    result = stats.power(PRIOR, prior=True, tasks=64, samples=4, effect=0.09, sims=300, seed=3)
    assert result.paired > result.fisher + 0.05, result  # measured: 0.78 against 0.64
    assert result.paired > 0.6
    one = stats.power(PRIOR, prior=True, tasks=64, samples=1, effect=0.09, sims=300, seed=4)
    assert one.paired > one.fisher, one


def test_the_exact_sign_flip_p_is_mcnemars_exact_p_at_one_sample_a_task():
    # 10 tasks passed only after, 3 only before, 7 alike: McNemar's exact p = P(|2X - 13| >= 7), X ~ Bin(13, 1/2).
    diffs = [1] * 10 + [-1] * 3 + [0] * 7
    by_hand = 2 * sum(math.comb(13, k) for k in range(4)) / 2**13  # 2 * P(X <= 3) = 0.0923
    p, method = stats.sign_flip_p(diffs)
    assert method == "exact" and p == pytest.approx(by_hand, rel=1e-12) == stats.mcnemar_exact(10, 3)
    assert stats.sign_flip_p([0, 0])[0] == 1.0 and stats.mcnemar_exact(4, 4) == 1.0


def test_the_exact_sign_flip_p_enumerates_every_sign_vector():
    diffs = [Fraction(3, 4), Fraction(1, 2), Fraction(-1, 4), Fraction(1, 4), Fraction(1, 1), Fraction(2, 3)]
    seen = abs(sum(diffs))
    signs = np.array(np.meshgrid(*[[-1, 1]] * len(diffs))).reshape(len(diffs), -1).T
    brute = float(np.mean(np.abs(signs @ np.array([float(d) for d in diffs])) >= float(seen) - 1e-12))
    assert stats.sign_flip_p(diffs)[0] == pytest.approx(brute, rel=1e-12)
    # A support too large for the exact sum: Monte Carlo with a fixed seed, close to the exact p.
    p, method = stats.sign_flip_p(diffs, max_support=10, draws=100_000)
    assert method == "monte carlo" and p == pytest.approx(brute, abs=0.01)
    assert stats.sign_flip_p(diffs, max_support=10, draws=100_000) == (p, method)  # reproducible


def test_paired_joins_on_task_ids_and_keeps_fisher_beside_it():
    before = {"a": (0, 4), "b": (1, 4), "c": (4, 4), "only-before": (1, 1)}
    after = {"a": (2, 4), "b": (3, 4), "c": (4, 4), "only-after": (0, 2)}
    r = stats.paired(before, after)
    assert (r.tasks, r.differing, r.only_before, r.only_after) == (3, 2, ("only-before",), ("only-after",))
    assert r.delta == pytest.approx(1 / 3) and r.after - r.before == pytest.approx(r.delta)
    assert r.ci95[0] <= r.delta <= r.ci95[1] and r.method == "exact" and r.p_value == 0.5  # 2 tasks: 1/4 + 1/4
    assert (r.pooled_before, r.pooled_after) == ((5, 12), (9, 12))
    assert r.fisher_p == pytest.approx(stats.fisher_exact(9, 12, 5, 12))
    assert r.se == pytest.approx(np.std([0.5, 0.5, 0.0], ddof=1) / math.sqrt(3))
    assert r.as_dict()["only_after"] == ["only-after"] and stats.paired(before, after) == r  # seeded: reproducible


def test_fisher_in_log_space_matches_the_exact_hypergeometric_sum():
    def exact(a: int, n_a: int, b: int, n_b: int) -> float:
        s, n = a + b, n_a + n_b
        prob = [Fraction(math.comb(s, x) * math.comb(n - s, n_a - x), math.comb(n, n_a)) for x in range(s + 1)]
        return float(sum(p for p in prob if p <= prob[a]))

    for counts in ((12, 32, 0, 32), (47, 192, 34, 192), (3, 10, 7, 10), (0, 5, 0, 5)):
        assert stats.fisher_exact(*counts) == pytest.approx(exact(*counts), rel=1e-9)


def test_the_logit_shift_raises_the_mean_by_the_effect():
    rates = np.random.default_rng(0).beta(*PRIOR, size=10_000)
    shift = stats.logit_shift(rates, 0.09)
    shifted = 1 / (1 + np.exp(-(np.log(rates / (1 - rates)) + shift)))
    assert shift > 0 and shifted.mean() == pytest.approx(rates.mean() + 0.09, abs=1e-6)
    with pytest.raises(ValueError, match="is not a pass rate"):
        stats.logit_shift([0.95], 0.09)
