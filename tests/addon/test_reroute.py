"""Transparent mode's routing (addon/reroute.py) together with the capture addon, hooks called directly."""

import asyncio
import base64
import json

import pytest
from mitmproxy import exceptions
from mitmproxy.proxy import context
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.test import taddons, tflow, tutils
from mitmproxy.tls import ClientHello, ClientHelloData

from addon import polar, reroute
from tests.captures import v1_bytes, v1_lines

UPSTREAM = "http://127.0.0.1:8000"
SECRETS = ("sk-live-0123456789abcdef", "AIzaSyD-secret-google-key", "sk-ant-api03-secret")


def make_flow(host, path, *, method="POST", body=None, headers=(), port=443, scheme="https", mode="regular"):
    content = b"" if body is None else json.dumps(body).encode()
    req = tutils.treq(
        scheme=scheme.encode(),
        host=host,
        port=port,
        method=method.encode(),
        path=path.encode(),
        content=content,
        headers=((b"host", host.encode()), (b"content-type", b"application/json"), *headers),
    )
    flow = tflow.tflow(req=req)
    flow.client_conn.proxy_mode = ProxyMode.parse(mode)
    return flow


def anthropic_flow(**kw):
    body = {"model": "claude", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    return make_flow("api.anthropic.com", "/v1/messages", body=body, **kw)


def basic(user):
    return b"Basic " + base64.b64encode(f"{user}:".encode())


def read_records(directory):
    return [json.loads(line) for line in v1_lines(directory)]


@pytest.fixture
def addons():
    return reroute.Reroute(), polar.Polar()


@pytest.fixture
def tctx(addons, tmp_path):
    loop = asyncio.new_event_loop()  # owned here so it is closed: taddons would leak its own

    async def enter():
        return taddons.context(*addons)

    try:
        with loop.run_until_complete(enter()) as tctx:
            tctx.configure(addons[1], polar_dir=str(tmp_path / "captures"), polar_reroute=UPSTREAM)
            yield tctx
            addons[1].done()
    finally:
        loop.close()


def request(addons, flow):
    for addon in addons:
        addon.request(flow)


def finish(addons, flow, content=b'{"choices": []}'):
    flow.response = tutils.tresp(content=b"", headers=((b"content-type", b"application/json"),))
    addons[1].responseheaders(flow)
    flow.response.raw_content = content
    addons[1].response(flow)
    addons[1].done()


def test_reroute_option_parses_hosts_and_defaults():
    routes = reroute.parse_reroute(f"{UPSTREAM}, api.x.ai=https://gpu.example:9000, 127.0.0.1:9=http://h")
    assert {routes[h] for h in reroute.PROVIDER_HOSTS} == {reroute.Upstream("http", "127.0.0.1", 8000)}
    assert routes["api.x.ai"] == reroute.Upstream("https", "gpu.example", 9000)
    assert routes["127.0.0.1:9"] == reroute.Upstream("http", "h", 80)
    for bad in ("ftp://h", "http://h/v1", "api.x.ai=h:80", "http://h:port"):
        with pytest.raises(exceptions.OptionsError):
            reroute.parse_reroute(bad)


def test_host_both_rerouted_and_captured_is_refused(addons, tctx):
    with pytest.raises(exceptions.OptionsError, match=r"api\.openai\.com"):
        tctx.configure(addons[0], polar_capture="api.openai.com")


def test_model_call_goes_to_the_upstream_translated_and_recorded(addons, tctx, tmp_path):
    flow = anthropic_flow(headers=((b"x-api-key", b"s1"), (b"anthropic-version", b"2023-06-01")))
    request(addons, flow)
    assert flow.metadata[reroute.ROUTE_KEY] == reroute.REROUTE
    assert flow.request.url == f"{UPSTREAM}/v1/chat/completions"
    assert flow.request.headers["host"] == "127.0.0.1:8000"
    assert "x-api-key" not in flow.request.headers and flow.request.headers["x-polar-session"] == "s1"
    assert json.loads(flow.request.content)["return_token_ids"] is True
    finish(addons, flow, b'{"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}')
    [record] = read_records(tmp_path / "captures")
    assert (record["session_id"], record["api"], record["path"]) == ("s1", "anthropic", "/v1/messages")


def test_other_paths_on_a_rerouted_host_are_answered_here_unrecorded(addons, tctx, tmp_path):
    limits = make_flow("api.anthropic.com", "/api/claude_code/policy_limits", method="GET")
    probe = make_flow("api.anthropic.com", "/", method="HEAD")
    upgrade = make_flow("api.openai.com", "/v1/responses", method="GET", headers=((b"upgrade", b"websocket"),))
    for flow in (limits, probe, upgrade):
        request(addons, flow)
        addons[1].responseheaders(flow)  # the local answer, as mitmproxy plays it
        addons[1].response(flow)
    addons[1].done()
    assert (limits.response.status_code, limits.response.content) == (200, b"{}")
    assert (probe.response.status_code, probe.response.content) == (200, b"")
    assert upgrade.response.status_code == 426  # Codex then falls back to HTTPS POSTs
    assert read_records(tmp_path / "captures") == []


def test_unnamed_host_passes_untouched_and_unrecorded(addons, tctx, tmp_path):
    flow = make_flow(
        "telemetry.example.com",
        "/v1/chat/completions",
        body={"model": "m", "messages": []},
        headers=((b"authorization", b"Bearer sk-live-0123456789abcdef"),),
    )
    request(addons, flow)
    finish(addons, flow)
    assert flow.metadata[reroute.ROUTE_KEY] == reroute.PASS
    assert flow.request.url == "https://telemetry.example.com/v1/chat/completions"
    assert flow.request.headers["authorization"] == "Bearer sk-live-0123456789abcdef"
    assert json.loads(flow.request.content) == {"model": "m", "messages": []}
    assert read_records(tmp_path / "captures") == []


def test_tls_of_unnamed_hosts_is_not_opened(addons, tctx):
    def hello(address, mode="regular"):
        ctx = context.Context(tflow.tclient_conn(), tctx.options)
        ctx.client.proxy_mode = ProxyMode.parse(mode)
        ctx.server.address = address
        data = ClientHelloData(ctx, ClientHello(bytes.fromhex("0303" + "00" * 32 + "00" + "0002002f" + "0100")))
        addons[0].tls_clienthello(data)
        return data.ignore_connection

    assert hello(("statsig.anthropic.com", 443))
    assert not hello(("api.anthropic.com", 443))
    assert not hello(("statsig.anthropic.com", 443), mode=f"reverse:{UPSTREAM}")


def test_reverse_mode_flows_are_not_routed(addons, tctx, tmp_path):
    flow = make_flow("127.0.0.1", "/v1/models", method="GET", port=8000, scheme="http", mode=f"reverse:{UPSTREAM}")
    request(addons, flow)
    finish(addons, flow)
    assert reroute.ROUTE_KEY not in flow.metadata and flow.response.content == b'{"choices": []}'
    assert [r["api"] for r in read_records(tmp_path / "captures")] == ["other"]


def test_proxy_user_names_the_session_and_stays_here(addons, tctx):
    connect = make_flow("api.anthropic.com", "", method="CONNECT", headers=((b"proxy-authorization", basic("run-7")),))
    addons[0].http_connect(connect)
    flow = anthropic_flow(headers=((b"x-api-key", b"sk-ant-api03-secret"),))
    flow.client_conn = connect.client_conn  # the same client connection, inside the tunnel
    request(addons, flow)
    assert flow.request.headers["x-polar-session"] == "run-7"
    plain = anthropic_flow(scheme="http", headers=((b"proxy-authorization", basic("run-8")),))
    request(addons, plain)
    assert plain.request.headers["x-polar-session"] == "run-8" and "proxy-authorization" not in plain.request.headers
    assert reroute.proxy_user("Bearer x") is None and reroute.proxy_user("Basic !!") is None


def test_upstream_mode_reaches_our_upstream_directly(addons, tctx):
    flow = anthropic_flow(mode="upstream:http://corp-proxy:3128")
    flow.server_conn.via = ("http", ("corp-proxy", 3128))
    request(addons, flow)
    assert flow.server_conn.via is None and flow.server_conn.address == ("127.0.0.1", 8000)


def test_capture_only_forwards_the_key_and_records_no_secret(addons, tctx, tmp_path):
    tctx.configure(addons[0], polar_reroute="", polar_capture="api.openai.com, generativelanguage.googleapis.com")
    chat = make_flow(
        "api.openai.com",
        "/v1/chat/completions",
        body={"model": "gpt", "messages": [], "stream": False},
        headers=((b"authorization", f"Bearer {SECRETS[0]}".encode()), (b"cookie", b"c=1")),
    )
    google = make_flow(
        "generativelanguage.googleapis.com",
        f"/v1beta/models/g:generateContent?key={SECRETS[1]}",
        body={"contents": []},
        headers=((b"x-goog-api-key", SECRETS[1].encode()),),
    )
    for flow in (chat, google):
        request(addons, flow)
        assert flow.metadata[reroute.ROUTE_KEY] == reroute.CAPTURE
        assert "x-polar-session" not in flow.request.headers
    assert chat.request.headers["authorization"] == f"Bearer {SECRETS[0]}"
    assert json.loads(chat.request.content) == {"model": "gpt", "messages": [], "stream": False}  # no token fields
    assert (
        google.request.url.startswith("https://generativelanguage.googleapis.com/")
        and SECRETS[1] in google.request.path
    )
    assert google.request.headers["x-goog-api-key"] == SECRETS[1]
    for flow in (chat, google):
        flow.response = tutils.tresp(
            content=b"", headers=((b"content-type", b"application/json"), (b"set-cookie", b"s=2"))
        )
        addons[1].responseheaders(flow)
        flow.response.raw_content = b"{}"
        addons[1].response(flow)
    addons[1].done()
    data = v1_bytes(tmp_path / "captures")
    assert not any(secret.encode() in data for secret in SECRETS) and b"c=1" not in data and b"s=2" not in data
    records = read_records(tmp_path / "captures")
    assert [(r["api"], r["upstream"], r["injected"], r["session_source"]) for r in records] == [
        ("chat", "plain", {}, "key_hash"),
        ("google", "plain", {}, "key_hash"),
    ]
    assert records[1]["path"] == "/v1beta/models/g:generateContent"


def test_regular_mode_without_hosts_warns(addons, tctx, caplog):
    tctx.configure(addons[0], polar_reroute="", mode=["regular@127.0.0.1:8080"])
    addons[0].running()
    assert "without polar_reroute or polar_capture" in caplog.text


def test_issue34_with_signed_keys_the_proxy_user_is_a_signed_key_checked_like_any_other(addons, tctx, tmp_path):
    from addon.session import read_secret, signed_key
    from eval.sessions.procs import new_secret_file

    secret_file = new_secret_file(tmp_path / "secret")
    key = signed_key("run-7", read_secret(secret_file))
    off = anthropic_flow(scheme="http", headers=((b"proxy-authorization", basic(key)),))
    request(addons, off)  # keys unchecked: a signed key is no session id, as before the option existed
    assert off.request.headers["x-polar-session"] == "anonymous"
    tctx.configure(addons[1], polar_secret_file=str(secret_file))
    good = anthropic_flow(
        scheme="http", headers=((b"proxy-authorization", basic(key)), (b"x-api-key", SECRETS[2].encode()))
    )
    forged = anthropic_flow(scheme="http", headers=((b"proxy-authorization", basic("run-7")),))
    for flow in (good, forged):
        request(addons, flow)
    assert good.response is None and good.request.headers["x-polar-session"] == "run-7"
    assert forged.response.status_code == 403 and json.loads(forged.response.content)["type"] == "error"
    finish(addons, good, b'{"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}')
    [record] = read_records(tmp_path / "captures")
    assert (record["session_id"], record["session_source"]) == ("run-7", "header")
    assert addons[1].refused_keys == 1
