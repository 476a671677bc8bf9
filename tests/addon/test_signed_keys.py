"""Issue 34, hook level: with ``polar_secret_file`` set, only a signed key names a session; any other call is
answered 403 here, counted, logged by the session it claimed, never forwarded, never recorded. The same against
a real mitmdump and upstream: test_signed_keys_proxy.py."""

import json
import logging

import pytest
from mitmproxy import exceptions
from mitmproxy.test import tflow, tutils

from addon import session
from addon.session import signed_key
from eval.sessions.procs import new_secret_file
from tests.captures import v1_bytes, v1_lines

CHAT = "/v1/chat/completions"
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ANTHROPIC_BODY = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
GOOGLE = "/v1beta/models/m:generateContent"
GOOGLE_BODY = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


def make_flow(path=CHAT, body=CHAT_BODY, headers=(), method=b"POST"):
    headers = tuple((k.encode(), v.encode()) for k, v in headers)
    req = tutils.treq(
        method=method,
        path=path.encode(),
        content=json.dumps(body).encode(),
        headers=((b"content-type", b"application/json"), *headers),
    )
    return tflow.tflow(req=req)


def play(addon, flow, answer=b'{"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}'):
    """The request hook, then, if the addon did not answer it, an upstream answer through the other hooks."""
    addon.request(flow)
    if flow.response is None:  # forwarded: the upstream answers
        flow.response = tutils.tresp(content=b"", headers=((b"content-type", b"application/json"),))
        flow.response.raw_content = answer
        forwarded = True
    else:
        forwarded = False
    addon.responseheaders(flow)
    addon.response(flow)
    return forwarded


def records(tmp_path):
    return [json.loads(line) for line in v1_lines(tmp_path / "captures")]


@pytest.fixture
def secret_file(tmp_path):
    return new_secret_file(tmp_path / "secret")


@pytest.fixture
def secret(secret_file):
    return session.read_secret(secret_file)


@pytest.fixture
def signed(addon, tctx, secret_file):
    tctx.configure(addon, polar_secret_file=str(secret_file))
    return addon


def test_issue34_new_secret_file_is_0600_random_hex_and_never_replaced(tmp_path):
    path = new_secret_file(tmp_path / "s")
    text = path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600 and len(text.strip()) == 64 and bytes.fromhex(text.strip())
    assert new_secret_file(tmp_path / "t").read_text() != text
    with pytest.raises(FileExistsError):
        new_secret_file(path)
    assert path.read_text() == text


def test_issue34_health_says_keys_are_off_by_default(addon, tctx):
    health = addon.health()
    assert health["signed_keys"] is False and health["refused_keys"] == 0
    assert health["options"]["polar_secret_file"] == ""


@pytest.mark.parametrize(
    ("headers", "path", "source"),
    [
        ((("authorization", "Bearer {key}"),), CHAT, "api_key"),
        ((("x-polar-session", "{key}"),), CHAT, "header"),
        ((), "/s/{key}" + CHAT, "path"),
        ((), CHAT + "?key={key}", "api_key"),
    ],
)
def test_issue34_a_signed_key_is_recorded_under_its_session_id_only(signed, secret, tmp_path, headers, path, source):
    key = signed_key("run-1.a", secret)
    flow = make_flow(path.format(key=key), headers=[(k, v.format(key=key)) for k, v in headers])
    assert play(signed, flow)
    assert flow.request.headers["x-polar-session"] == "run-1.a" and flow.request.path == CHAT
    assert "authorization" not in flow.request.headers
    signed.done()
    (rec,) = records(tmp_path)
    assert (rec["session_id"], rec["session_source"], rec["path"]) == ("run-1.a", source, CHAT)
    tag = key.partition("~")[2]
    assert tag.encode() not in v1_bytes(tmp_path / "captures")
    for file in (tmp_path / "captures").rglob("*"):
        assert tag.encode() not in file.read_bytes()
    assert signed.refused_keys == 0 and signed.health()["signed_keys"] is True


def bad_keys(secret):
    other = signed_key("run-2", secret)
    return {
        "forged tag": "run-1~" + "0" * 32,
        "unsigned id": "run-1",
        "another session's tag": "run-1~" + other.partition("~")[2],
        "another session's id without its tag": "run-2",
        "signed with another secret": signed_key("run-1", b"not the secret"),
        "provider key": "sk-proj-REALKEY123",
    }


@pytest.mark.parametrize(
    ("api", "path", "body", "header", "shape"),
    [
        ("chat", CHAT, CHAT_BODY, "authorization", lambda b: b["error"]["type"] == "permission_error"),
        ("anthropic", "/v1/messages", ANTHROPIC_BODY, "x-api-key", lambda b: b["error"]["type"] == "permission_error"),
        ("google", GOOGLE, GOOGLE_BODY, "x-goog-api-key", lambda b: b["error"]["status"] == "PERMISSION_DENIED"),
        ("responses", "/v1/responses", {"model": "m", "input": "hi"}, "authorization", lambda b: "error" in b),
    ],
)
def test_issue34_any_other_key_is_refused_403_in_the_api_shape_counted_logged_and_not_recorded(
    signed, secret, tmp_path, caplog, api, path, body, header, shape
):
    keys = bad_keys(secret)
    flows = []
    with caplog.at_level(logging.WARNING, logger="addon.polar"):
        for key in keys.values():
            value = f"Bearer {key}" if header == "authorization" else key
            flows.append(make_flow(path, body, headers=[(header, value)]))
        flows.append(make_flow(path, body))  # no key at all
        for flow in flows:
            assert not play(signed, flow), "a refused call must not be forwarded"
    for flow in flows:
        answer = json.loads(flow.response.content)
        assert flow.response.status_code == 403 and shape(answer), answer
        assert "signed session keys" in json.dumps(answer)
    assert signed.refused_keys == len(flows) and signed.health()["refused_keys"] == len(flows)
    signed.done()
    assert records(tmp_path) == [] and not (tmp_path / "captures").exists()
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(logged) == len(flows)
    assert any("claiming session run-1:" in m for m in logged) and any("claiming session run-2:" in m for m in logged)
    assert any("claiming session (none): no key" in m for m in logged)
    for key in keys.values():  # never the key itself, nor its tag
        secret_part = key.partition("~")[2] or (key if key.startswith("sk-") else None)
        assert secret_part is None or all(secret_part not in m for m in logged)


def test_issue34_path_and_header_claims_are_checked_too(signed, secret, tmp_path):
    other = signed_key("run-2", secret)
    for flow in (
        make_flow("/s/run-2" + CHAT),
        make_flow(CHAT, headers=[("x-polar-session", "run-2")]),
        make_flow(CHAT + "?api_key=run-2"),
        # a good key behind a bad claim that takes precedence does not rescue it
        make_flow("/s/run-3" + CHAT, headers=[("authorization", f"Bearer {other}")]),
    ):
        assert not play(signed, flow) and flow.response.status_code == 403
        assert "run-2" not in flow.request.path  # the flow itself keeps no key either
    signed.done()
    assert records(tmp_path) == [] and signed.refused_keys == 4


def test_issue34_health_needs_no_key(signed):
    flow = make_flow("/polar/health", method=b"GET")
    signed.request(flow)
    answer = json.loads(flow.response.content)
    assert flow.response.status_code == 200 and answer["signed_keys"] is True and answer["refused_keys"] == 0
    assert answer["options"]["polar_secret_file"].endswith("secret")


def test_issue34_an_unreadable_or_empty_secret_file_is_an_error_naming_it(addon, tctx, tmp_path):
    with pytest.raises(exceptions.OptionsError, match=r"polar_secret_file '.*missing' cannot be read"):
        tctx.configure(addon, polar_secret_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(exceptions.OptionsError, match=r"polar_secret_file '.*empty' cannot be read.*empty"):
        tctx.configure(addon, polar_secret_file=str(tmp_path / "empty"))


def test_issue34_a_secret_that_could_not_be_read_refuses_every_call(addon, tctx, tmp_path, secret):
    with pytest.raises(exceptions.OptionsError):
        addon._load_secret(str(tmp_path / "missing"))  # as at start-up, before mitmdump exits
    flow = make_flow(headers=[("authorization", f"Bearer {signed_key('run-1', secret)}")])
    assert not play(addon, flow) and flow.response.status_code == 403
    assert "cannot be read" in flow.response.text and addon.health()["signed_keys"] is True
    addon.done()
    assert records(tmp_path) == []


def test_issue34_a_request_hook_that_fails_with_keys_checked_records_and_forwards_nothing(
    signed, tmp_path, monkeypatch
):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(session, "resolve", broken)
    for flow in (make_flow(), make_flow("/v1/whatever", headers=[("authorization", "Bearer run-1")])):
        signed.request(flow)
        assert flow.response is not None and flow.response.status_code == 500  # answered, not forwarded
    signed.done()
    assert records(tmp_path) == []


def test_issue34_turning_the_option_off_again_restores_todays_behaviour(signed, tctx, tmp_path):
    tctx.configure(signed, polar_secret_file="")
    flow = make_flow(headers=[("authorization", "Bearer run-1")])
    assert play(signed, flow)
    signed.done()
    (rec,) = records(tmp_path)
    assert (rec["session_id"], rec["session_source"]) == ("run-1", "api_key")
    assert signed.health()["signed_keys"] is False
