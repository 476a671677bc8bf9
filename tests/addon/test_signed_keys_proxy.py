"""Issue 34 against a real mitmdump with the addon in front of a real upstream that counts what reaches it: a signed
key is recorded under its session id; a forged tag, an unsigned id, another session's id without its tag, a
provider key and no key are each refused 403 by the proxy, counted in its health, recorded nowhere, and never reach
the upstream; with ``polar_secret_file`` unset everything is as before. Hook-level cases: test_signed_keys.py."""

import json
import threading
import time
from typing import ClassVar

import pytest

from addon.session import read_secret, signed_key
from eval.sessions.procs import Mitmdump, ProxyNotRecording, check_proxy, new_secret_file
from tests import http
from tests.bench.upstream import _Handler, _Server
from tests.captures import v1_lines

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ANTHROPIC_BODY = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
GOOGLE = "/v1beta/models/m:generateContent"
GOOGLE_BODY = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


class Counting(_Handler):
    """The benchmark's fake vLLM, keeping each request's path and headers."""

    seen: ClassVar[list[tuple[str, dict[str, str]]]] = []

    def do_POST(self):
        self.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        super().do_POST()


@pytest.fixture
def upstream():
    Counting.seen = []
    server = _Server(("127.0.0.1", 0), Counting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", Counting.seen
    server.shutdown()
    server.server_close()


def records(captures, expect=None, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = [json.loads(line) for line in v1_lines(captures)] if captures.exists() else []
        if expect is None or len(got) >= expect or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def all_bytes(folder):
    return b"".join(path.read_bytes() for path in folder.rglob("*") if path.is_file()) if folder.exists() else b""


def test_issue34_signed_keys_through_a_real_proxy(upstream, tmp_path):
    url, seen = upstream
    secret_file = new_secret_file(tmp_path / "secret")
    secret = read_secret(secret_file)
    mine, other = signed_key("run-1", secret), signed_key("run-2", secret)
    captures = tmp_path / "captures"
    with Mitmdump(url, captures, log=tmp_path / "mitmdump.log", secret_file=secret_file) as mitm:
        # The health endpoint needs no key, and says keys are required.
        assert mitm.health["signed_keys"] is True and mitm.health["refused_keys"] == 0

        # Accepted, wherever the key is given.
        accepted = [
            (CHAT, CHAT_BODY, {"authorization": f"Bearer {mine}"}, "api_key"),
            ("/v1/messages", ANTHROPIC_BODY, {"x-api-key": mine, "anthropic-version": "2023-06-01"}, "api_key"),
            (GOOGLE, GOOGLE_BODY, {"x-goog-api-key": mine}, "api_key"),
            (f"{GOOGLE}?key={mine}", GOOGLE_BODY, {}, "api_key"),
            (CHAT, CHAT_BODY, {"x-polar-session": mine}, "header"),
            (f"/s/{mine}{CHAT}", CHAT_BODY, {}, "path"),
            (CHAT, CHAT_BODY, {"authorization": f"Bearer {other}"}, "api_key"),
        ]
        for path, body, headers, _ in accepted:
            r = http.post(f"{mitm.url}{path}", json=body, headers=headers)
            assert r.status_code == 200, (path, r.text)
        got = records(captures, expect=len(accepted))
        assert [(r["session_id"], r["session_source"]) for r in got] == [("run-1", s) for *_, s in accepted[:-1]] + [
            ("run-2", "api_key")
        ]
        assert len(seen) == len(accepted)
        assert [h["x-polar-session"] for _, h in seen] == ["run-1"] * 6 + ["run-2"]
        for path, headers in seen:  # the upstream sees the id only: no key, no tag
            assert "~" not in path and all(mine.partition("~")[2] not in v for v in headers.values())

        # Refused: each answered 403 by the proxy in its API's shape, never forwarded.
        refused = [
            ("forged tag", CHAT, CHAT_BODY, {"authorization": "Bearer run-1~" + "0" * 32}),
            ("unsigned id", CHAT, CHAT_BODY, {"authorization": "Bearer run-1"}),
            ("another session's id, no tag", CHAT, CHAT_BODY, {"authorization": "Bearer run-2"}),
            ("another session's tag", CHAT, CHAT_BODY, {"authorization": "Bearer run-1~" + other.partition("~")[2]}),
            ("no key", CHAT, CHAT_BODY, {}),
            ("provider key", CHAT, CHAT_BODY, {"authorization": "Bearer sk-proj-REALKEY123"}),
            ("unsigned header", CHAT, CHAT_BODY, {"x-polar-session": "run-2"}),
            ("unsigned path", f"/s/run-2{CHAT}", CHAT_BODY, {}),
            ("anthropic, unsigned", "/v1/messages", ANTHROPIC_BODY, {"x-api-key": "run-1"}),
            ("google, forged ?key=", f"{GOOGLE}?key=run-1~{'a' * 32}", GOOGLE_BODY, {}),
            ("google, no key", GOOGLE, GOOGLE_BODY, {}),
        ]
        for what, path, body, headers in refused:
            r = http.post(f"{mitm.url}{path}", json=body, headers=headers)
            assert r.status_code == 403, (what, r.status_code, r.text)
            answer = r.json()
            if path.startswith("/v1/messages"):
                assert answer["type"] == "error" and answer["error"]["type"] == "permission_error", what
            elif path.startswith(GOOGLE):
                assert answer["error"]["status"] == "PERMISSION_DENIED", what
            else:
                assert answer["error"]["type"] == "permission_error" and answer["error"]["code"] == 403, what
        health = check_proxy(mitm.url)  # still answered without a key
        assert health["refused_keys"] == len(refused) and health["signed_keys"] is True
        assert health["records_written"] == len(accepted) and health["refused"] == 0
        assert len(seen) == len(accepted), "a refused call reached the upstream"
    assert len(records(captures)) == len(accepted)  # nothing refused was recorded, in any session
    stored = all_bytes(captures)
    for tag in (mine.partition("~")[2], other.partition("~")[2]):
        assert tag.encode() not in stored
    assert b"REALKEY" not in stored
    log = (tmp_path / "mitmdump.log").read_text()
    assert log.count("polar: refused") == len(refused)
    assert "claiming session run-1:" in log and "claiming session run-2:" in log and "(none): no key" in log
    assert other.partition("~")[2] not in log and "0" * 32 not in log and "REALKEY" not in log


def test_issue34_without_the_option_every_key_is_taken_as_before(upstream, tmp_path):
    url, seen = upstream
    secret = read_secret(new_secret_file(tmp_path / "secret"))
    captures = tmp_path / "captures"
    with Mitmdump(url, captures, log=tmp_path / "mitmdump.log") as mitm:
        assert mitm.health["signed_keys"] is False and mitm.health["options"]["polar_secret_file"] == ""
        for headers in ({"authorization": "Bearer run-1"}, {}, {"authorization": f"Bearer {signed_key('r', secret)}"}):
            assert http.post(f"{mitm.url}{CHAT}", json=CHAT_BODY, headers=headers).status_code == 200
        got = records(captures, expect=3)
        assert check_proxy(mitm.url)["refused_keys"] == 0
    assert [r["session_source"] for r in got] == ["api_key", "anonymous", "key_hash"]
    assert got[0]["session_id"] == "run-1" and len(seen) == 3


def test_issue34_an_unreadable_secret_file_stops_the_proxy_naming_the_file(upstream, tmp_path):
    url, _ = upstream
    missing = tmp_path / "no-such-secret"
    with pytest.raises(ProxyNotRecording, match="no-such-secret"):
        Mitmdump(url, tmp_path / "captures", log=tmp_path / "mitmdump.log", secret_file=missing, startup_timeout=60)
    assert f"polar_secret_file '{missing}' cannot be read" in (tmp_path / "mitmdump.log").read_text()
