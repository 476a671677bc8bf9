"""Dynamic sampling's selection (eval/loop/sampling.py) with a fake rollout: which groups a GRPO round keeps, how many
tasks it draws, and what it records; and the demo's --groups, --max-draws and --pool settings."""

import pytest

from eval.loop import sampling
from eval.loop.config import Config
from eval.tasks import family as taskgen

MIXED, SOLVED, FAILED = (1.0, 0.0, 1.0, 0.0), (1.0,) * 4, (0.0,) * 4


def fake_roll(outcomes: dict[str, tuple[float, ...]], calls: list[tuple[str, tuple[str, ...]]]):
    def roll(folder: str, tasks: tuple[str, ...]) -> dict[str, list[float]]:
        calls.append((folder, tasks))
        return {t: list(outcomes[t]) for t in tasks}

    return roll


def test_informative_groups_have_rewards_that_differ():
    assert sampling.informative(MIXED) and sampling.informative((0.0, 0.5))
    assert not any(map(sampling.informative, (SOLVED, FAILED, (1.0,), ())))


def test_batch_size_follows_the_share_found_and_the_limits():
    assert sampling.batch_size(needed=4, drawn=0, found=0, left=100) == 8  # nothing known yet: share 1/2
    assert sampling.batch_size(needed=4, drawn=16, found=4, left=100) == 15  # share 5/18 -> ceil(4 * 18 / 5)
    assert sampling.batch_size(needed=4, drawn=16, found=0, left=100) == 72  # share 1/18
    assert sampling.batch_size(needed=4, drawn=16, found=0, left=10) == 10  # the pool or the limit first
    assert sampling.batch_size(needed=0, drawn=16, found=16, left=10) == 0
    assert sampling.batch_size(needed=3, drawn=4, found=4, left=10) == 4  # share 5/6: ceil(3.6)


def test_it_draws_until_the_round_has_its_groups_and_keeps_only_those():
    pool = [f"t{i}" for i in range(40)]
    outcomes = {t: (MIXED if i % 4 == 0 else FAILED if i % 2 else SOLVED) for i, t in enumerate(pool)}
    first = {t: list(outcomes[t]) for t in pool[:8]}  # the previous stage's --tasks: t0 and t4 informative
    calls: list[tuple[str, tuple[str, ...]]] = []
    got = sampling.dynamic_sample(
        ("sft", first), pool, groups=6, max_draws=40, seed=0, name="grpo1", roll=fake_roll(outcomes, calls)
    )
    assert got.kept[:2] == ("t0", "t4") and len(got.kept) == 6 and all(outcomes[t] == MIXED for t in got.kept)
    assert [f for f, _ in calls] == [f"grpo1-draw{b}" for b in range(2, 2 + len(calls))]
    drawn = [t for _, tasks in calls for t in tasks]
    assert len(drawn) == len(set(drawn)) and not set(drawn) & set(first)  # no task twice, the first batch not again
    record = got.record()
    assert record["reached"] and record["draws"] == 8 + len(drawn) and record["sessions"] == 4 * record["draws"]
    assert record["informative"] >= 6 and record["kept"] == list(got.kept)
    assert record["pool"] == 40 and record["batches"][0] == {"folder": "sft", "tasks": pool[:8], "informative": 2}
    rewards = [x for t in (*first, *drawn) for x in outcomes[t]]
    assert record["pool_pass_rate"] == round(sum(rewards) / len(rewards), 4)
    # The same seed draws the same tasks.
    again: list[tuple[str, tuple[str, ...]]] = []
    sampling.dynamic_sample(
        ("sft", first), pool, groups=6, max_draws=40, seed=0, name="grpo1", roll=fake_roll(outcomes, again)
    )
    assert again == calls


def test_the_draw_limit_stops_a_round_short_of_its_groups():
    pool = [f"t{i}" for i in range(30)]
    outcomes = {t: (MIXED if t == "t3" else FAILED) for t in pool}
    calls: list[tuple[str, tuple[str, ...]]] = []
    got = sampling.dynamic_sample(
        ("sft", {t: list(outcomes[t]) for t in pool[:4]}),
        pool,
        groups=4,
        max_draws=12,
        seed=1,
        name="grpo2",
        roll=fake_roll(outcomes, calls),
    )
    record = got.record()
    assert record["draws"] == 12 and not record["reached"] and record["kept"] == ["t3"]
    assert record["pool_pass_rate"] == round(2 / 48, 4)
    # A first batch that already has the groups draws nothing more.
    none: list[tuple[str, tuple[str, ...]]] = []
    full = sampling.dynamic_sample(
        ("sft", {"t3": [1.0, 0.0]}), pool, groups=1, max_draws=12, seed=1, name="grpo1", roll=fake_roll(outcomes, none)
    )
    assert not none and full.kept == ("t3",) and full.record()["reached"]


def test_the_demo_draws_from_the_training_tasks_sft_did_not_see():
    assert Config(groups=None).pool == ()  # off: no pool
    args = Config()  # on by default: --groups 8
    train = {t["instance_id"] for t in taskgen.generate(0)["train"]}
    assert set(args.pool) == train - set(args.teach) and set(args.tasks) <= set(args.pool)
    with pytest.raises(ValueError, match="max_draws: must be >= 1"):
        Config(groups=16, max_draws=0)
    heldout = taskgen.generate(0)["heldout"][0]["instance_id"]
    with pytest.raises(ValueError, match=r"a held-out task cannot be trained on \(tasks, pool\)"):
        Config(groups=4, pool=(heldout,))
