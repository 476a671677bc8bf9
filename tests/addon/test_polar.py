"""The addon's hooks, called directly as mitmproxy's own addon tests do."""

import json
import os
import re
import secrets
import time

import pytest
from mitmproxy.test import tflow, tutils

from addon import polar
from addon.record import upstream_body
from tests.captures import v1_bytes, v1_lines


def read_records(directory):
    """The records under ``directory`` as v1 records (a v2 one expanded), file by file."""
    return [json.loads(line) for line in v1_lines(directory)]


def make_chat_flow(*, body=None, stream=False, path="/v1/chat/completions", headers=(), raw=None):
    body = (
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **({"stream": True} if stream else {})}
        if body is None
        else body
    )
    content = raw if raw is not None else json.dumps(body).encode()
    req = tutils.treq(
        method=b"POST", path=path.encode(), content=content, headers=((b"content-type", b"application/json"), *headers)
    )
    return tflow.tflow(req=req)


def set_response(flow, *, content_type="application/json", status=200, headers=()):
    flow.response = tutils.tresp(
        status_code=status, content=b"", headers=((b"content-type", content_type.encode()), *headers)
    )


def run_exchange(addon, flow, chunks, **response):
    """Play an exchange through the hooks; a stream goes through the tee, a JSON answer is buffered."""
    addon.request(flow)
    set_response(flow, **response)
    addon.responseheaders(flow)
    if flow.response.stream:
        passed = [flow.response.stream(c) for c in [*chunks, b""]]
    else:
        flow.response.raw_content = passed = b"".join(chunks)
    addon.response(flow)
    return passed


def test_streamed_chat_is_teed_and_recorded(addon, tctx, tmp_path):
    flow = make_chat_flow(stream=True, headers=((b"authorization", b"Bearer sess-1"),))
    chunks = [b'data: {"choices":[{"delta":{"content":"He"},"token_ids":[1]}]}\n\n', b"data: [DONE]\n\n"]
    passed = run_exchange(addon, flow, chunks, content_type="text/event-stream")
    assert passed[:-1] == chunks  # the client gets every chunk, unchanged
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert rec["v"] == 1 and rec["session_id"] == "sess-1" and rec["session_source"] == "api_key"
    assert rec["api"] == "chat" and rec["streamed"] and rec["complete"] and rec["error"] is None
    assert rec["response_body"] == b"".join(chunks).decode()
    assert rec["injected"] == {
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
        "stream_options.include_usage": True,
    }
    assert [n for _, n in rec["chunks"]] == [len(c) for c in chunks]
    assert rec["t_start"] <= rec["t_first_byte"] <= rec["t_end"]
    sent = json.loads(flow.request.content)
    assert sent == upstream_body(rec) and sent["return_token_ids"] is True
    assert flow.request.headers["x-polar-session"] == "sess-1"
    assert "authorization" not in flow.request.headers


def test_non_streamed_json_response_is_parsed(addon, tctx, tmp_path):
    flow = make_chat_flow()
    payload = {"choices": [{"message": {"content": "hi"}, "token_ids": [5, 6]}], "prompt_token_ids": [1, 2]}
    run_exchange(addon, flow, [json.dumps(payload).encode()[:10], json.dumps(payload).encode()[10:]])
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert json.loads(rec["response_body"]) == payload and not rec["streamed"]
    assert rec["request"]["messages"] == [{"role": "user", "content": "hi"}]
    assert rec["upstream_request"] is None


def test_client_stream_options_forces_full_upstream_body(addon, tctx, tmp_path):
    flow = make_chat_flow(body={"stream": True, "stream_options": {"x": 1}, "messages": []})
    run_exchange(addon, flow, [b"data: [DONE]\n\n"], content_type="text/event-stream")
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert rec["upstream_request"]["stream_options"] == {"x": 1, "include_usage": True}
    assert upstream_body(rec) == json.loads(flow.request.content)


def test_plain_upstream_injects_nothing(addon, tctx, tmp_path):
    tctx.configure(addon, polar_upstream="plain")
    flow = make_chat_flow(stream=True)
    original = flow.request.content
    run_exchange(addon, flow, [b"data: [DONE]\n\n"], content_type="text/event-stream")
    assert flow.request.content == original
    addon.done()
    assert read_records(tmp_path / "captures")[0]["injected"] == {}


def test_non_json_body_and_unknown_path_pass_untouched(addon, tctx, tmp_path):
    flow = make_chat_flow(raw=b"\xff\x00not json", path="/v1/whatever")
    run_exchange(addon, flow, [b"plain text"], content_type="text/plain")
    assert flow.request.content == b"\xff\x00not json"
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert rec["api"] == "other" and rec["request"] is None and "base64" in rec["request_raw"]
    assert rec["response_body"] == "plain text" and rec["response_b64"] is None


def test_bad_json_on_chat_path_is_forwarded_as_is(addon, tctx, tmp_path):
    flow = make_chat_flow(raw=b'{"messages": [')
    run_exchange(addon, flow, [b"{}"])
    assert flow.request.content == b'{"messages": ['
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert rec["request_raw"] == {"text": '{"messages": ['} and rec["injected"] == {}


def test_client_disconnect_keeps_incomplete_record(addon, tctx, tmp_path):
    flow = make_chat_flow(stream=True)
    addon.request(flow)
    set_response(flow, content_type="text/event-stream")
    addon.responseheaders(flow)
    flow.response.stream(b'data: {"choices":[]}\n\n')
    flow.error = tflow.terr("Client disconnected.")
    addon.error(flow)
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert rec["complete"] is False and rec["error"]["kind"] == "client"
    assert rec["response_body"] == 'data: {"choices":[]}\n\n'


def test_upstream_refused_is_recorded(addon, tctx, tmp_path):
    flow = make_chat_flow()
    addon.request(flow)
    flow.error = tflow.terr("Connection refused")
    addon.error(flow)
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert rec["status"] is None and rec["error"] == {"kind": "upstream", "message": "Connection refused"}


def test_gzip_response_is_decoded_in_the_record(addon, tctx, tmp_path):
    import gzip

    flow = make_chat_flow()
    body = gzip.compress(b'{"ok": true}')
    run_exchange(addon, flow, [body], headers=((b"content-encoding", b"gzip"),))
    assert flow.request.headers["accept-encoding"] == "identity"
    addon.done()
    assert read_records(tmp_path / "captures")[0]["response_body"] == '{"ok": true}'


def test_upstream_key_replaces_client_credential(addon, tctx):
    tctx.configure(addon, polar_upstream_key="upstream-secret")
    flow = make_chat_flow(headers=((b"x-api-key", b"sk-ant-client-secret"),), path="/v1/messages")
    addon.request(flow)
    assert flow.request.headers["x-api-key"] == "upstream-secret"
    flow = make_chat_flow(path="/v1beta/models/m:generateContent?key=AIzaClient")
    addon.request(flow)
    assert flow.request.query["key"] == "upstream-secret"


def test_provider_secret_never_reaches_disk(addon, tctx, tmp_path):
    secret = "sk-proj-THISISSECRET"
    for headers, path in [
        (((b"authorization", f"Bearer {secret}".encode()),), "/v1/chat/completions"),
        (((b"x-api-key", secret.encode()), (b"cookie", secret.encode())), "/v1/messages"),
        ((), f"/v1beta/models/m:generateContent?key={secret}"),
    ]:
        run_exchange(addon, make_chat_flow(headers=headers, path=path), [b"{}"])
    addon.done()
    for f in (tmp_path / "captures").iterdir():
        assert secret.encode() not in f.read_bytes()
    assert secret.encode() not in v1_bytes(tmp_path / "captures")  # nor in a body a v2 record compresses
    assert len(read_records(tmp_path / "captures")) == 3


def test_failed_writer_refuses_model_calls(addon, tctx, tmp_path):
    addon.writer.failure = "OSError: disk full"
    flow = make_chat_flow()
    addon.request(flow)
    assert flow.response.status_code == 503
    assert "not recording" in json.loads(flow.response.content)["error"]["message"]


def test_files_are_private_and_rotate(addon, tctx, tmp_path):
    tctx.configure(addon, polar_rotate_mb=1)
    for _ in range(4):  # text that does not compress, in one session: v2 records refer to the previous one
        big = {"messages": [{"role": "user", "content": secrets.token_urlsafe(600_000)}]}
        run_exchange(addon, make_chat_flow(body=big, headers=((b"x-polar-session", b"s"),)), [b"{}"])
    addon.done()
    files = sorted((tmp_path / "captures").glob("*.jsonl"))
    assert len(files) >= 2
    for f in files:  # a file's first record of a session is full: no reference crosses a rotation
        assert json.loads(f.read_bytes().split(b"\n")[0])["base"] is None
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    assert (tmp_path / "captures").stat().st_mode & 0o777 == 0o700
    assert len(read_records(tmp_path / "captures")) == 4


def test_issue37_two_proxies_with_one_pid_started_in_one_second_name_their_files_apart(
    addon, tctx, tmp_path, monkeypatch
):
    # Two nodes' proxies, each pid 1 in its own container, started in the same second: their folders are then
    # read, or copied, together. Each configure makes a new writer, as a proxy starting.
    monkeypatch.setattr(os, "getpid", lambda: 1)
    monkeypatch.setattr(time, "gmtime", lambda *_: time.struct_time((2026, 12, 3, 12, 0, 0, 3, 337, 0)))
    for node in ("nodeA", "nodeB"):
        tctx.configure(addon, polar_dir=str(tmp_path / node))  # closes the previous writer, files flushed
        run_exchange(addon, make_chat_flow(), [b"{}"])
    addon.done()
    (a,), (b,) = (sorted((tmp_path / node).glob("*.jsonl")) for node in ("nodeA", "nodeB"))
    assert a.name != b.name  # was capture-20261203T120000Z-1.jsonl twice
    for f in (a, b):
        assert re.fullmatch(r"capture-20261203T120000Z-1-[0-9a-f]{8}\.jsonl", f.name)
        assert len(read_records(f.parent)) == 1


def test_bad_options_are_refused(addon, tctx):
    from mitmproxy.exceptions import OptionsError

    with pytest.raises(OptionsError, match="polar_upstream must be one of"):
        tctx.configure(addon, polar_upstream="tgi")
    with pytest.raises(OptionsError, match="polar_rotate_mb"):
        tctx.configure(addon, polar_rotate_mb=0)
    with pytest.raises(OptionsError, match="polar_format must be 1 or 2"):
        tctx.configure(addon, polar_format=3)
    with pytest.raises(OptionsError, match="polar_max_decoded_mb must be at least 1"):
        tctx.configure(addon, polar_max_decoded_mb=0)


def test_hook_error_is_contained(addon, tctx, tmp_path, caplog, monkeypatch):
    flow = make_chat_flow(headers=((b"authorization", b"Bearer sk-secret"),))
    monkeypatch.setattr(polar.chat, "token_fields", lambda *a: 1 / 0)
    addon.request(flow)  # must not raise
    assert "request failed" in caplog.text
    assert "authorization" not in flow.request.headers  # the credential is gone all the same
    set_response(flow)
    addon.responseheaders(flow)
    flow.response.raw_content = b"{}"
    addon.response(flow)
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert rec["error"]["kind"] == "addon" and rec["complete"] is False


def test_record_is_written_before_shutdown(addon, tctx, tmp_path):
    run_exchange(addon, make_chat_flow(), [b"{}"])
    deadline = time.time() + 5
    while time.time() < deadline and not read_records(tmp_path / "captures"):
        time.sleep(0.005)
    assert len(read_records(tmp_path / "captures")) == 1  # before done() closes the writer


def test_non_loopback_listen_warns(addon, tctx, caplog):
    tctx.configure(addon, listen_host="0.0.0.0")
    addon.running()
    assert "beyond loopback" in caplog.text


def test_client_hanging_up_after_the_final_event_is_complete(addon, tctx, tmp_path):
    flow = make_chat_flow(stream=True)
    addon.request(flow)
    set_response(flow, content_type="text/event-stream")
    addon.responseheaders(flow)
    flow.response.stream(b'data: {"choices":[]}\n\ndata: [DONE]\n\n')
    flow.error = tflow.terr("Client disconnected.")  # before the upstream's end-of-body arrived
    addon.error(flow)
    addon.done()
    (rec,) = read_records(tmp_path / "captures")
    assert rec["complete"] is True and rec["error"] is None
