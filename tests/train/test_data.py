"""train/data.py: reading and checking trajectory files, truncation, planning, packing, collation."""

import dataclasses

import numpy as np
import polars as pl
import pytest

from reconstruct import schema
from tests.train.helpers import groups, trace, write
from train import data, losses


def test_load_reads_sessions_rewards_and_traces(tmp_path):
    rows = groups({"a": [1.0, 0.0], "b": [0.5, 0.5]}, traces=2)
    rollout = data.load([write(tmp_path / "t.parquet", rows)])
    assert rollout.session_ids == ["a-0", "a-1", "b-0", "b-1"]
    assert rollout.task_ids == ["a", "a", "b", "b"]
    assert rollout.reward.tolist() == [1.0, 0.0, 0.5, 0.5]
    assert rollout.trace_session.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    for m, row in enumerate(rows):
        assert rollout.prompt[m].tolist() == row["prompt_ids"]
        assert rollout.response[m].tolist() == row["response_ids"]
        assert rollout.loss_mask[m].tolist() == [bool(x) for x in row["loss_mask"]]
        if row["logprobs"] is None:
            assert rollout.logprobs[m] is None
        else:
            np.testing.assert_allclose(rollout.logprobs[m], row["logprobs"], rtol=1e-6)


def test_load_drops_sessions_without_reward_or_task_and_counts_them(tmp_path):
    rows = [trace(session="a"), trace(session="b", reward=None), trace(session="c", task=None)]
    rollout = data.load([write(tmp_path / "t.parquet", rows)])
    assert rollout.session_ids == ["a"]
    assert rollout.dropped_sessions == {"no_reward": 1, "no_task": 1}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (trace(mask=[1, 1]), "response_ids and loss_mask lengths differ"),
        (trace(logprobs=[-1.0, -1.0]), "response_ids and logprobs lengths differ"),
        (trace(prompt=[]), "empty prompt_ids"),
        (trace(mask=[1, 2, 0]), "loss_mask holds values other than 0 and 1"),
        (trace(logprobs=[-1.0, float("nan"), 0.0]), "NaN, inf or positive"),
        (trace(logprobs=[-1.0, 0.5, 0.0]), "NaN, inf or positive"),
        (trace(response=[4, -5, 6]), "negative token ids"),
    ],
)
def test_bad_rows_are_refused_with_file_row_and_session(tmp_path, row, message):
    path = write(tmp_path / "t.parquet", [trace(session="ok"), {**row, "session_id": "bad"}])
    with pytest.raises(data.DataError, match=message) as e:
        data.load([path])
    assert f"{path} row 1 (session 'bad')" in str(e.value)


def test_no_rewards_no_tasks_and_inconsistent_sessions_are_refused(tmp_path):
    with pytest.raises(data.DataError, match="no rewards joined"):
        data.load([write(tmp_path / "a.parquet", [trace(reward=None), trace(session="s1", reward=None)])])
    with pytest.raises(data.DataError, match="no task ids"):
        data.load([write(tmp_path / "b.parquet", [trace(task=None)])])
    with pytest.raises(data.DataError, match=r"session 's0'.*disagree"):
        data.load([write(tmp_path / "c.parquet", [trace(reward=1.0), trace(reward=0.0, chain=1)])])
    with pytest.raises(data.DataError, match=r"row 1 \(session 's1'\): reward nan"):
        data.load([write(tmp_path / "d.parquet", [trace(), trace(session="s1", reward=float("nan"))])])
    with pytest.raises(data.DataError, match="no such trajectory file"):
        data.load([tmp_path / "missing.parquet"])


def test_missing_columns_are_named(tmp_path):
    path = tmp_path / "t.parquet"
    df = pl.DataFrame([trace()], schema=schema.SCHEMA).drop("reward", "logprobs")
    df.write_parquet(path, metadata={schema.VERSION_KEY: str(schema.FORMAT_VERSION)})
    with pytest.raises(data.DataError, match=r"missing columns \['logprobs', 'reward'\]"):
        data.load([path])


def test_files_are_concatenated(tmp_path):
    a = write(tmp_path / "a.parquet", [trace(session="x", reward=1.0)])
    b = write(tmp_path / "b.parquet", [trace(session="y", reward=0.0)])
    assert data.load([a, b]).session_ids == ["x", "y"]


def test_a_folder_of_shards_reads_as_its_files_and_a_session_lives_in_one_shard(tmp_path):
    shards = tmp_path / "round"
    write(shards / "node-b.parquet", [trace(session="y", reward=0.0)])
    write(shards / "node-a.parquet", [trace(session="x", reward=1.0), trace(session="x", reward=1.0, chain=1)])
    (shards / "node-a.stats.json").write_text("{}")  # reconstruct's stats beside each shard are not trajectories
    assert data.load([shards]).session_ids == ["x", "y"]
    assert len(data.load([shards]).prompt) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataError, match="empty: a folder with no"):
        data.load([shards, tmp_path / "empty"])
    write(shards / "node-c.parquet", [trace(session="x", reward=1.0, chain=2)])
    with pytest.raises(
        data.DataError, match=r"session .x. is in \S*node-a\.parquet and \S*node-c\.parquet: a session belongs"
    ):
        data.load([shards])


def _rollout(tmp_path, rows):
    return data.load([write(tmp_path / "t.parquet", rows)])


def test_make_traces_truncates_causally_and_counts_what_it_skips(tmp_path):
    rows = [
        trace(session="fits", prompt=[1, 2], response=[3, 4, 5], mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.25]),
        trace(session="cut", prompt=[1, 2, 3], response=[4, 5, 6, 7], mask=[1, 0, 1, 1]),
        trace(session="long_prompt", prompt=[1] * 6, response=[2]),
        trace(session="nothing", prompt=[1, 2, 3, 4], response=[5, 6, 7], mask=[0, 1, 1]),
        trace(session="equal", task="other"),
    ]
    rollout = _rollout(tmp_path, rows)
    adv = np.array([1.0, -1.0, 2.0, 3.0, 0.0])
    usable = np.array([True, True, True, True, False])
    traces, counts = data.make_traces(rollout, adv, usable, max_len=5)
    assert counts == {"truncated": 2, "prompt_too_long": 1, "nothing_trained": 1, "zero_std": 1}
    fits, cut = traces
    assert fits.tokens.tolist() == [1, 2, 3, 4, 5] and fits.trained.tolist() == [2, 3] and fits.adv == 1.0
    np.testing.assert_allclose(fits.behav_logp, [-0.5, -0.25])
    assert cut.tokens.tolist() == [1, 2, 3, 4, 5]  # prompt kept whole, response cut at its end
    assert cut.trained.tolist() == [2]  # predicts token 4 (mask 1); token 5 has mask 0
    assert np.isnan(cut.behav_logp).all()  # not captured


def test_plan_steps_keeps_groups_whole_in_a_seeded_partition():
    groups = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9], [10, 11]]
    plan = data.plan_steps(groups, 2, seed=3)
    assert len(plan) == 3 and sorted(i for step in plan for i in step) == list(range(12))
    for step in plan:  # each group lies wholly inside one step, in its own order
        assert all(set(g) <= set(step) or not set(g) & set(step) for g in groups)
    assert plan == data.plan_steps(groups, 2, seed=3)
    assert {tuple(map(tuple, (sorted(s) for s in data.plan_steps(groups, 2, seed=k)))) for k in range(8)} != {
        tuple(tuple(sorted(s)) for s in plan)
    }  # other seeds give other plans


def test_every_steps_advantages_sum_to_zero():
    """8 groups x 16 samples at 2 steps: sessions shuffled one by one put every group in both steps (mean advantage
    +-0.08 per step); whole groups keep each step's advantages summing to 0."""
    rng = np.random.default_rng(0)
    group = np.repeat(np.arange(8), 16)  # (128,)
    reward = (rng.random(128) < rng.random(8).repeat(16)).astype(float)
    adv, usable = losses.group_advantages(reward, group, scale_by_std=True)
    groups = [np.flatnonzero((group == g) & usable).tolist() for g in range(8)]
    for step in data.plan_steps([g for g in groups if g], 4, seed=0):
        assert abs(adv[step].sum()) < 1e-9


def test_pack_fills_bins_up_to_the_budget():
    lengths = [5, 3, 8, 2, 2, 7, 1]
    bins = data.pack(lengths, budget=8)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 4  # 28 tokens: 4 bins of 8 is the minimum
    with pytest.raises(ValueError, match="over the budget"):
        data.pack([9], budget=8)


def test_balance_gives_every_rank_the_same_number_of_passes():
    ranks = data.balance([8, 7, 5, 2, 1], world=2)
    assert [len(r) for r in ranks] == [3, 3]
    real = [[b for b in r if b is not None] for r in ranks]
    assert sorted(b for r in real for b in r) == [0, 1, 2, 3, 4]
    loads = [sum([8, 7, 5, 2, 1][b] for b in r) for r in real]
    assert max(loads) - min(loads) <= 3
    assert data.balance([4], world=3) == [[0], [None], [None]]


def test_collate_packs_traces_into_one_row_with_restarting_positions():
    a = data.Trace(
        session=0,
        tokens=np.array([1, 2, 3, 4]),
        n_prompt=2,
        trained=np.array([1, 2]),
        behav_logp=np.array([-1.0, np.nan], dtype=np.float32),
        adv=0.5,
    )
    b = data.Trace(
        session=3,
        tokens=np.array([5, 6, 7]),
        n_prompt=1,
        trained=np.array([1]),
        behav_logp=np.array([-2.0], dtype=np.float32),
        adv=-1.0,
    )
    mb = data.collate([a, b], [0.25, 0.125])
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.sel.tolist() == [1, 2, 5]
    assert mb.targets.tolist() == [3, 4, 7]
    assert mb.adv.tolist() == [0.5, 0.5, -1.0]
    assert mb.weight.tolist() == [0.25, 0.25, 0.125]
    assert mb.session.tolist() == [0, 0, 3]
    assert mb.behav_logp[1].isnan() and mb.behav_logp[[0, 2]].tolist() == [-1.0, -2.0]
    pad = data.collate([], [])
    assert pad.input_ids.shape == (1, 2) and len(pad.sel) == 0


def test_load_can_keep_sessions_without_reward_or_task_for_sft(tmp_path):
    rows = [
        trace(session="a"),
        trace(session="b", reward=None),
        trace(session="c", task=None),
        trace(session="d", reward=None, task=None),
    ]
    path = write(tmp_path / "t.parquet", rows)
    rollout = data.load([path], require_reward=False, require_task=False)
    assert rollout.session_ids == ["a", "b", "c", "d"]
    assert rollout.task_ids == ["t0", "t0", None, None]
    np.testing.assert_array_equal(rollout.reward, [1.0, np.nan, 1.0, np.nan])
    assert rollout.dropped_sessions == {"no_reward": 0, "no_task": 0}
    assert data.load([path], require_task=False).session_ids == ["a", "c"]
    assert data.load([path], require_reward=False).session_ids == ["a", "b"]
    assert data.load([path]).session_ids == ["a"]  # the default is GRPO's: both required
    nothing = write(tmp_path / "n.parquet", [trace(reward=None, task=None)])
    assert data.load([nothing], require_reward=False, require_task=False).session_ids == ["s0"]


def test_families_share_a_prefix_only_where_it_saves_tokens():
    def t(*tokens: int) -> data.Trace:
        return data.Trace(
            session=0,
            tokens=np.array(tokens),
            n_prompt=1,
            trained=np.array([0]),
            behav_logp=np.zeros(1, dtype=np.float32),
            adv=1.0,
        )

    traces = [t(1, 2, 3, 4, 5), t(9, 9), t(1, 2, 3, 4, 6, 7), t(1, 2, 8), t(1, 2, 3, 4, 5, 0)]
    # [1, 2, 3, 4] for 0, 2 and 4 saves 8; taking 3 in too would cut it to [1, 2]: 6. 0 and 4 share 5 tokens, but
    # a prefix leaves each member a token of its own. A family of one "shares" all but its last token.
    assert data.families(traces, budget=100) == [(4, [0, 4, 2]), (2, [3]), (1, [1])]  # in token order
    with pytest.raises(ValueError, match="over the budget"):
        data.families(traces, budget=5)


def shared_traces() -> tuple[data.Trace, data.Trace, data.Trace]:
    a = data.Trace(
        session=0,
        tokens=np.array([1, 2, 3, 4]),
        n_prompt=2,
        trained=np.array([1, 2]),
        behav_logp=np.array([-1.0, -2.0], dtype=np.float32),
        adv=0.5,
    )
    b = data.Trace(
        session=1,
        tokens=np.array([1, 2, 7]),
        n_prompt=2,
        trained=np.array([1]),
        behav_logp=np.array([-3.0], dtype=np.float32),
        adv=-0.5,
    )
    c = data.Trace(
        session=2,
        tokens=np.array([1, 2, 5, 6, 8]),
        n_prompt=2,
        trained=np.array([1, 3]),
        behav_logp=np.array([-4.0, -5.0], dtype=np.float32),
        adv=1.0,
    )
    return a, b, c


def test_collate_family_puts_tails_in_rows_after_the_prefix_and_trains_the_prefix_in_the_first_chunk():
    a, b, c = shared_traces()
    first, last = data.collate_family(2, [a, b, c], [0.25, 0.125, 1.0], [[2, 0], [1]], family=7)
    assert (first.prefix.family, first.prefix.first, first.prefix.last) == (7, True, False)
    assert (last.prefix.family, last.prefix.first, last.prefix.last) == (7, False, True)
    assert first.prefix.input_ids.tolist() == [[1, 2]] and first.prefix.input_ids is last.prefix.input_ids
    assert first.input_ids.tolist() == [[5, 6, 8], [3, 4, 0]]  # c's and a's tails, right-padded
    assert first.position_ids.tolist() == [[2, 3, 4], [2, 3, 4]]
    # the first pass addresses the prefix's 2 positions, then the rows: position 1 (token 2) predicts each member's
    # first tail token; c's position 3 is row 0, column 1; a's position 2 is row 1, column 0
    assert first.sel.tolist() == [1, 1, 1, 2 + 1, 2 + 3 + 0]
    assert first.targets.tolist() == [3, 7, 5, 8, 4]
    assert first.session.tolist() == [0, 1, 2, 2, 0]
    assert first.weight.tolist() == [0.25, 0.125, 1.0, 1.0, 0.25]
    assert first.adv.tolist() == [0.5, -0.5, 1.0, 1.0, 0.5]
    assert first.behav_logp.tolist() == [-1.0, -3.0, -4.0, -5.0, -2.0]
    assert last.input_ids.tolist() == [[7]] and last.position_ids.tolist() == [[2]]
    assert last.sel.tolist() == [] and last.targets.tolist() == []  # b's only trained token is in the prefix
    assert first.computed_tokens() == 2 + 6 and last.computed_tokens() == 1  # the first runs the prefix


def test_a_family_is_shared_only_where_it_computes_fewer_tokens_and_its_chunks_stay_together():
    a, b, c = shared_traces()
    aggregate = losses.AGGREGATIONS["token_mean"]
    # budget 6: tails of 2, 1 and 3 tokens in chunks of at most 4 -> [c], [a, b]: 2 + 3 + 2 * 2 = 9 < 12 computed
    mbs = data.rank_micro_batches([a, b, c], aggregate, 10, 6, rank=0, world=1, share_prefix=True)
    assert [(mb.prefix.first, mb.prefix.last) for mb in mbs] == [(True, False), (False, True)]
    assert sum(mb.computed_tokens() for mb in mbs) == 9
    # without a shared prompt worth its padding (1 token of 4 and 5), the traces are packed as they are
    d = dataclasses.replace(c, tokens=np.array([1, 9, 5, 6, 8]))
    (mb,) = data.rank_micro_batches([a, d], aggregate, 10, 9, rank=0, world=1, share_prefix=True)
    assert mb.prefix is None and mb.computed_tokens() == 9
    # on two ranks the family's two passes go to one rank, in order, and the other rank pads with empty passes
    e = dataclasses.replace(d, session=3)
    ranks = [data.rank_micro_batches([a, b, c, e], aggregate, 10, 6, r, 2, share_prefix=True) for r in range(2)]
    assert [len(r) for r in ranks] == [2, 2]
    with_family = [r for r in ranks if r[0].prefix is not None]
    assert len(with_family) == 1 and [mb.prefix.last for mb in with_family[0]] == [False, True]


def test_balance_counts_a_units_passes():
    # unit 0 is a family of three passes: the other rank gets both bins and an empty pass
    assert data.balance([9, 5, 4], world=2, passes=[3, 1, 1]) == [[0], [1, 2, None]]
