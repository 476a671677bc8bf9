"""Trajectory Parquet in, packed micro-batches out: reading, checking and planning for train/grpo.py.

``load`` reads only the trainer's columns (``reconstruct.schema.TRAINER_COLUMNS``) and refuses bad input with
a ``DataError`` that names the file, the row and what to fix. ``plan_steps`` splits task groups into optimizer
steps, ``pack`` fills micro-batches up to a token budget (several traces in one row, no padding; the model
tells them apart by their restarting position ids), ``balance`` hands micro-batches to ranks so that every rank
runs the same number of forward/backward passes, and ``collate`` builds the tensors of one micro-batch.

Packing in one row is right only for models whose every layer is attention: a mask (or restarting positions) keeps
traces apart there, but nothing keeps a recurrent state or a convolution (Qwen3.5's Gated DeltaNet layers) from
carrying one trace into the next. For those, ``padded=True`` gives one trace per row, right-padded (a causal layer
never reads the padding after a token), as many rows as fit the same token budget counting the padding
(``pad_bins``, ``collate_padded``). The policy (train/policy.py) says which a model needs.

With ``share_prefix``, traces that begin with the same tokens (the samples of one task start from one prompt)
form a *family* (``families``): its shared prefix computed once, then each trace's own tail, in right-padded rows
that continue from the prefix (train/prefix.py; ``MicroBatch.prefix``). Tails that do not fit one micro-batch go
in chunks, consecutive micro-batches of one rank (``collate_family``). A family is shared only where that computes
fewer tokens, padding counted, than its traces alone; the others are packed or padded as above. The log-probs are
those of separate rows up to float noise, for a fraction of the compute when prompts are most of each trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from reconstruct import schema
from train.losses import Aggregation, truncate
from train.prefix import SharedPrefix

__all__ = [
    "DataError",
    "MicroBatch",
    "Rollout",
    "Trace",
    "balance",
    "collate",
    "collate_family",
    "collate_padded",
    "families",
    "load",
    "make_traces",
    "pack",
    "pad_bins",
    "plan_steps",
    "rank_micro_batches",
    "trajectory_files",
]


class DataError(ValueError):
    """Input the trainer cannot use; the message says which file, row or session, and what to do."""


@dataclasses.dataclass
class Rollout:
    """Every trace read, with its session. Index s: session (S of them), m: trace (M)."""

    session_ids: list[str]  # (S,)
    task_ids: list[str]  # (S,) (None where load(require_task=False) kept a session without one)
    reward: np.ndarray  # (S,) float64: shared by all the session's traces (NaN: none, under require_reward=False)
    trace_session: np.ndarray  # (M,) int: session index of each trace
    prompt: list[np.ndarray]  # M x (P_m,) int64
    response: list[np.ndarray]  # M x (R_m,) int64
    loss_mask: list[np.ndarray]  # M x (R_m,) bool: True on sampled tokens
    logprobs: list[np.ndarray | None]  # M x (R_m,) float32 captured at sampling; None: not captured
    dropped_sessions: dict[str, int]  # reason -> sessions left out (no reward, no task)


@dataclasses.dataclass
class Trace:
    """One trainable trace after causal truncation: ``tokens = prompt ‖ response[:keep]``."""

    session: int
    tokens: np.ndarray  # (L,) int64
    n_prompt: int
    trained: np.ndarray  # (n,) positions in tokens[1:] whose token is sampled, i.e. predicted from position p
    behav_logp: np.ndarray  # (n,) float32 captured log-probs of those tokens; NaN when not captured
    adv: float


@dataclasses.dataclass
class MicroBatch:
    """The traces of one forward pass: packed, B = 1 row of T tokens, or padded, B rows of one trace each, right-
    padded to T, or a shared-prefix family's tails (``prefix``), B rows right-padded. N tokens are trained."""

    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T): restart at 0 at each trace (padding continues its row's count); P.. on tails
    sel: (
        torch.Tensor
    )  # (N,) positions whose *next* token is trained, in the flattened (B * T) rows (see collate_family)
    targets: torch.Tensor  # (N,) those next tokens
    adv: torch.Tensor  # (N,) advantage of the token's session
    weight: torch.Tensor  # (N,) the token's weight in the step's loss (sums to the loss normaliser)
    behav_logp: torch.Tensor  # (N,) captured log-probs; NaN where not captured
    session: torch.Tensor  # (N,) session index, for metrics
    prefix: SharedPrefix | None = None  # the rows are tails of this shared-prefix family (train/prefix.py)

    def to(self, device: torch.device) -> MicroBatch:
        moved: dict[str, Any] = {
            f.name: None if (v := getattr(self, f.name)) is None else v.to(device) for f in dataclasses.fields(self)
        }
        return dataclasses.replace(self, **moved)

    def computed_tokens(self) -> int:
        """The tokens this pass runs through the model: its rows, padding included, and the prefix where it computes
        it (a family's first pass: train/prefix.py)."""
        runs_prefix = self.prefix is not None and self.prefix.first
        return self.input_ids.numel() + (self.prefix.input_ids.shape[1] if runs_prefix and self.prefix else 0)


def _lists(df: pl.DataFrame, column: str, dtype: type) -> list[np.ndarray]:
    """Split a list column into one NumPy array per row without going through Python lists."""
    lengths = df[column].list.len().fill_null(0).to_numpy()  # (rows,)
    flat: np.ndarray = df[column].explode().drop_nulls().to_numpy().astype(dtype)  # (sum lengths,)
    return np.split(flat, np.cumsum(lengths)[:-1])


def trajectory_files(paths: Sequence[Path]) -> list[Path]:
    """``paths`` with each folder replaced by its ``*.parquet`` files, sorted; a folder with none is an error."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("*.parquet"))
            if not found:
                raise DataError(f"{path}: a folder with no *.parquet trajectory file")
            files += found
        else:
            files.append(path)
    return files


def load(paths: Sequence[Path], *, require_reward: bool = True, require_task: bool = True) -> Rollout:
    """Read and check trajectory files (a folder stands for its ``*.parquet`` files: a sharded round's
    reconstructions, one per node or per ``--shard``); sessions without a reward or a task id are dropped and counted.

    ``require_reward=False`` / ``require_task=False`` (SFT, which needs neither) keep those sessions instead, with
    reward NaN / task id None, and accept a table that has no reward / no task id at all.
    """
    frames = []
    for path in trajectory_files(paths):
        if not path.is_file():
            raise DataError(f"{path}: no such trajectory file")
        present = set(pl.read_parquet_schema(path))
        missing = [c for c in schema.TRAINER_COLUMNS if c not in present]
        if missing:
            raise DataError(f"{path}: missing columns {missing}; the trainer needs {list(schema.TRAINER_COLUMNS)}")
        try:
            df = schema.read(path, schema.TRAINER_COLUMNS)
        except schema.SchemaError as e:
            raise DataError(str(e)) from e
        frames.append(df.with_columns(pl.lit(str(path)).alias("_file"), pl.int_range(pl.len()).alias("_row")))
    df = pl.concat(frames)
    if df.is_empty():
        raise DataError(f"{', '.join(map(str, paths))}: no trajectories")
    spanning = df.group_by("session_id").agg(pl.col("_file").unique().sort()).filter(pl.col("_file").list.len() > 1)
    if not spanning.is_empty():  # one session reconstructed in two shards: its traces would be trained twice
        session, files = spanning.row(0)
        raise DataError(f"session {session!r} is in {' and '.join(files)}: a session belongs to one shard only")
    if require_reward and df["reward"].null_count() == len(df):
        raise DataError("no rewards joined: every trace has a null reward; join the graded results first (eval)")
    bad_reward = df.filter(pl.col("reward").is_not_null() & ~pl.col("reward").is_finite())
    if not bad_reward.is_empty():
        row = bad_reward.row(0, named=True)
        raise DataError(f"{row['_file']} row {row['_row']} (session {row['session_id']!r}): reward {row['reward']}")
    if require_task and df["task_id"].null_count() == len(df):
        raise DataError("no task ids: every trace has a null task_id, so sessions cannot be grouped by task")
    _check_rows(df)

    has_reward = pl.col("reward").is_not_null() | pl.lit(not require_reward)  # a null reward becomes NaN below
    has_task = pl.col("task_id").is_not_null() | pl.lit(not require_task)
    dropped = {
        "no_reward": df.filter(~has_reward)["session_id"].n_unique(),
        "no_task": df.filter(~has_task & has_reward)["session_id"].n_unique(),
    }
    df = df.filter(has_reward & has_task)
    sessions = df.group_by("session_id", maintain_order=True).agg(
        pl.col("task_id").n_unique().alias("n_task"),
        pl.col("reward").n_unique().alias("n_reward"),
        pl.col("task_id").first(),
        pl.col("reward").first(),
    )
    bad = sessions.filter((pl.col("n_task") > 1) | (pl.col("n_reward") > 1))
    if not bad.is_empty():
        raise DataError(
            f"session {bad['session_id'][0]!r}: its traces disagree on task_id or reward; "
            "a session has one task and one reward shared by all its traces"
        )
    index = {sid: s for s, sid in enumerate(sessions["session_id"].to_list())}
    logprobs = _lists(df, "logprobs", np.float32)
    has_lp = df["logprobs"].is_not_null().to_numpy()
    return Rollout(
        session_ids=sessions["session_id"].to_list(),
        task_ids=sessions["task_id"].to_list(),
        reward=sessions["reward"].to_numpy().astype(np.float64),
        trace_session=np.array([index[s] for s in df["session_id"].to_list()], dtype=np.int64),
        prompt=_lists(df, "prompt_ids", np.int64),
        response=_lists(df, "response_ids", np.int64),
        loss_mask=[m.astype(bool) for m in _lists(df, "loss_mask", np.int8)],
        logprobs=[lp if h else None for lp, h in zip(logprobs, has_lp, strict=True)],
        dropped_sessions=dropped,
    )


def _check_rows(df: pl.DataFrame) -> None:
    """Lengths that disagree, empty prompts, masks that are not 0/1, unusable captured log-probs."""
    checks = df.select(
        "_file",
        "_row",
        "session_id",
        pl.col("prompt_ids").list.len().fill_null(0).alias("n_prompt"),
        pl.col("response_ids").list.len().fill_null(0).alias("n_response"),
        pl.col("loss_mask").list.len().fill_null(0).alias("n_mask"),
        pl.col("logprobs").list.len().alias("n_logprobs"),
        ((pl.col("loss_mask").list.min() < 0) | (pl.col("loss_mask").list.max() > 1))
        .fill_null(False)
        .alias("bad_mask"),
        pl.col("logprobs")
        .list.eval(pl.element().is_finite().not_() | (pl.element() > 1e-3))
        .list.any()
        .fill_null(False)
        .alias("bad_logprobs"),
        ((pl.col("prompt_ids").list.min() < 0) | (pl.col("response_ids").list.min() < 0))
        .fill_null(False)
        .alias("negative_id"),
        pl.any_horizontal(
            pl.col(c).list.eval(pl.element().is_null()).list.any().fill_null(False)
            for c in ("prompt_ids", "response_ids", "loss_mask", "logprobs")
        ).alias("null_inside"),
    )
    problems = [
        (pl.col("n_prompt") == 0, "empty prompt_ids (the first response token needs a context)"),
        (pl.col("n_response") != pl.col("n_mask"), "response_ids and loss_mask lengths differ"),
        (
            pl.col("n_logprobs").is_not_null() & (pl.col("n_logprobs") != pl.col("n_response")),
            "response_ids and logprobs lengths differ",
        ),
        (pl.col("bad_mask"), "loss_mask holds values other than 0 and 1"),
        (pl.col("bad_logprobs"), "logprobs holds NaN, inf or positive values"),
        (pl.col("negative_id"), "negative token ids"),
        (pl.col("null_inside"), "a null inside a token list"),
    ]
    for condition, what in problems:
        hit = checks.filter(condition)
        if not hit.is_empty():
            row = hit.row(0, named=True)
            raise DataError(
                f"{row['_file']} row {row['_row']} (session {row['session_id']!r}): {what}; "
                f"prompt {row['n_prompt']}, response {row['n_response']}, loss_mask {row['n_mask']}, "
                f"logprobs {row['n_logprobs']} tokens ({len(hit)} such rows)"
            )


def make_traces(
    rollout: Rollout, adv: np.ndarray, usable: np.ndarray, max_len: int
) -> tuple[list[Trace], dict[str, int]]:
    """The traces of usable sessions, cut to ``max_len`` tokens (``losses.truncate``), with counts of what was cut.

    Counts: ``truncated`` (response end cut), ``prompt_too_long`` (skipped: no room for one response token),
    ``nothing_trained`` (skipped: no sampled token left in the kept part), ``zero_std`` (traces of skipped groups).
    """
    traces: list[Trace] = []
    counts = {"truncated": 0, "prompt_too_long": 0, "nothing_trained": 0, "zero_std": 0}
    for m, s in enumerate(rollout.trace_session.tolist()):
        if not usable[s]:
            counts["zero_std"] += 1
            continue
        prompt, response, mask = rollout.prompt[m], rollout.response[m], rollout.loss_mask[m]
        keep = truncate(len(prompt), len(response), max_len)
        if keep is None:
            counts["prompt_too_long"] += 1
            continue
        counts["truncated"] += keep < len(response)
        j = np.flatnonzero(mask[:keep])  # (n,) response positions of sampled tokens
        if len(j) == 0:
            counts["nothing_trained"] += 1
            continue
        lp = rollout.logprobs[m]
        traces.append(
            Trace(
                session=s,
                tokens=np.concatenate([prompt, response[:keep]]),  # (L,)
                n_prompt=len(prompt),
                trained=len(prompt) - 1 + j,  # (n,) the token at p + 1 is predicted from position p
                behav_logp=lp[j] if lp is not None else np.full(len(j), np.nan, dtype=np.float32),  # (n,)
                adv=float(adv[s]),
            )
        )
    return traces, counts


def plan_steps(groups: Sequence[Sequence[int]], groups_per_step: int, seed: int) -> list[list[int]]:
    """Optimizer steps of whole groups: shuffle the groups (seeded, never the sessions inside them) and cut them
    into steps of ``groups_per_step`` (the last may be short). Returns each step's sessions, group by group.

    A group never straddles two steps, so each step's advantages sum to zero group by group; split groups left
    a net push up or down in every step (mean advantage +0.08 / -0.08 per step on 8 groups x 16 at 2 steps).
    """
    order = np.random.default_rng(seed).permutation(len(groups))
    steps = [order[i : i + groups_per_step] for i in range(0, len(order), groups_per_step)]
    return [[int(s) for g in step for s in groups[g]] for step in steps]


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: indices of ``lengths`` grouped into bins of at most ``budget`` tokens each."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > budget:
            raise ValueError(f"item {i} has {lengths[i]} tokens, over the budget of {budget}")
        j = next((j for j, r in enumerate(room) if r >= lengths[i]), None)
        if j is None:
            bins.append([])
            room.append(budget)
            j = len(bins) - 1
        bins[j].append(i)
        room[j] -= lengths[i]
    return bins


def pad_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches of one item a row, each costing its row count times its
    longest row (the padded size) of at most ``budget`` tokens: first fit, longest first, so rows of a micro-batch
    have similar lengths and little padding."""
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > budget:
            raise ValueError(f"item {i} has {lengths[i]} tokens, over the budget of {budget}")
        # longest first: a bin's first item is its longest, so it fixes the padded row length
        j = next((j for j, b in enumerate(bins) if (len(b) + 1) * lengths[b[0]] <= budget), None)
        if j is None:
            bins.append([i])
        else:
            bins[j].append(i)
    return bins


def balance(costs: Sequence[int], world: int, passes: Sequence[int] | None = None) -> list[list[int | None]]:
    """Units (a bin, or a family's chunks) dealt to ``world`` ranks, costliest first to the least-loaded rank. A
    unit takes ``passes[u]`` forward passes (one by default), all on its rank, in order. Every rank runs the same
    number of passes: the short ones are padded with None (a pass that trains nothing), so collective calls line up
    across ranks."""
    n_passes = list(passes) if passes is not None else [1] * len(costs)
    ranks: list[list[int | None]] = [[] for _ in range(world)]
    load, count = [0] * world, [0] * world
    for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
        r = min(range(world), key=lambda r: (load[r], count[r], r))
        ranks[r].append(u)
        load[r] += costs[u]
        count[r] += n_passes[u]
    n = max(count)
    return [ranks[r] + [None] * (n - count[r]) for r in range(world)]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def families(traces: Sequence[Trace], budget: int) -> list[tuple[int, list[int]]]:
    """Traces grouped by a shared prefix: ``(prefix length, indices)`` per family (a lone trace is a family of one).
    Traces in token order put shared prefixes side by side; a trace joins the family before it when that saves
    tokens, i.e. when the family's members times the new shared length exceeds its other members times the old one.
    A prefix leaves every member at least one token of its own; every trace fits ``budget``."""
    order = sorted(range(len(traces)), key=lambda i: (traces[i].tokens.astype(">i8").tobytes(), i))
    found: list[tuple[int, list[int]]] = []
    for i in order:
        tokens = traces[i].tokens
        if len(tokens) > budget:
            raise ValueError(f"trace {i} has {len(tokens)} tokens, over the budget of {budget}")
        if found:
            shared, members = found[-1]
            joined = min(shared, _common_prefix(traces[members[0]].tokens, tokens), len(tokens) - 1)
            if joined > 0 and len(members) * joined > (len(members) - 1) * shared:
                found[-1] = (joined, [*members, i])
                continue
        found.append((len(tokens) - 1, [i]))
    return found


def rank_micro_batches(
    step_traces: Sequence[Trace],
    aggregate: Aggregation,
    norm_tokens: int,
    budget: int,
    rank: int,
    world: int,
    share_prefix: bool = False,
    padded: bool = False,
) -> list[MicroBatch]:
    """This rank's micro-batches of one optimizer step (the same count on every rank): the step's traces packed
    into ``budget``-token rows, dealt over ``world`` ranks. ``aggregate`` (a loss variant, losses.AGGREGATIONS)
    weighs each trace's tokens from its session and trained-token count (``norm_tokens``: dr_grpo's constant).
    ``share_prefix`` computes each family's shared prefix once (see the module doc); ``padded`` puts one trace in a
    row instead of packing, up to ``budget`` tokens a micro-batch with the padding. Ranks are balanced by the
    tokens their passes compute, padding included; a family's prefix counts once."""
    sessions = np.array([t.session for t in step_traces])  # (M,)
    n_trained = np.array([len(t.trained) for t in step_traces])  # (M,)
    weights = aggregate(sessions, n_trained, norm_tokens)  # (M,) per-token loss weight of each trace
    units: list[list[MicroBatch]] = []  # each unit's passes run in order on one rank
    costs: list[int] = []
    alone = list(range(len(step_traces)))
    if share_prefix:
        alone = []
        for f, (shared, members) in enumerate(families(step_traces, budget)):
            tails = [len(step_traces[i].tokens) - shared for i in members]
            chunks = pad_bins(tails, budget - shared)  # each pass: the prefix's keys and at most budget - P tokens
            cost = shared + sum(len(c) * tails[c[0]] for c in chunks)
            if len(members) < 2 or cost >= sum(len(step_traces[i].tokens) for i in members):
                alone += members
                continue
            units.append(
                collate_family(
                    shared, [step_traces[i] for i in members], weights[members], [[*c] for c in chunks], family=f
                )
            )
            costs.append(cost)
    lengths = [len(step_traces[i].tokens) for i in alone]
    bins = pad_bins(lengths, budget) if padded else pack(lengths, budget)
    batch = collate_padded if padded else collate
    for b in bins:
        members = [alone[i] for i in b]
        units.append([batch([step_traces[i] for i in members], weights[members])])
        costs.append(len(b) * max(lengths[i] for i in b) if padded else sum(lengths[i] for i in b))
    dealt = balance(costs, world, [len(u) for u in units])[rank]
    return [mb for u in dealt for mb in (units[u] if u is not None else [collate([], [])])]


def collate(traces: Sequence[Trace], weights: Sequence[float] | np.ndarray) -> MicroBatch:
    """Pack traces into one row; ``weights[i]`` is the per-token loss weight of ``traces[i]``.

    No traces gives a 2-token pass with nothing to train (a padding pass of a rank with less work).
    """
    if not traces:
        z = torch.zeros(0)
        return MicroBatch(
            torch.zeros(1, 2, dtype=torch.long), torch.arange(2)[None], z.long(), z.long(), z, z, z, z.long()
        )
    offsets = np.cumsum([0] + [len(t.tokens) for t in traces])  # (k+1,)
    tokens = np.concatenate([t.tokens for t in traces])  # (T,)
    positions = np.concatenate([np.arange(len(t.tokens)) for t in traces])  # (T,)
    sel = np.concatenate([t.trained + o for t, o in zip(traces, offsets, strict=False)])  # (N,)
    n = [len(t.trained) for t in traces]
    return MicroBatch(
        input_ids=torch.from_numpy(tokens)[None],  # (1, T)
        position_ids=torch.from_numpy(positions)[None],  # (1, T)
        sel=torch.from_numpy(sel),  # (N,)
        targets=torch.from_numpy(tokens[sel + 1]),  # (N,)
        adv=torch.from_numpy(np.repeat([t.adv for t in traces], n)).float(),  # (N,)
        weight=torch.from_numpy(np.repeat(np.asarray(weights, dtype=np.float64), n)).float(),  # (N,)
        behav_logp=torch.from_numpy(np.concatenate([t.behav_logp for t in traces])).float(),  # (N,)
        session=torch.from_numpy(np.repeat([t.session for t in traces], n)),  # (N,)
    )


def collate_padded(traces: Sequence[Trace], weights: Sequence[float] | np.ndarray) -> MicroBatch:
    """One trace a row, right-padded to the longest (pad id 0, positions counting on): a causal layer, attention
    or recurrent, computes a token from the tokens before it only, so the padding after it changes nothing and
    needs no mask. ``sel`` indexes the flattened rows."""
    width = max(len(t.tokens) for t in traces)
    tokens = np.zeros((len(traces), width), dtype=np.int64)  # (B, T)
    for r, t in enumerate(traces):
        tokens[r, : len(t.tokens)] = t.tokens
    sel = np.concatenate([t.trained + r * width for r, t in enumerate(traces)])  # (N,)
    n = [len(t.trained) for t in traces]
    return MicroBatch(
        input_ids=torch.from_numpy(tokens),  # (B, T)
        position_ids=torch.arange(width).expand(len(traces), width).clone(),  # (B, T)
        sel=torch.from_numpy(sel),  # (N,)
        targets=torch.from_numpy(tokens.reshape(-1)[sel + 1]),  # (N,) the next token of a row is in the same row
        adv=torch.from_numpy(np.repeat([t.adv for t in traces], n)).float(),  # (N,)
        weight=torch.from_numpy(np.repeat(np.asarray(weights, dtype=np.float64), n)).float(),  # (N,)
        behav_logp=torch.from_numpy(np.concatenate([t.behav_logp for t in traces])).float(),  # (N,)
        session=torch.from_numpy(np.repeat([t.session for t in traces], n)),  # (N,)
    )


def collate_family(
    shared: int,
    traces: Sequence[Trace],
    weights: Sequence[float] | np.ndarray,
    chunks: Sequence[Sequence[int]],
    family: int,
) -> list[MicroBatch]:
    """The micro-batches of one family whose traces begin with the same ``shared`` tokens: in each, the tails of the
    traces ``chunks[c]`` (indices into ``traces``) as right-padded rows at positions ``shared``.. (train/prefix.py).
    The first, which computes the prefix, also trains every member's tokens inside it: its ``sel`` addresses the
    prefix's output, then the rows. ``weights[i]`` is the per-token loss weight of ``traces[i]``."""
    prefix_ids = torch.from_numpy(traces[0].tokens[:shared])[None]  # (1, P)
    out = []
    for c, rows in enumerate(chunks):
        first = c == 0
        width = max(len(traces[r].tokens) - shared for r in rows)
        tokens = np.zeros((len(rows), width), dtype=np.int64)  # (k, L)
        offset = shared if first else 0  # the first pass's sel addresses the prefix's P positions, then the rows
        parts: list[tuple[Trace, float, np.ndarray, np.ndarray]] = []  # (trace, weight, trained mask, sel)
        if first:
            parts += [
                (t, float(w), t.trained < shared, t.trained[t.trained < shared])
                for t, w in zip(traces, weights, strict=True)
            ]
        for row, r in enumerate(rows):
            t = traces[r]
            tokens[row, : len(t.tokens) - shared] = t.tokens[shared:]
            own = t.trained[t.trained >= shared]
            parts.append((t, float(weights[r]), t.trained >= shared, offset + row * width + own - shared))
        parts = [p for p in parts if p[2].any()]
        n = [int(p[2].sum()) for p in parts]
        out.append(
            MicroBatch(
                input_ids=torch.from_numpy(tokens),  # (k, L)
                position_ids=(shared + torch.arange(width)).expand(len(rows), width).clone(),  # (k, L)
                sel=torch.from_numpy(np.concatenate([p[3] for p in parts] or [np.zeros(0, np.int64)])),  # (N,)
                targets=torch.from_numpy(
                    np.concatenate([t.tokens[t.trained[m] + 1] for t, _, m, _ in parts] or [np.zeros(0, np.int64)])
                ),  # (N,)
                adv=torch.from_numpy(np.repeat([p[0].adv for p in parts], n)).float(),  # (N,)
                weight=torch.from_numpy(np.repeat(np.asarray([p[1] for p in parts], dtype=np.float64), n)).float(),
                behav_logp=torch.from_numpy(
                    np.concatenate([t.behav_logp[m] for t, _, m, _ in parts] or [np.zeros(0, np.float32)])
                ).float(),  # (N,)
                session=torch.from_numpy(np.repeat([p[0].session for p in parts], n).astype(np.int64)),  # (N,)
                prefix=SharedPrefix(prefix_ids, family, first=first, last=c == len(chunks) - 1),
            )
        )
    return out
