"""Tests of a pass rate between two stages (or two runs) measured on the same tasks: pure functions, no I/O.

    from eval import stats
    result = stats.paired({"t1": (1, 4), "t2": (0, 4)}, {"t1": (3, 4), "t2": (1, 4)})  # task -> (resolved, n)
    result.delta, result.ci95, result.p_value, result.fisher_p

The question "did the policy's success rate change on these tasks?" is paired: both stages ran the same tasks, and
a task that is easy for one tends to be easy for the other, so most of the variance between stages is between tasks.
:func:`paired` works on per-task pass rates (resolved / samples of each task, joined on the task id; a task in one
side only is left out and named):

- **delta**: the mean over tasks of (after - before), i.e. the change of the mean per-task pass rate (equal to the
  pooled pass rate's change when every task has the same number of samples).
- **ci95**: a 95 % interval of delta clustered by task: the percentile bootstrap over tasks (``BOOTSTRAP``
  resamples of the tasks with replacement, seed 0, so a report is reproducible). Resampling whole tasks keeps each
  task's samples together, which is what clustering by task means; it assumes no distribution of the differences.
  ``se`` beside it is the clustered standard error sd(d) / sqrt(tasks) (E. Miller, "Adding Error Bars to Evals",
  2024), for reading, not for the verdict.
- **p_value**: the exact sign-flip (permutation) test on the per-task differences d_i: under "no change" each
  task's two stages are exchangeable, so each d_i is as likely to be -d_i; p = P(|sum of +-d_i| >= |sum d_i|)
  over all 2^m sign vectors of the m tasks with d_i != 0. The distribution of that sum is computed exactly (the
  differences share a denominator; equal magnitudes form a binomial, the groups are convolved), which is the
  enumeration of all 2^m vectors without listing them. Where the common denominator makes that support too large
  (``MAX_SUPPORT``), ``MONTE_CARLO_DRAWS`` random sign vectors with seed 0 estimate it instead ((1 + hits) /
  (1 + draws)), and ``method`` says so. At one sample a task d_i is -1, 0 or +1 and the test is McNemar's exact
  test (:func:`mcnemar_exact`).
- **fisher_p**: Fisher's exact test on the pooled counts, which treats the two stages as independent samples; it
  stays beside the paired test for comparison.

:func:`power` simulates both tests for a given effect at a number of tasks x samples per task, from a prior of
per-task difficulty (a Beta) or from measured per-task pass rates (docs/demo.md, "Power").
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = [
    "BOOTSTRAP",
    "MAX_SUPPORT",
    "MONTE_CARLO_DRAWS",
    "Counts",
    "Paired",
    "Power",
    "bootstrap_ci",
    "clustered_se",
    "fisher_exact",
    "logit_shift",
    "mcnemar_exact",
    "newcombe",
    "paired",
    "power",
    "sign_flip_p",
    "wilson",
]

Counts = tuple[int, int]
"""One task's (resolved, graded samples)."""
BOOTSTRAP = 10_000  # resamples of the tasks for ci95
MONTE_CARLO_DRAWS = 200_000  # sign vectors when the exact support is too large; the p-value's sd is < 0.0011
MAX_SUPPORT = 2_000_000  # integer sums the exact sign-flip distribution may span


# ---- one proportion, two independent proportions


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval of a binomial proportion; (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def fisher_exact(a: int, n_a: int, b: int, n_b: int) -> float:
    """Two-sided p-value of Fisher's exact test that a / n_a and b / n_b come from the same success rate: the
    probability, with the margins fixed, of a table at most as likely as the one seen (hypergeometric)."""
    successes, n = a + b, n_a + n_b
    if n == 0:
        return 1.0
    log_total = _log_comb(n, n_a)

    def log_prob(x: int) -> float:  # log P(x of the successes fall in the first sample)
        return _log_comb(successes, x) + _log_comb(n - successes, n_a - x) - log_total

    seen = log_prob(a)
    support = range(max(0, successes - n_b), min(successes, n_a) + 1)
    p = sum(math.exp(lp) for lp in map(log_prob, support) if lp <= seen + 1e-9)
    return 1.0 if p > 1 - 1e-9 else p  # every table counted: 1, not its float sum


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def newcombe(a: int, n_a: int, b: int, n_b: int) -> tuple[float, float]:
    """95 % interval of the difference a / n_a - b / n_b: Newcombe's hybrid score interval, built from the two
    Wilson intervals, which keeps its coverage at the 0-of-n counts a demo's base stage has."""
    p_a, p_b = (a / n_a if n_a else 0.0), (b / n_b if n_b else 0.0)
    (lo_a, hi_a), (lo_b, hi_b) = wilson(a, n_a), wilson(b, n_b)
    delta = p_a - p_b
    return delta - math.hypot(p_a - lo_a, hi_b - p_b), delta + math.hypot(hi_a - p_a, p_b - lo_b)


# ---- paired: the same tasks under two stages


def mcnemar_exact(b: int, c: int) -> float:
    """McNemar's exact test (two-sided): b tasks passed only after, c only before; under no change b ~ Bin(b + c,
    1/2), and p = P(|2X - (b + c)| >= |b - c|), i.e. twice the smaller tail, at most 1."""
    m, seen = b + c, abs(b - c)
    tail: int = sum(math.comb(m, x) for x in range(m + 1) if abs(2 * x - m) >= seen)
    return min(1.0, tail / (1 << m))


def sign_flip_p(
    diffs: Sequence[Fraction | int], *, draws: int = MONTE_CARLO_DRAWS, seed: int = 0, max_support: int = MAX_SUPPORT
) -> tuple[float, str]:
    """Two-sided p-value of the sign-flip permutation test that the per-task differences ``diffs`` are symmetric
    about 0, and how it was computed: "exact" (the whole distribution of the signed sum) or "monte carlo" (``draws``
    random sign vectors from ``seed``, used only when the exact support would pass ``max_support`` sums)."""
    nonzero = [Fraction(d) for d in diffs if d != 0]
    if not nonzero:
        return 1.0, "exact"
    scale = math.lcm(*(d.denominator for d in nonzero))
    ints = [int(d * scale) for d in nonzero]
    if 2 * sum(map(abs, ints)) + 1 <= max_support:
        return _sign_flip_exact(ints), "exact"
    values = np.array([float(d) for d in nonzero])
    seen = abs(values.sum())
    rng, hits, left = np.random.default_rng(seed), 0, draws
    while left:
        chunk = min(left, max(1, 4_000_000 // len(values)))
        signs = rng.integers(0, 2, size=(chunk, len(values)), dtype=np.int8) * 2 - 1
        hits += int((np.abs(signs @ values) >= seen - 1e-12 * max(1.0, seen)).sum())
        left -= chunk
    return (1 + hits) / (1 + draws), "monte carlo"


def _sign_flip_exact(ints: list[int]) -> float:
    """P(|sum of +-k_i| >= |sum k_i|) for integers k_i != 0, each sign +-1 with probability 1/2: the m_j terms of
    magnitude j sum to j * (2X - m_j), X ~ Bin(m_j, 1/2); those groups are convolved."""
    seen = abs(sum(ints))
    dist, offset = np.ones(1), 0  # dist[i] = P(sum == i - offset)
    for j, m in sorted(Counter(abs(k) for k in ints).items()):
        group = np.zeros(2 * j * m + 1)
        group[:: 2 * j] = [math.comb(m, x) / (1 << m) for x in range(m + 1)]
        dist, offset = np.convolve(dist, group), offset + j * m
    values = np.abs(np.arange(len(dist)) - offset)
    return min(1.0, float(dist[values >= seen].sum()))


def clustered_se(diffs: Sequence[float]) -> float:
    """The standard error of the mean per-task difference, clustered by task: sd(d) / sqrt(n) (ddof 1)."""
    n = len(diffs)
    return float(np.std(np.asarray(diffs, dtype=float), ddof=1) / math.sqrt(n)) if n > 1 else 0.0


def bootstrap_ci(
    diffs: Sequence[float], *, resamples: int = BOOTSTRAP, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``diffs`` (one per task), resampling tasks with replacement."""
    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        return 0.0, 0.0
    means = d[np.random.default_rng(seed).integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@dataclasses.dataclass(frozen=True)
class Paired:
    """Two stages on the tasks they share (see the module docstring)."""

    tasks: int
    """Tasks in both, the unit of the test."""
    differing: int
    """Tasks whose pass rate differs between the two."""
    before: float
    """Mean per-task pass rate before."""
    after: float
    delta: float
    """after - before, the mean per-task difference."""
    ci95: tuple[float, float]
    """Percentile bootstrap over tasks (seed 0)."""
    se: float
    """Clustered standard error of delta."""
    p_value: float
    """Sign-flip permutation test over tasks (McNemar's exact test at one sample a task)."""
    method: str
    """How p_value was computed: exact or monte carlo."""
    fisher_p: float
    """Fisher's exact test on the pooled counts of the same tasks, as if the stages were independent samples."""
    pooled_before: Counts
    pooled_after: Counts
    only_before: tuple[str, ...]
    """Tasks measured before only: left out."""
    only_after: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("before", "after", "delta", "se"):
            out[key] = round(out[key], 4)
        out["ci95"] = [round(x, 4) for x in self.ci95]
        out["pooled_before"], out["pooled_after"] = list(self.pooled_before), list(self.pooled_after)
        out["only_before"], out["only_after"] = list(self.only_before), list(self.only_after)
        return out


def paired(before: Mapping[str, Counts], after: Mapping[str, Counts], *, seed: int = 0) -> Paired:
    """The paired comparison of two stages' per-task counts (task id -> (resolved, samples)), joined on task id;
    tasks without a graded sample on either side are left out."""
    shared = sorted(t for t in before.keys() & after.keys() if before[t][1] and after[t][1])
    diffs = [Fraction(after[t][0], after[t][1]) - Fraction(before[t][0], before[t][1]) for t in shared]
    p, method = sign_flip_p(diffs, seed=seed)
    floats = [float(d) for d in diffs]
    pooled_b = (sum(before[t][0] for t in shared), sum(before[t][1] for t in shared))
    pooled_a = (sum(after[t][0] for t in shared), sum(after[t][1] for t in shared))
    return Paired(
        tasks=len(shared),
        differing=sum(d != 0 for d in diffs),
        before=_mean([before[t][0] / before[t][1] for t in shared]),
        after=_mean([after[t][0] / after[t][1] for t in shared]),
        delta=_mean(floats),
        ci95=bootstrap_ci(floats, seed=seed),
        se=clustered_se(floats),
        p_value=p,
        method=method,
        fisher_p=fisher_exact(pooled_a[0], pooled_a[1], pooled_b[0], pooled_b[1]),
        pooled_before=pooled_b,
        pooled_after=pooled_a,
        only_before=tuple(sorted(set(before) - set(shared))),
        only_after=tuple(sorted(set(after) - set(shared))),
    )


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# ---- power


def _expit(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    out: np.ndarray[Any, Any] = 1 / (1 + np.exp(-x))
    return out


def _logit(p: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    p = np.clip(p, 1e-9, 1 - 1e-9)
    out: np.ndarray[Any, Any] = np.log(p / (1 - p))
    return out


def logit_shift(rates: Sequence[float] | np.ndarray[Any, Any], effect: float) -> float:
    """The shift delta of every task's log-odds that raises the mean of ``rates`` by ``effect``: mean(expit(logit(p)
    + delta)) = mean(p) + effect (bisection). A task-consistent effect: hard tasks gain less than middling ones."""
    p = np.asarray(rates, dtype=float)
    target = float(p.mean()) + effect
    if not 0 < target < 1:
        raise ValueError(f"mean {p.mean():.3f} + effect {effect} is not a pass rate")
    lo, hi, x = -30.0, 30.0, _logit(p)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(_expit(x + mid).mean()) < target else (lo, mid)
    return (lo + hi) / 2


@dataclasses.dataclass(frozen=True)
class Power:
    """Share of simulated experiments in which each test found the effect at p < alpha."""

    tasks: int
    samples: int
    effect: float
    paired: float
    fisher: float
    sims: int


def power(
    rates: Sequence[float] | tuple[float, float],
    *,
    tasks: int,
    samples: int,
    effect: float = 0.09,
    sims: int = 500,
    alpha: float = 0.05,
    seed: int = 0,
    prior: bool = False,
) -> Power:
    """Simulated power of the paired test (and of Fisher's) to find a gain of ``effect`` in the mean pass rate with
    ``tasks`` tasks x ``samples`` samples per task per stage.

    Each experiment draws ``tasks`` task difficulties p_i: from Beta(a, b) when ``prior`` (``rates`` = (a, b)), else
    by resampling ``rates`` (measured per-task pass rates; shrink 0s and 1s first, e.g. (c + 0.5) / (n + 1), or they
    never move). After the change each task's rate is expit(logit(p_i) + delta), delta from :func:`logit_shift` on
    the prior's (or the rates') mean. Each stage then samples Bin(samples, rate) per task, independently given the
    task: the tasks are what the two stages share."""
    rng = np.random.default_rng(seed)
    if prior:
        a, b = rates
        population = rng.beta(a, b, size=200_000)
    else:
        population = np.asarray(rates, dtype=float)
    shift = logit_shift(population, effect)
    found_paired = found_fisher = 0
    for _ in range(sims):
        p = rng.beta(a, b, size=tasks) if prior else rng.choice(population, size=tasks)
        q = _expit(_logit(p) + shift)
        before, after = rng.binomial(samples, p), rng.binomial(samples, q)
        gained, n = int(after.sum()) > int(before.sum()), tasks * samples  # a gain found, not any change
        found_paired += gained and sign_flip_p([int(x) for x in after - before])[0] < alpha
        found_fisher += gained and fisher_exact(int(after.sum()), n, int(before.sum()), n) < alpha
    return Power(tasks, samples, effect, found_paired / sims, found_fisher / sims, sims)
