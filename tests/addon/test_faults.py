"""Hostile input and faults, hook by hook (issue 16): a full disk, pathological JSON, secrets in odd places,
the health answer, large bodies. The same faults against a real mitmdump are in test_faults_proxy.py."""

import base64
import errno
import gzip
import json
import logging
import os
import shutil
import threading
import time
import tracemalloc
import zlib

import pytest
from mitmproxy.addons.disable_h2c import DisableH2C
from mitmproxy.exceptions import OptionsError
from mitmproxy.flow import Error
from mitmproxy.test import tflow, tutils

from addon import polar, proxy_errors, writer
from addon.record import ELIDED, Exchange
from addon.session import resolve
from tests.addon.test_polar import make_chat_flow, read_records, run_exchange, set_response
from tests.captures import v1_bytes

SALT = b"salt"


class FullDisk:
    """``os.writev`` for the writer: writes ``allow`` more bytes, then fails with ENOSPC until ``free()``."""

    def __init__(self, allow: int = 0) -> None:
        self.allow = allow
        self.full = True
        self.real = os.writev
        self.failures = 0

    def __call__(self, fd, buffers):
        if not self.full:
            return self.real(fd, buffers)
        if self.allow > 0:
            n = os.write(fd, b"".join(buffers)[: self.allow])
            self.allow -= n
            return n
        self.failures += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    def free(self):
        self.full = False


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def lines_of(directory):
    """The capture files' bytes as they are on disk (a v2 record's bodies compressed: search secrets in v1_bytes)."""
    return b"".join(p.read_bytes() for p in sorted(directory.glob("*.jsonl")))


# ---- item 1: a full disk ----------------------------------------------------------------------------


def test_refused_calls_are_counted_not_queued_with_their_bodies(addon, tctx, tmp_path):
    addon.writer.failure = "OSError: [Errno 28] No space left on device"
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 1_000_000}]}
    for _ in range(20):
        flow = make_chat_flow(body=big)
        addon.request(flow)
        assert (
            flow.response.status_code == 503
            and "not recording" in json.loads(flow.response.content)["error"]["message"]
        )
        addon.response(flow)  # what mitmproxy calls next for an answer the addon gave
    flow = make_chat_flow(path="/v1/whatever")  # not a model call, but recorded when forwarded: refused too
    addon.request(flow)
    assert flow.response.status_code == 503
    assert addon.writer.backlog_bytes == 0 and addon.refused == 21
    addon.writer.failure = None
    addon.done()
    assert not (tmp_path / "captures").exists() or read_records(tmp_path / "captures") == []


def test_a_backlog_over_its_bound_refuses_model_calls(addon, tctx):
    tctx.configure(addon, polar_backlog_mb=1)
    addon.writer._backlog = 2 << 20  # as if 2 MiB of records waited on a slow disk
    flow = make_chat_flow()
    addon.request(flow)
    assert (
        flow.response.status_code == 503
        and "wait to be written" in json.loads(flow.response.content)["error"]["message"]
    )
    addon.writer._backlog = 0
    flow = make_chat_flow()
    addon.request(flow)
    assert flow.response is None  # forwarded again


def finish(addon, flow):
    """The rest of an exchange whose request hook ran: a buffered JSON answer."""
    set_response(flow)
    addon.responseheaders(flow)
    flow.response.raw_content = b"{}"
    addon.response(flow)


class SlowDisk:
    """``os.writev`` for the writer that waits until ``go()``: records wait in the backlog, and nothing fails."""

    def __init__(self) -> None:
        self.real = os.writev
        self.free = threading.Event()

    def __call__(self, fd, buffers):
        self.free.wait(60)
        return self.real(fd, buffers)

    def go(self):
        self.free.set()


def call_as(addon, session, *, size=100_000):
    """One chat call of ``session`` through the hooks; returns its status (503: refused by the addon)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * size}]}
    flow = make_chat_flow(body=body, headers=((b"authorization", f"Bearer {session}".encode()),))
    addon.request(flow)
    if flow.response is not None:
        addon.response(flow)
        return flow.response.status_code, json.loads(flow.response.content)["error"]["message"]
    finish(addon, flow)
    return 200, None


def test_one_session_past_its_share_of_the_backlog_gets_503_while_the_others_record(addon, tctx, tmp_path, monkeypatch):
    disk = SlowDisk()
    monkeypatch.setattr(writer.os, "writev", disk)
    tctx.configure(addon, polar_backlog_mb=1)  # a session's share: 256 KiB
    share = (1 << 20) // polar.SESSION_SHARE
    answers = {"flood": [], "quiet-1": [], "quiet-2": []}
    while addon.writer.session_backlog("flood") <= share:  # about three 100 KB records: then its calls are refused
        answers["flood"].append(call_as(addon, "flood"))
    for _ in range(3):
        answers["flood"].append(call_as(addon, "flood"))
        for quiet in ("quiet-1", "quiet-2"):
            answers[quiet].append(call_as(addon, quiet, size=1_000))
    assert addon.writer.backlog_bytes < 1 << 20  # under the bound for all: only the flooding session waits
    status, message = answers["flood"][-1]
    assert status == 503 and "over its share of 0.2 MiB: 1/4 of polar_backlog_mb=1" in message
    assert [s for s, _ in answers["flood"]].count(503) == 3
    assert all(s == 200 for quiet in ("quiet-1", "quiet-2") for s, _ in answers[quiet])
    assert addon.refused_share == 3 and addon.refused == 0 and health_of(addon)["refused_share"] == 3
    disk.go()  # the disk catches up: the flooding session is taken again
    wait_for(lambda: addon.writer.backlog_bytes == 0)
    assert addon.writer.session_backlog("flood") == 0 and call_as(addon, "flood")[0] == 200
    addon.done()
    recorded = [r["session_id"] for r in read_records(tmp_path / "captures")]
    accepted = sum(s == 200 for s, _ in answers["flood"]) + 1
    assert recorded.count("flood") == accepted and recorded.count("quiet-1") == recorded.count("quiet-2") == 3


def test_a_sessions_part_of_the_backlog_is_gone_once_its_records_are_written_or_lost(tmp_path, monkeypatch):
    w = writer.CaptureWriter(tmp_path / "c", rotate_bytes=1 << 20, fsync=False, decode_content=lambda d, e: d)
    real = writer.to_record
    monkeypatch.setattr(writer, "to_record", lambda ex, decode: real(ex, decode) if ex.session_id != "s2" else 1 / 0)
    for i in range(6):
        ex = Exchange(f"s{i % 3}", "api_key", "chat", "vllm", "POST", "/v1/chat/completions", 0.0, {})
        ex.chunks, ex.chunk_times, ex.status = [b"y" * 1000], [0.0], 200
        w.submit(ex)
    wait_for(lambda: w.backlog_bytes == 0)
    assert [w.session_backlog(f"s{i}") for i in range(3)] == [0, 0, 0] and w._by_session == {}  # no id is kept
    assert len(w.close()) == 2 and w.records_written == 4  # s2's records could not be encoded: lost, and said so


def test_a_write_torn_by_a_full_disk_is_cut_back_and_finished_when_space_returns(addon, tctx, tmp_path, monkeypatch):
    run_exchange(addon, make_chat_flow(headers=((b"authorization", b"Bearer before"),)), [b"{}"])
    wait_for(lambda: addon.writer.records_written == 1)
    in_flight = [make_chat_flow(headers=((b"authorization", f"Bearer during-{i}".encode()),)) for i in range(5)]
    for flow in in_flight:
        addon.request(flow)  # admitted before the disk filled
    disk = FullDisk(allow=300)  # the next write stops 300 bytes into a record
    monkeypatch.setattr(writer.os, "writev", disk)
    for flow in in_flight:
        finish(addon, flow)  # answered 200 to the client: these records must not be lost
    wait_for(lambda: disk.failures >= 2)
    assert addon.writer.failure and "No space left" in addon.writer.failure
    on_disk = lines_of(tmp_path / "captures")
    assert on_disk.endswith(b"\n") and len(on_disk.split(b"\n")) == 2  # the first record only; no torn tail
    flow = make_chat_flow()
    addon.request(flow)
    assert flow.response.status_code == 503  # refused while the disk is full
    disk.free()
    wait_for(lambda: addon.writer.records_written == 6)
    assert addon.writer.failure is None and addon.writer.backlog_bytes == 0
    flow = make_chat_flow()
    addon.request(flow)
    assert flow.response is None  # recording works again: calls go through
    records = read_records(tmp_path / "captures")
    assert sorted(r["session_id"] for r in records) == ["before", *(f"during-{i}" for i in range(5))]


def test_shutdown_on_a_full_disk_is_bounded_and_names_every_record_it_lost(addon, tctx, tmp_path, monkeypatch, caplog):
    disk = FullDisk(allow=100)
    monkeypatch.setattr(writer.os, "writev", disk)
    monkeypatch.setattr(writer, "CLOSE_SECONDS", 1.0)
    flows = [make_chat_flow(headers=((b"authorization", f"Bearer lost-{i}".encode()),)) for i in range(3)]
    for flow in flows:
        addon.request(flow)
    for flow in flows:
        finish(addon, flow)
    wait_for(lambda: disk.failures >= 1)
    ids = {flow.metadata[polar.METADATA_KEY].id for flow in flows}
    w = addon.writer
    closing = threading.Thread(target=addon.done)
    with caplog.at_level(logging.ERROR):
        closing.start()
        closing.join(60)
    assert not closing.is_alive()
    assert len(w.unwritten) == 3 and {u.split()[1] for u in w.unwritten} == ids
    for record_id in sorted(ids):
        assert f"NOT WRITTEN: record {record_id}" in caplog.text
    assert "3 records were NOT written" in caplog.text
    assert lines_of(tmp_path / "captures") == b""  # the 100 bytes that got out were cut off again


def test_an_exchange_handed_over_at_shutdown_is_still_written(addon, tctx, tmp_path):
    ex = Exchange(
        session_id="late",
        session_source="header",
        api="chat",
        upstream="vllm",
        method="POST",
        path="/v1/chat/completions",
        t_start=time.time(),
        request_headers={},
    )
    addon._handing_over[ex.id] = ex  # the response hook ran; the loop step that hands it over did not
    addon.done()
    assert [r["session_id"] for r in read_records(tmp_path / "captures")] == ["late"]


# ---- item 2: the health answer -----------------------------------------------------------------------


def test_health_answers_loaded_options_and_whether_it_records(addon, tctx, tmp_path):
    run_exchange(addon, make_chat_flow(), [b"{}"])
    wait_for(lambda: addon.writer.records_written == 1)
    flow = make_chat_flow(path="/polar/health")
    flow.request.method = "GET"
    addon.request(flow)
    health = json.loads(flow.response.content)
    assert flow.response.status_code == 200 and polar.METADATA_KEY not in flow.metadata  # answered, unrecorded
    assert health["loaded"] is True and health["writable"] is True and health["records_written"] == 1
    assert health["options"]["polar_dir"] == str((tmp_path / "captures").resolve())
    assert health["options"]["polar_upstream"] == "vllm" and "polar_upstream_key" not in health["options"]
    addon.writer.failure = "OSError: disk full"
    flow = make_chat_flow(path="/polar/health")
    flow.request.method = "GET"
    addon.request(flow)
    assert json.loads(flow.response.content)["writable"] is False
    addon.writer.failure = None


# ---- item 6: pathological nesting --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/chat/completions", "error"), ("/v1/messages", "type"), ("/v1/responses", "error"),
     ("/v1beta/models/m:generateContent", "error")],
)  # fmt: skip
def test_json_nested_too_deep_is_answered_400_and_recorded(addon, tctx, tmp_path, path, shape):
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    flow = make_chat_flow(raw=deep, path=path, headers=((b"authorization", b"Bearer deep"),))
    addon.request(flow)
    assert flow.response is not None and flow.response.status_code == 400  # answered here, never forwarded
    assert shape in json.loads(flow.response.content) and "nested too deeply" in flow.response.text
    addon.response(flow)
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert rec["session_id"] == "deep" and rec["status"] == 400 and rec["error"]["kind"] == "request"
    assert rec["request_raw"]["text"].encode() == deep and rec["complete"] is False


def test_a_request_hook_failure_answers_the_model_call_instead_of_forwarding_it(addon, tctx, tmp_path, monkeypatch):
    monkeypatch.setattr(
        polar.translating, "translate_request", lambda *a: (_ for _ in ()).throw(RecursionError("deep"))
    )
    flow = make_chat_flow(path="/v1/messages", body={"model": "m", "max_tokens": 5, "messages": []})
    addon.request(flow)
    assert flow.response.status_code == 400 and json.loads(flow.response.content)["type"] == "error"
    assert flow.request.path == "/v1/messages"  # not translated, and not sent anywhere
    monkeypatch.setattr(polar.session, "resolve", lambda *a: 1 / 0)  # before any record exists
    flow2 = make_chat_flow()
    addon.request(flow2)
    assert flow2.response.status_code == 500
    for f in (flow, flow2):
        addon.response(f)
    addon.done()
    kinds = sorted(r["error"]["kind"] for r in read_records(tmp_path / "captures"))
    assert kinds == ["addon", "request"]


# ---- item 8: large bodies ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["one long message", "many messages", "many content parts"])
def test_a_large_request_body_costs_one_copy_in_the_request_hook(addon, tctx, shape):
    n = 10 << 20  # over LEAN_BYTES
    messages = {
        "one long message": [{"role": "user", "content": "x" * n}],
        "many messages": [{"role": "user", "content": "x" * 200}] * (n // 230),
        "many content parts": [{"role": "user", "content": [{"type": "text", "text": "y" * 50}] * 4}] * (n // 300),
    }[shape]
    flow = make_chat_flow(body={"model": "m", "messages": messages})
    size = len(flow.request.content)
    del messages
    tracemalloc.start()
    try:
        addon.request(flow)
        retained, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # In flight the addon holds one copy: the body sent upstream (the client's, with the token fields spliced
    # in); the record shares the client's bytes. At its peak, one more copy would be the decoded text and the
    # parsed value side by side (2 copies, 3+ for many small objects): the lean parse builds neither.
    assert retained < 1.1 * size and peak < 1.3 * size
    assert flow.metadata[polar.METADATA_KEY].request.value is None


# ---- item 9: secrets -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "path"),
    [
        ({}, "/v1beta/models/m:generateContent?KEY=sk-live-SECRET1"),
        ({}, "/v1/chat/completions?api_key=sk-live-SECRET1&x=1"),
        ({}, "/v1/chat/completions?Api-Key=sk-ant-SECRET1"),
        ({}, "/v1/chat/completions?access_token=ya29.SECRET1%2B%2F&token=ya29.SECRET1%2B%2F"),
        ({"x-polar-session": "sk-live-SECRET1"}, "/v1/chat/completions"),
        ({}, "/s/sk-proj-SECRET1/v1/chat/completions"),
    ],
)
def test_secrets_in_query_strings_and_session_ids_are_hashed(headers, path):
    s = resolve(headers, path, SALT)
    assert "SECRET1" not in s.path and "SECRET1" not in s.id and s.source == "key_hash" and s.id.startswith("key-")


def test_secret_session_ids_and_query_keys_never_reach_disk(addon, tctx, tmp_path):
    secret = "sk-proj-NEVERONDISK"
    cases = [
        ((), f"/v1/chat/completions?API_KEY={secret}"),
        ((), f"/v1/chat/completions?apikey={secret}&stream=1"),
        ((), f"/v1beta/models/m:generateContent?Key={secret}"),
        ((), f"/v1/whatever?access_token={secret}"),
        (((b"x-polar-session", secret.encode()),), "/v1/chat/completions"),
        (((b"x-polar-session", f"{secret}==".encode()),), "/v1/chat/completions"),  # not even a session id
        ((), f"/s/{secret}/v1/chat/completions"),
    ]
    for headers, path in cases:
        flow = make_chat_flow(headers=headers, path=path)
        run_exchange(addon, flow, [b"{}"])
        assert secret not in flow.request.path and secret not in flow.request.headers.get("x-polar-session", "")
    addon.done()
    records = read_records(tmp_path / "captures")
    assert len(records) == len(cases)
    assert {r["session_source"] for r in records[:5] + records[6:]} == {"key_hash"}
    assert secret.encode() not in v1_bytes(tmp_path / "captures")  # nor in any body a v2 record compresses
    for f in (tmp_path / "captures").iterdir():
        assert secret.encode() not in f.read_bytes(), f


def test_short_writes_split_inside_a_record_still_give_whole_lines(addon, tctx, tmp_path, monkeypatch):
    real = os.writev
    monkeypatch.setattr(writer.os, "writev", lambda fd, buffers: real(fd, [bytes(b"".join(buffers)[:7])]))
    for i in range(3):
        run_exchange(addon, make_chat_flow(headers=((b"authorization", f"Bearer short-{i}".encode()),)), [b"{}"])
    addon.done()
    assert [r["session_id"] for r in read_records(tmp_path / "captures")] == ["short-0", "short-1", "short-2"]


LEAN_CASES = [
    (
        b'{"model": "m", "messages": [{"role": "user", '
        b'"content": "caf\\u00e9 \\ud83d\\ude00 \\"q\\" \\\\ \\/ \\b\\f\\n\\r\\t"}], "stream": true}'
    ),
    b' \t\r\n{ "messages" : [ ] , "tools":[{"a":[1,-2.5e3,true,false,null,{"b":{}}]}] , "x" : NaN, "y": -Infinity } \n',
    b'{"messages": [{"content": [{"type": "text", "text": "\xc3\xa9\xe2\x82\xac"}]}], "system": "s", "input": 5}',
    b"{}",
    b'[{"messages": []}]',
    b'"just a string"',
]


def mutations(data, rng, n):
    """Truncations, insertions, deletions and swaps of ``data``: mostly invalid JSON, some still valid."""
    for _ in range(n):
        i = rng.randrange(len(data) + 1)
        kind = rng.randrange(4)
        if kind == 0:
            yield data[:i]
        elif kind == 1:
            yield data[:i] + bytes([rng.choice(b'{}[]",:\\ 0a\x01\ntnNI-.eE')]) + data[i:]
        elif kind == 2:
            yield data[:i] + data[i + 1 :]
        else:
            yield data[:i] + data[i + 1 : i + 2] + data[i : i + 1] + data[i + 2 :]


def test_a_lean_parse_accepts_exactly_what_json_loads_accepts():
    import random

    rng = random.Random(16)
    for base in LEAN_CASES:
        for data in [base, *mutations(base, rng, 400)]:
            try:
                expected = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                expected = ValueError
            except RecursionError:
                continue
            body = polar.Body.parse(data, lean_over=0)
            if expected is ValueError:
                assert not body.is_json, data
                continue
            assert body.is_json, data
            assert json.dumps(body.full(), sort_keys=True) == json.dumps(expected, sort_keys=True), data  # NaN != NaN


def test_a_lean_parse_leaves_out_only_large_bulk_members():
    big = "x" * 100_000
    data = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": big}],
            "tools": [],
            "stream": True,
            "stream_options": {"include_usage": False},
            "system": big,
        }
    ).encode()
    body = polar.Body.parse(data, lean_over=0)
    assert body.lean and body.value["messages"] is ELIDED and body.value["system"] is ELIDED
    assert body.value["tools"] == [] and body.value["stream_options"] == {"include_usage": False}
    assert body.full() == json.loads(data) and not body.lean
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert polar.Body.parse(deep, lean_over=0).too_deep


def test_a_large_body_that_needs_rewriting_is_rewritten_whole(addon, tctx, tmp_path):
    big = "x" * (9 << 20)
    body = {"model": "m", "messages": [{"role": "user", "content": big}], "stream": True, "stream_options": {"x": 1}}
    flow = make_chat_flow(body=body)
    run_exchange(addon, flow, [b"data: [DONE]\n\n"], content_type="text/event-stream")
    sent = json.loads(flow.request.content)
    assert sent["messages"][0]["content"] == big and sent["stream_options"] == {"x": 1, "include_usage": True}
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert rec["request"] == body and rec["upstream_request"] == sent


# ---- issue 27: faults the record path took silently ----------------------------------------------------


def test_issue27_an_http2_prior_knowledge_preface_leaves_no_record(addon, tctx, tmp_path):
    preface = tflow.tflow(req=tutils.treq(method=b"PRI", path=b"*", http_version=b"HTTP/2.0", content=b""))
    DisableH2C().request(preface)  # mitmproxy's own addon, which runs before scripts, kills the preface
    addon.request(preface)
    addon.error(preface)
    run_exchange(addon, make_chat_flow(), [b"{}"])
    addon.done()
    assert [(r["method"], r["path"]) for r in read_records(tmp_path / "captures")] == [("POST", "/v1/chat/completions")]


@pytest.mark.parametrize(
    "given", ["../../etc/passwd", "s" * 65536, "run-1\x01\x1b[2J"], ids=["dotdot", "64KB", "control"]
)
def test_issue27_invalid_session_ids_get_a_session_each_not_anonymous(addon, tctx, tmp_path, given):
    for value in (given, given + "2"):
        flow = make_chat_flow(headers=((b"x-polar-session", value.encode()),))
        run_exchange(addon, flow, [b"{}"])
    addon.done()
    records = read_records(tmp_path / "captures")
    assert [r["session_source"] for r in records] == ["id_hash", "id_hash"]
    assert records[0]["session_id"] != records[1]["session_id"]
    assert given.encode() not in v1_bytes(tmp_path / "captures")


def gzip_bomb(size):
    """``size`` bytes of JSON that gzip to a few kB (``size`` / 1000 or so)."""
    return gzip.compress(b'{"x": "' + b"0" * (size - 9) + b'"}', 9)


def test_issue27_a_gzip_bomb_answer_is_kept_encoded_with_a_clear_error(addon, tctx, tmp_path):
    tctx.configure(addon, polar_max_decoded_mb=1)
    bomb = gzip_bomb(8 << 20)
    passed = run_exchange(addon, make_chat_flow(), [bomb], headers=((b"content-encoding", b"gzip"),))
    assert passed == bomb  # the client gets what the upstream sent, as bare mitmproxy forwards it
    addon.done()
    (record,) = read_records(tmp_path / "captures")
    assert record["error"] == {"kind": "decode", "message": "gzip body decodes to more than 1 MiB "
                               "(polar_max_decoded_mb); kept encoded"}  # fmt: skip
    assert record["response_body"] is None and base64.b64decode(record["response_b64"]) == bomb


def test_issue27_a_gzip_bomb_answer_to_a_translated_call_is_refused_in_the_api_shape(addon, tctx, tmp_path):
    tctx.configure(addon, polar_max_decoded_mb=1)
    bomb = gzip_bomb(64 << 20)
    tracemalloc.start()
    flow = make_chat_flow(
        path="/v1/messages", body={"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}
    )
    run_exchange(addon, flow, [bomb], headers=((b"content-encoding", b"gzip"),))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    answer = json.loads(flow.response.content)
    assert flow.response.status_code == 502 and answer["type"] == "error"
    assert "more than 1 MiB" in answer["error"]["message"]
    assert peak < 16 << 20  # never decoded whole (64 MiB)
    addon.done()
    (record,) = read_records(tmp_path / "captures")
    assert record["error"]["kind"] == "decode" and record["complete"] is False


def test_issue27_a_gzip_bomb_request_is_answered_413_and_never_forwarded(addon, tctx, tmp_path):
    tctx.configure(addon, polar_max_decoded_mb=1)
    flow = make_chat_flow(raw=gzip_bomb(8 << 20), headers=((b"content-encoding", b"gzip"),))
    addon.request(flow)
    assert flow.response.status_code == 413 and "polar_max_decoded_mb" in flow.response.get_text()
    addon.response(flow)
    addon.done()
    (record,) = read_records(tmp_path / "captures")
    assert record["error"]["kind"] == "request" and record["status"] == 413 and record["request"] is None


def with_body_size_limit(tctx):
    """mitmproxy's own option, which a real mitmdump's proxy server declares and the test context does not."""
    tctx.options.add_option("body_size_limit", str | None, None, "mitmproxy's body size limit")


def test_polar_max_body_mb_sets_mitmproxys_body_size_limit(addon, tctx):
    with_body_size_limit(tctx)
    tctx.configure(addon, polar_max_body_mb=polar.MAX_BODY_MB)
    assert tctx.options.body_size_limit == str(32 << 20) and addon.max_body == 32 << 20
    tctx.configure(addon, polar_max_body_mb=2)  # changed while running: mitmproxy's follows
    assert tctx.options.body_size_limit == str(2 << 20)
    with pytest.raises(OptionsError, match="set that instead of '1g'"):
        tctx.configure(addon, body_size_limit="1g")  # one bound, set in one place
    with pytest.raises(OptionsError, match="polar_max_body_mb must be at least 1"):
        tctx.configure(addon, polar_max_body_mb=0)


def test_a_body_mitmproxy_refused_for_its_size_is_counted_and_never_recorded(addon, tctx, tmp_path, caplog):
    flow = make_chat_flow(path="/s/sess-big/v1/chat/completions?key=sk-SECRET")
    flow.error = Error(
        "Request body exceeds mitmproxy's body_size_limit."
    )  # check_body_size's, before our request hook
    with caplog.at_level(logging.WARNING):
        addon.error(flow)
    assert addon.too_large == 1 and health_of(addon)["too_large"] == 1 and polar.METADATA_KEY not in flow.metadata
    assert "refused POST /v1/chat/completions: its body is over polar_max_body_mb=32" in caplog.text
    assert "SECRET" not in caplog.text and "sess-big" not in caplog.text
    addon.done()
    assert not (tmp_path / "captures").exists() or read_records(tmp_path / "captures") == []


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/chat/completions", {"type": "invalid_request_error", "code": 413, "param": None}),
     ("/s/sess/v1/messages?beta=true", {"type": "request_too_large"}),
     ("/v1/responses", {"type": "invalid_request_error", "code": None, "param": None}),
     ("/v1beta/models/m:streamGenerateContent?alt=sse", {"status": "INVALID_ARGUMENT", "code": 413}),
     ("/v1/embeddings", {"type": "invalid_request_error", "code": 413, "param": None})],
)  # fmt: skip
def test_the_413_for_a_body_over_the_limit_is_in_the_shape_of_the_clients_api(addon, tctx, path, shape):
    with_body_size_limit(tctx)
    tctx.configure(addon, polar_max_body_mb=3)
    response = proxy_errors.too_large(make_chat_flow(path=path).request)
    answer = json.loads(response.content)
    assert response.status_code == 413 and response.headers["connection"] == "close"
    error = answer["error"]
    assert {k: error[k] for k in shape} == shape and (answer.get("type") == "error") == ("messages" in path)
    assert error["message"] == (
        "polar: the request body is over this proxy's limit of 3 MiB (polar_max_body_mb); not forwarded or recorded"
    )


@pytest.mark.parametrize("fmt", [1, 2])
def test_issue27_every_record_line_ends_with_the_crc32_of_its_bytes(addon, tctx, tmp_path, fmt):
    tctx.configure(addon, polar_format=fmt)
    for _ in range(3):
        run_exchange(addon, make_chat_flow(), [b'{"ok": true}'])
    addon.done()
    lines = lines_of(tmp_path / "captures").split(b"\n")[:-1]
    assert len(lines) == 3
    for line in lines:
        body, tail = line[: -len(b', "crc": "00000000"}')], line[-len(b', "crc": "00000000"}') :]
        assert tail == b', "crc": "%08x"}' % zlib.crc32(body)


def health_of(addon):
    flow = make_chat_flow(path="/polar/health")
    flow.request.method = "GET"
    addon.request(flow)
    return json.loads(flow.response.content)


@pytest.mark.parametrize("fmt", [1, 2])
def test_issue27_a_capture_folder_removed_mid_run_refuses_calls_and_loses_no_record(addon, tctx, tmp_path, caplog, fmt):
    tctx.configure(addon, polar_format=fmt)
    folder = tmp_path / "captures"
    run_exchange(addon, make_chat_flow(headers=((b"x-polar-session", b"before"),)), [b"{}"])
    wait_for(lambda: addon.writer.records_written == 1)
    in_flight = make_chat_flow(headers=((b"x-polar-session", b"in-flight"),))
    addon.request(in_flight)  # admitted before the folder went
    shutil.rmtree(folder)
    health = health_of(addon)
    assert health["writable"] is False and "was removed" in health["problem"]
    refused = make_chat_flow()
    addon.request(refused)
    assert refused.response.status_code == 503
    finish(addon, in_flight)
    wait_for(lambda: addon.writer.failure is not None)  # it went into the removed file: seen, kept, retried
    assert addon.writer.records_written == 1 and "was removed while open" in caplog.text
    folder.mkdir()  # the folder is back: the kept record is written, calls are admitted again
    wait_for(lambda: addon.writer.records_written == 2)
    assert health_of(addon)["writable"] is True
    addon.done()
    assert [r["session_id"] for r in read_records(folder)] == ["in-flight"]


@pytest.mark.parametrize("fmt", [1, 2])
def test_issue27_a_capture_file_removed_mid_run_goes_on_in_a_new_file(addon, tctx, tmp_path, fmt):
    tctx.configure(addon, polar_format=fmt)
    folder = tmp_path / "captures"
    run_exchange(addon, make_chat_flow(), [b"{}"])
    wait_for(lambda: addon.writer.records_written == 1)
    removed = addon.writer.path
    removed.unlink()
    run_exchange(addon, make_chat_flow(headers=((b"x-polar-session", b"after"),)), [b"{}"])
    wait_for(lambda: addon.writer.records_written == 2)
    addon.done()
    assert addon.writer is None and not removed.exists()
    assert [r["session_id"] for r in read_records(folder)] == ["after"]


def test_issue27_shutdown_with_the_capture_folder_removed_names_what_it_lost(
    addon, tctx, tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(writer, "CLOSE_SECONDS", 0.5)
    run_exchange(addon, make_chat_flow(), [b"{}"])
    wait_for(lambda: addon.writer.records_written == 1)
    in_flight = make_chat_flow(headers=((b"x-polar-session", b"lost-at-exit"),))
    addon.request(in_flight)
    shutil.rmtree(tmp_path / "captures")
    finish(addon, in_flight)
    wait_for(lambda: addon.writer.failure is not None)
    addon.done()
    assert "NOT WRITTEN" in caplog.text and "lost-at-exit" in caplog.text
