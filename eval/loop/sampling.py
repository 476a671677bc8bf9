"""Dynamic sampling for the demo's GRPO rounds (DAPO, Yu et al. 2025, §3.2): keep only the groups that carry a
gradient. A group (one task's samples) whose rewards are all equal has zero advantage under GRPO and trains nothing,
so before a round trains, the policy that the round starts from keeps drawing tasks from the training pool until
the round has ``groups`` groups with mixed rewards, or ``max_draws`` tasks were drawn.

The selection is pure (no rollouts here): :func:`dynamic_sample` gets the first batch's rewards (the previous
stage's own rollouts of its trained tasks, already made by the same policy) and a ``roll`` callable that rolls out
a batch of task ids and returns each task's rewards; eval/loop/run.py passes one that runs a stage's rollout,
grading and reconstruction into RUN/<round>-draw<b>/. The record (:meth:`Sampled.record`) goes to
RUN/<round>-sampling.json and from there into summary.json and report.html.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Batch", "Sampled", "batch_size", "dynamic_sample", "informative"]

Rewards = Mapping[str, Sequence[float]]
"""Task id -> the rewards of its samples (one group)."""


def informative(rewards: Sequence[float]) -> bool:
    """A group carries a GRPO signal: at least two samples and rewards that differ."""
    return len(rewards) >= 2 and max(rewards) != min(rewards)


def batch_size(needed: int, drawn: int, found: int, left: int) -> int:
    """Tasks to draw next: enough to find ``needed`` more informative groups at the share found so far (``found``
    of ``drawn``, smoothed as (found + 1) / (drawn + 2) so that a first batch with none still draws), never more
    than ``left`` (what the pool and the draw limit allow), never fewer than ``needed``."""
    if needed <= 0 or left <= 0:
        return 0
    share = (found + 1) / (drawn + 2)
    return min(left, max(needed, math.ceil(needed / share)))


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of draws: its run folder, the tasks drawn (in draw order), their rewards."""

    folder: str
    tasks: tuple[str, ...]
    rewards: tuple[tuple[float, ...], ...]

    @property
    def informative(self) -> tuple[str, ...]:
        return tuple(t for t, r in zip(self.tasks, self.rewards, strict=True) if informative(r))


@dataclasses.dataclass(frozen=True)
class Sampled:
    """What a round drew and kept."""

    groups: int
    """Informative groups asked for."""
    max_draws: int
    """Tasks that could be drawn at most."""
    pool: int
    """Tasks in the pool."""
    batches: tuple[Batch, ...]

    @property
    def draws(self) -> int:
        """Tasks drawn, the first batch included."""
        return sum(len(b.tasks) for b in self.batches)

    @property
    def sessions(self) -> int:
        return sum(len(r) for b in self.batches for r in b.rewards)

    @property
    def informative(self) -> tuple[str, ...]:
        """Every informative group drawn, in draw order."""
        return tuple(t for b in self.batches for t in b.informative)

    @property
    def kept(self) -> tuple[str, ...]:
        """The groups the round trains on: the first ``groups`` informative ones."""
        return self.informative[: self.groups]

    @property
    def pool_pass_rate(self) -> float | None:
        """Mean reward of every session drawn (the pass rate at 0/1 rewards): how hard the pool is for the policy."""
        rewards = [x for b in self.batches for r in b.rewards for x in r]
        return sum(rewards) / len(rewards) if rewards else None

    def record(self) -> dict[str, Any]:
        rate = self.pool_pass_rate
        return {
            "groups_asked": self.groups,
            "max_draws": self.max_draws,
            "pool": self.pool,
            "draws": self.draws,
            "sessions": self.sessions,
            "informative": len(self.informative),
            "kept": list(self.kept),
            "reached": len(self.kept) >= self.groups,
            "pool_pass_rate": None if rate is None else round(rate, 4),
            "batches": [
                {"folder": b.folder, "tasks": list(b.tasks), "informative": len(b.informative)} for b in self.batches
            ],
        }


def dynamic_sample(
    first: tuple[str, Rewards],
    pool: Sequence[str],
    *,
    groups: int,
    max_draws: int,
    seed: int,
    name: str,
    roll: Callable[[str, tuple[str, ...]], Rewards],
) -> Sampled:
    """Draw until ``groups`` informative groups or ``max_draws`` tasks: ``first`` is (folder, rewards) of the
    batch already rolled out; further tasks come from ``pool`` (those not drawn yet, in an order shuffled by
    ``seed``), ``batch_size`` of them at a time, each batch rolled out by ``roll(folder, tasks)`` into folder
    ``<name>-draw<b>`` (b = 2, 3, ...)."""
    if groups < 1 or max_draws < 1:
        raise ValueError(f"groups ({groups}) and max_draws ({max_draws}) must be >= 1")
    folder, rewards = first
    batches = [Batch(folder, tuple(rewards), tuple(tuple(r) for r in rewards.values()))]
    order = [t for t in dict.fromkeys(pool) if t not in rewards]
    random.Random(seed).shuffle(order)
    while True:
        drawn, found = sum(len(b.tasks) for b in batches), sum(len(b.informative) for b in batches)
        size = batch_size(groups - found, drawn, found, min(len(order), max_draws - drawn))
        if size == 0:
            break
        tasks, order = tuple(order[:size]), order[size:]
        folder = f"{name}-draw{len(batches) + 1}"
        got = roll(folder, tasks)
        batches.append(Batch(folder, tasks, tuple(tuple(got.get(t, ())) for t in tasks)))
    return Sampled(groups, max_draws, len(dict.fromkeys(pool)), tuple(batches))
