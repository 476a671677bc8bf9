"""reconstruct/_build.py and _io.py: capture folders → the trajectory table, its stats, its file."""

import json
import re
import shutil

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal
from transformers import AutoTokenizer

from reconstruct import (
    CaptureError,
    ConfigError,
    Stats,
    file_stats,
    read_session_tasks,
    reconstruct,
    schema,
    stats_path,
    write_trajectories,
)
from reconstruct._build import parse_shard
from reconstruct._expand import expand_captures
from reconstruct._io import CaptureRecord, parse_record, read_session_ids
from tests.captures import v1_lines
from tests.reconstruct.conftest import EXPECTED_CALLS, S, oracle


@pytest.fixture(scope="module")
def tokenizer(captures):
    return AutoTokenizer.from_pretrained(captures.model_dir)


@pytest.fixture(scope="module")
def folder(captures, tmp_path_factory):
    """The real vLLM capture file rotated into two, with damage a crash or another writer leaves: a corrupt
    line, a record of a future format version, a non-model call and a torn last line."""
    out = tmp_path_factory.mktemp("rotated")
    (path,) = captures.vllm_dir.glob("*.jsonl")
    lines = v1_lines(captures.vllm_dir)  # damage is made on v1 lines; the plain calls stay v2 (a mixed run)
    half = len(lines) // 2
    future = unsealed_record(lines[0])
    future["v"], future["id"] = 99, "f" * 32
    other = {**unsealed_record(lines[1]), "id": "e" * 32, "api": "other", "path": "/v1/models", "request": None}
    first = [*lines[:half], b"{this is not json", json.dumps(future).encode(), json.dumps(other).encode()]
    (out / path.name).write_bytes(b"\n".join(first) + b"\n")
    (out / path.name.replace(".jsonl", ".1.jsonl")).write_bytes(b"\n".join(lines[half:]) + b"\n" + lines[0][:300])
    return out


@pytest.fixture(scope="module")
def built(folder, captures, tokenizer):
    return reconstruct([folder, captures.plain_dir], tokenizer=tokenizer)


@pytest.mark.slow
def test_stats_count_everything(built, tokenizer):
    df, stats = built
    assert (stats.files, stats.lines, stats.corrupt_lines, stats.torn_lines) == (3, 34, 1, 1)
    assert (stats.unsupported_records, stats.other_records) == (1, 1)
    assert (stats.sessions, stats.calls, stats.merged_calls, stats.traces) == (9, 31, 31, 14)
    assert stats.breaks == {
        "prompt_rewritten": 1,
        "separate_agent": 1,
        "sibling": 1,
        "drift": 2,
        "missing_ids": 0,
        "swallowed_text": 0,
        "incomplete": 0,
    }
    assert (stats.retokenized_calls, stats.dropped, stats.notes, stats.eot_id) == (6, {}, {}, 2)
    assert stats.tokens_trainable == df["loss_mask"].list.sum().sum()
    assert stats.tokens_trainable + stats.tokens_masked == df["response_ids"].list.len().sum()
    assert stats.tokens_prompt == df["prompt_ids"].list.len().sum() and stats.max_calls_per_trace == 3


@pytest.mark.slow
def test_every_row_is_faithful_and_no_call_is_missing(built, captures):
    df, _ = built
    records = {r["id"]: r for r in captures.records()}
    assert df["trace_id"].to_list() == [f"{s}/{k}" for s, k in zip(df["session_id"], df["chain_index"], strict=True)]
    assert df["session_id"].to_list() == sorted(df["session_id"])  # sessions in order, traces by first call
    for row in df.iter_rows(named=True):
        mask = np.array(row["loss_mask"], dtype=bool)
        ids = np.array(row["response_ids"])[mask].tolist()
        if row["token_source"] == "captured":
            want = [oracle(records[e]) for e in row["exchange_ids"]]
            assert row["prompt_ids"] == want[0][0]
            assert ids == [i for w in want for i in w[1]]
            logprobs = np.array(row["logprobs"], dtype=np.float32)
            assert logprobs[mask].tolist() == np.array([x for w in want for x in w[2]], dtype=np.float32).tolist()
            assert not logprobs[~mask].any()
        else:
            assert row["logprobs"] is None and row["session_id"].startswith("plain")
        assert row["n_calls"] == len(row["exchange_ids"]) and row["api"] == "chat" and row["model"] == "tiny"
        conversation = json.loads(row["messages"])
        last = records[row["exchange_ids"][-1]]
        assert conversation["messages"][:-1] == last["request"]["messages"]
        assert conversation["messages"][-1]["role"] == "assistant" and conversation["tools"] == last["request"]["tools"]
        assert row["task_id"] is None and row["sample_id"] is None and row["reward"] is None
    calls = df.group_by("session_id").agg(pl.col("n_calls").sum()).sort("session_id")
    assert dict(calls.iter_rows()) == EXPECTED_CALLS


@pytest.mark.slow
def test_the_file_is_atomic_deterministic_and_keeps_its_stats(built, folder, captures, tokenizer, tmp_path):
    df, stats = built
    a = write_trajectories(df, stats, tmp_path / "a" / "trajectories.parquet")
    again = reconstruct([captures.plain_dir, folder], tokenizer=tokenizer)  # argument order does not matter
    b = write_trajectories(*again, tmp_path / "b" / "trajectories.parquet")
    assert a.read_bytes() == b.read_bytes() and stats_path(a).read_bytes() == stats_path(b).read_bytes()
    assert sorted(p.name for p in a.parent.iterdir()) == ["trajectories.parquet", "trajectories.stats.json"]
    assert_frame_equal(schema.read(a), df)
    saved = Stats.from_dict(json.loads(stats_path(a).read_bytes()))
    assert saved == stats and file_stats(schema.read(a), saved) == stats


@pytest.mark.slow
def test_worker_processes_build_the_same_file(built, folder, captures, tokenizer, tmp_path):
    df, stats = built
    parallel = reconstruct([folder, captures.plain_dir], tokenizer=tokenizer, jobs=2)
    a = write_trajectories(df, stats, tmp_path / "a" / "trajectories.parquet")
    b = write_trajectories(*parallel, tmp_path / "b" / "trajectories.parquet")
    assert a.read_bytes() == b.read_bytes() and stats_path(a).read_bytes() == stats_path(b).read_bytes()
    with pytest.raises(ConfigError):
        reconstruct([folder], jobs=0)


@pytest.mark.slow
def test_shards_partition_the_sessions(built, folder, captures, tokenizer):
    df, _ = built
    parts = [reconstruct([folder, captures.plain_dir], tokenizer=tokenizer, shard=(i, 3))[0] for i in range(3)]
    assert all(p.height for p in parts) and not set(parts[0]["session_id"]) & set(parts[1]["session_id"])
    assert_frame_equal(pl.concat(parts).sort("session_id", "chain_index"), df)
    assert parse_shard("2/3") == (2, 3)
    for bad in ("3/3", "a/b", "1", "-1/2"):
        with pytest.raises(ConfigError):
            parse_shard(bad)


@pytest.mark.slow
def test_sessions_table_fills_task_and_sample(folder, captures, tokenizer, tmp_path):
    table = pl.DataFrame(
        {"session_id": [S.retry, S.subagents], "task_id": ["t1", "t2"], "sample_id": [0, 3], "harness": ["pi", "qwen"]}
    )
    table.write_parquet(tmp_path / "sessions.parquet")
    sessions = read_session_tasks(tmp_path / "sessions.parquet")
    assert sessions == {S.retry: ("t1", 0), S.subagents: ("t2", 3)}
    df, _ = reconstruct([folder], sessions=sessions)
    got = df.group_by("session_id").agg(pl.col("task_id").first(), pl.col("sample_id").first())
    assert {s: (t, n) for s, t, n in got.iter_rows()} == {
        **dict.fromkeys(df["session_id"].unique(), (None, None)),
        S.retry: ("t1", 0),
        S.subagents: ("t2", 3),
    }
    pl.DataFrame({"session_id": ["a"]}).write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match="task_id"):
        read_session_tasks(tmp_path / "bad.parquet")
    pl.DataFrame({"session_id": ["a", "a"], "task_id": ["x", "y"]}).write_parquet(tmp_path / "twice.parquet")
    with pytest.raises(ConfigError, match="more than once"):
        read_session_tasks(tmp_path / "twice.parquet")


@pytest.mark.slow
def test_skipped_sessions_are_left_out_and_the_rest_is_unchanged(folder, captures, tmp_path):
    whole, _ = reconstruct([folder])
    pl.DataFrame({"session_id": [S.retry], "reason": ["WorkerCrashedError"]}).write_parquet(tmp_path / "lost.parquet")
    skip = read_session_ids(tmp_path / "lost.parquet")
    assert skip == {S.retry}
    df, _ = reconstruct([folder], skip=skip)
    assert_frame_equal(df, whole.filter(pl.col("session_id") != S.retry))
    assert S.retry in set(whole["session_id"])
    pl.DataFrame({"id": ["a"]}).write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match=r"bad\.parquet: needs a session_id column"):
        read_session_ids(tmp_path / "bad.parquet")


@pytest.mark.slow
def test_without_a_tokenizer_plain_calls_are_dropped_and_counted(folder, captures):
    df, stats = reconstruct([folder, captures.plain_dir])
    assert stats.dropped == {"missing_ids": 6} and stats.calls == 31 and stats.merged_calls == 25
    assert set(df["token_source"]) == {"captured"} and stats.eot_id is None


@pytest.mark.slow
def test_per_request_and_keep_modes(folder, tokenizer):
    df, stats = reconstruct([folder], tokenizer=tokenizer, mode="per-request")
    assert df.height == stats.traces == 25 and set(df["n_calls"]) == {1} and sum(stats.breaks.values()) == 0
    df, stats = reconstruct([folder], on_drift="keep")  # end-of-turn voted per session
    assert stats.breaks["drift"] == 0 and stats.drift_turns == 2 and stats.traces == 10


def test_bad_inputs(tmp_path):
    with pytest.raises(CaptureError, match="no such"):
        reconstruct([tmp_path / "missing"])
    with pytest.raises(CaptureError, match=r"no \*\.jsonl"):
        reconstruct([tmp_path])
    shutil.copy(__file__, tmp_path / "x.jsonl")  # not records at all: every line is corrupt, nothing is built
    df, stats = reconstruct([tmp_path])
    assert df.height == 0 and stats.corrupt_lines > 0 and stats.sessions == 0


# --- hostile input (issue 16): records met twice, glued lines, bodies only Python's json reads ---------------------


def unsealed(line):
    """A record line without its checksum member (as records written before issue 27): a test may then edit it."""
    return line[: line.rindex(b', "crc": ')] + b"}"


def unsealed_record(line):
    record = json.loads(line)
    del record["crc"]
    return record


def _vllm_lines(captures):
    (path,) = captures.vllm_dir.glob("*.jsonl")
    return path.name, v1_lines(captures.vllm_dir)  # as v1 lines, which these tests damage byte by byte


@pytest.fixture(scope="module")
def reference(captures):
    return reconstruct([captures.vllm_dir])


@pytest.mark.slow
def test_a_copied_capture_file_is_read_once(captures, reference, tmp_path):
    name, lines = _vllm_lines(captures)
    shutil.copy(captures.vllm_dir / name, tmp_path / name)
    shutil.copy(captures.vllm_dir / name, tmp_path / "stray copy.jsonl")
    df, stats = reconstruct([tmp_path])
    assert_frame_equal(df, reference[0])
    assert (stats.lines, stats.duplicate_records, stats.calls) == (2 * len(lines), len(lines), reference[1].calls)


@pytest.mark.slow
def test_glued_lines_are_split_into_their_records(captures, reference, tmp_path):
    """A record appended to a line that never got its newline (a writer killed mid-line, then restarted): whole,
    both records count; torn, the torn one is corrupt and the other is read. A trace never mixes sessions."""
    name, lines = _vllm_lines(captures)
    sessions = [json.loads(line)["session_id"] for line in lines]
    i = next(i for i in range(len(lines) - 1) if sessions[i] != sessions[i + 1])
    whole = [*lines[:i], lines[i] + lines[i + 1], *lines[i + 2 :]]
    (tmp_path / "whole").mkdir()
    (tmp_path / "whole" / name).write_bytes(b"\n".join(whole) + b"\n")
    df, stats = reconstruct([tmp_path / "whole"])
    assert_frame_equal(df, reference[0])
    assert (stats.lines, stats.glued_lines, stats.corrupt_lines, stats.calls) == (len(lines) - 1, 1, 0, len(lines))

    torn = [*lines[:i], lines[i][: len(lines[i]) // 2] + lines[i + 1], *lines[i + 2 :]]
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / name).write_bytes(b"\n".join(torn) + b"\n")
    df, stats = reconstruct([tmp_path / "torn"])
    assert (stats.glued_lines, stats.corrupt_lines, stats.calls) == (1, 1, len(lines) - 1)
    session_of = {json.loads(line)["id"]: s for line, s in zip(lines, sessions, strict=True)}
    lost = json.loads(lines[i])["id"]
    assert {e for ids in df["exchange_ids"] for e in ids} == set(session_of) - {lost}
    for session, ids in df.select("session_id", "exchange_ids").iter_rows():
        assert {session_of[e] for e in ids} == {session}


@pytest.mark.slow
def test_a_record_glued_inside_the_request_bodies_is_split(captures, reference, tmp_path):
    """Torn after its head, a record still parses (its answer is kept, its bodies do not parse): the record glued
    on is found in the bodies, which are otherwise never read."""
    name, lines = _vllm_lines(captures)
    sessions = [json.loads(line)["session_id"] for line in lines]
    i = next(i for i in range(len(lines) - 1) if sessions[i] != sessions[i + 1])
    torn = lines[i][: lines[i].index(b', "request": ') + 40]
    (tmp_path / name).write_bytes(b"\n".join([*lines[:i], torn + lines[i + 1], *lines[i + 2 :]]) + b"\n")
    df, stats = reconstruct([tmp_path])
    assert (stats.glued_lines, stats.corrupt_lines, stats.calls) == (1, 0, len(lines))
    session_of = {json.loads(line)["id"]: s for line, s in zip(lines, sessions, strict=True)}
    assert {e for ids in df["exchange_ids"] for e in ids} == set(session_of)
    for session, ids in df.select("session_id", "exchange_ids").iter_rows():
        assert {session_of[e] for e in ids} == {session}


@pytest.mark.slow
def test_the_prompt_array_is_lifted_out_of_the_line_unparsed(captures):
    """parse_record reads a vLLM record as a plain parse does, except the prompt ids (bytes, never decoded: null
    in the response body) and the chunk timings (null), and its request bodies only when read."""
    _, lines = _vllm_lines(captures)
    for line in lines:
        plain = unsealed_record(line)  # the checksum is checked and cut off
        record = parse_record(bytearray(line))
        prompt, _, _ = oracle(plain)
        assert isinstance(record, CaptureRecord) and record.prompt is not None and record.prompt.ids() == prompt
        lifted = re.sub(r'("prompt_token_ids":\s*)\[[^\]]*\]', r"\1null", plain["response_body"], count=1)
        assert lifted != plain["response_body"] and record["response_body"] == lifted
        assert record["chunks"] is None and record["request"] == plain["request"]  # bodies parsed only now
        assert dict(record) == {**plain, "response_body": lifted, "chunks": None}


@pytest.mark.slow
def test_nan_and_infinity_in_request_bodies_are_read_as_the_upstream_reads_them(captures, reference, tmp_path):
    """Python's json.dumps writes NaN and Infinity, vLLM reads them: the request (messages, tools, model) is kept."""
    name, lines = _vllm_lines(captures)
    text = b"\n".join(map(unsealed, lines)) + b"\n"
    odd = text.replace(b'"temperature":0', b'"temperature":NaN').replace(
        b'"model":"tiny"', b'"model":"tiny","x":-Infinity', 1
    )
    assert odd.count(b"NaN") == len(lines) and b"-Infinity" in odd
    (tmp_path / name).write_bytes(odd)
    df, stats = reconstruct([tmp_path])
    assert_frame_equal(df, reference[0])
    assert stats.unreadable_bodies == 0 and df["model"].null_count() == 0


@pytest.mark.slow
def test_request_bodies_that_do_not_parse_are_counted(captures, reference, tmp_path):
    """The head parses, the bodies do not: the answer's tokens are kept, and each lost request is counted."""
    name, lines = _vllm_lines(captures)
    key = b'"request": '
    damaged = [unsealed(line).replace(key, key + b"{oops", 1) for line in lines]
    (tmp_path / name).write_bytes(b"\n".join(damaged) + b"\n")
    df, stats = reconstruct([tmp_path])
    assert (stats.corrupt_lines, stats.calls, df.height) == (0, reference[1].calls, reference[0].height)
    assert stats.unreadable_bodies >= df.height and df["model"].null_count() == df.height  # each row's last call


@pytest.mark.slow
def test_issue27_a_line_spliced_from_two_records_fails_its_checksum(captures, reference, tmp_path):
    """The head of one session's record and the bodies of another's parse as one valid record: the checksum of the
    second, which ends the line, rejects it, so no trace holds one session's answer with another's request."""
    name, lines = _vllm_lines(captures)
    sessions = [json.loads(line)["session_id"] for line in lines]
    i = next(i for i in range(len(lines) - 1) if sessions[i] != sessions[i + 1])
    key = b', "request": '
    spliced = lines[i][: lines[i].index(key)] + lines[i + 1][lines[i + 1].index(key) :]
    assert json.loads(spliced)["session_id"] == sessions[i]  # valid JSON: only the checksum tells
    (tmp_path / name).write_bytes(b"\n".join([*lines[:i], spliced, *lines[i + 1 :]]) + b"\n")
    df, stats = reconstruct([tmp_path])
    assert (stats.corrupt_lines, stats.calls) == (1, len(lines) - 1)
    assert json.loads(lines[i])["id"] not in {e for ids in df["exchange_ids"] for e in ids}
    assert parse_record(bytearray(spliced)) is None and parse_record(bytearray(lines[i])) is not None


@pytest.mark.slow
def test_issue27_v1_v2_and_mixed_captures_give_the_same_parquet_bytes(captures, tokenizer, tmp_path):
    """The fixture's captures are v2 (the addon's default); expanded back to v1, and half of them, they give the
    same file byte for byte."""
    v2 = [captures.vllm_dir, captures.plain_dir]
    assert all(
        line.startswith(b'{"v": 2, ')
        for line in b"".join(p.read_bytes() for d in v2 for p in d.glob("*.jsonl")).split(b"\n")[:-1]
    )
    v1 = [tmp_path / "v1" / "vllm", tmp_path / "v1" / "plain"]
    for source, target in zip(v2, v1, strict=True):
        counts = expand_captures([source], target)
        assert counts.expanded == counts.lines and counts.corrupt == counts.unresolved == counts.torn == 0
    outputs = []
    for name, folders in (("v2", v2), ("v1", v1), ("mixed", [v2[0], v1[1]])):
        df, stats = reconstruct(folders, tokenizer=tokenizer)
        outputs.append(write_trajectories(df, stats, tmp_path / f"{name}.parquet").read_bytes())
    assert outputs[0] == outputs[1] == outputs[2]
