"""Faults against a real mitmdump (issue 16): an addon that did not load, a disk that fills under 8 clients
and a shutdown while it is full, pathological JSON and secrets over the wire, request bodies over
``polar_max_body_mb``. Hook-level cases: test_faults.py.

The full disk is the file-size limit (``RLIMIT_FSIZE``) of the running mitmdump, set with ``prlimit`` to
the capture file's size: writes past it fail with EFBIG (a short write first) exactly as ENOSPC would, and
raising it again is space returning, without root or a filesystem of our own.
"""

import json
import re
import resource
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import psutil
import pytest

from addon.health import NONCE_HEADER
from addon.session import read_secret, signed_key
from eval.service import app as rollout_service
from eval.sessions import rollout
from eval.sessions.procs import Mitmdump, ProxyNotRecording, Service, check_proxy, free_port, new_secret_file
from tests import http
from tests.bench.reliability import read_records
from tests.bench.upstream import _Handler as _BenchHandler
from tests.bench.upstream import _Server as _BenchServer
from tests.bench.upstream import make_server

pytestmark = pytest.mark.slow

DEADLINE_S = 120.0  # generous: the machine may be busy; the tests poll, they never assert a duration


def wait_for(condition, what, timeout=DEADLINE_S):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


@pytest.fixture(scope="module")
def upstream():
    server = make_server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def call(url, session, *, content=b"x" * 200, path="/v1/chat/completions"):
    body = {"model": "m", "messages": [{"role": "user", "content": content.decode()}]}
    return httpx.post(f"{url}{path}", json=body, headers={"authorization": f"Bearer {session}"}, timeout=60)


# ---- item 2: an addon that did not load ----------------------------------------------------------------


def test_a_proxy_whose_addon_did_not_load_is_refused_by_every_client(upstream, tmp_path):
    # mitmproxy refuses the script over the repeated option ("Received multiple values") and forwards anyway.
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "mitmdump"), "--mode", f"reverse:{upstream}",
           "--listen-host", "127.0.0.1", "-p", str(port), "-s", "addon/polar.py",
           "--set", f"polar_dir={tmp_path / 'a'}", "--set", f"polar_dir={tmp_path / 'b'}"]  # fmt: skip
    with Service(cmd, port=port, log=tmp_path / "mitmdump.log") as proxy:
        time.sleep(2.0)  # mitmproxy reports the script error just after it starts listening
        assert call(proxy.url, "sess-unrecorded").status_code == 200  # the hazard: forwarded, recorded nowhere
        assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
        with pytest.raises(ProxyNotRecording, match="not loaded") as raised:
            check_proxy(proxy.url)
        assert raised.value.answered
        args = rollout.Args(
            tasks="toy", harness="shell", command="true {instruction}", proxy=proxy.url, out=tmp_path / "run"
        )
        with pytest.raises(ProxyNotRecording, match="GET /polar/health"):
            rollout.main(args)
        assert not (tmp_path / "run" / "sessions.parquet").exists()
        service_args = rollout_service.Args(proxy=proxy.url, captures=tmp_path / "a", root=tmp_path / "service")
        assert rollout_service.main(service_args) == 2
    with pytest.raises(ProxyNotRecording, match="does not answer"):
        check_proxy(f"http://127.0.0.1:{free_port()}", timeout=2)


class _HealthImpostor(BaseHTTPRequestHandler):
    """An upstream that answers the health path itself, as the addon would, and echoes the request's headers."""

    def do_GET(self):
        answer = {
            "loaded": True,
            "writable": True,
            "records_written": 0,
            "problem": None,
            "headers": dict(self.headers),
        }
        answer["proof"] = self.headers.get(NONCE_HEADER)  # an echo: not the proof
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_issue27_an_upstream_answering_the_health_path_itself_does_not_pass_check_proxy(tmp_path):
    # What an addon-less proxy in front of it would forward: the upstream's own answer.
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HealthImpostor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ProxyNotRecording, match="not the capture addon's health") as raised:
            check_proxy(f"http://127.0.0.1:{server.server_address[1]}", timeout=5)
        assert raised.value.answered
    finally:
        server.shutdown()
        server.server_close()


def test_a_recording_proxy_answers_its_health(upstream, tmp_path):
    with Mitmdump(upstream, tmp_path / "captures", log=tmp_path / "mitmdump.log") as mitm:
        assert mitm.health["loaded"] and mitm.health["writable"]
        call(mitm.url, "sess-health")
        health = wait_for(lambda: (h := check_proxy(mitm.url))["records_written"] == 1 and h, "the record")
        assert health["options"]["polar_dir"] == str((tmp_path / "captures").resolve())
        with pytest.raises(ProxyNotRecording, match="not where the proxy records"):
            rollout_service.check_capture_proxy(rollout_service.Args(proxy=mitm.url, captures=tmp_path / "elsewhere"))


def test_a_transparent_proxy_answers_its_health_as_a_proxy(upstream, tmp_path):
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "mitmdump"), "--mode", f"regular@127.0.0.1:{port}", "-s", "addon/polar.py",
           "--set", f"confdir={tmp_path / 'conf'}", "--set", f"polar_reroute={upstream}",
           "--set", f"polar_dir={tmp_path / 'captures'}"]  # fmt: skip
    with Service(cmd, port=port, log=tmp_path / "mitmdump.log") as proxy:
        health = wait_for(lambda: _health_or_none(proxy.url), "the health answer through the proxy")
    assert health["loaded"] and health["options"]["polar_dir"] == str((tmp_path / "captures").resolve())


def _health_or_none(url):
    try:
        return check_proxy(url, transparent=True, timeout=5)
    except ProxyNotRecording:
        return None


# ---- item 1: a full disk under 8 clients ---------------------------------------------------------------


class Clients:
    """``n`` threads calling the proxy until stopped; every answer kept as (session, status, time)."""

    def __init__(self, url, n, prefix):
        self.url, self.prefix, self.answers, self.stop = url, prefix, [], threading.Event()
        self.pool = ThreadPoolExecutor(n)
        self.futures = [self.pool.submit(self._run, i) for i in range(n)]

    def _run(self, i):
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self.stop.is_set():
                session = f"{self.prefix}{i}-{n}"
                n += 1
                body = {"model": "m", "messages": [{"role": "user", "content": "y" * 20_000}]}
                try:
                    status = client.post(
                        f"{self.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {session}"}
                    ).status_code
                except httpx.HTTPError:
                    status = None
                self.answers.append((session, status, time.monotonic()))

    def close(self):
        self.stop.set()
        for f in self.futures:
            f.result()
        self.pool.shutdown()


def health(url):
    """The addon's health answer as it is (check_proxy raises on one that says it cannot write)."""
    return httpx.get(f"{url}/polar/health", timeout=30).json()


def fill_disk(pid, path):
    """Writes past the capture file's current size now fail, as on a full disk."""
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (path.stat().st_size, resource.RLIM_INFINITY))


def free_disk(pid):
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def test_a_full_disk_under_8_clients_recovers_and_shutdown_while_full_names_what_it_lost(upstream, tmp_path):
    captures = tmp_path / "captures"
    mitm = Mitmdump(upstream, captures, log=tmp_path / "mitmdump.log")
    try:
        for i in range(20):  # a capture file larger than mitmdump's log: the limit must stop only records
            assert call(mitm.url, f"warm-{i}", content=b"w" * 50_000).status_code == 200
        capture = Path(wait_for(lambda: health(mitm.url)["capture_file"], "the capture file"))
        wait_for(lambda: health(mitm.url)["records_written"] == 20, "the warm-up records")

        clients = Clients(mitm.url, 8, "full")
        try:
            fill_disk(mitm.proc.pid, capture)
            wait_for(lambda: not health(mitm.url)["writable"], "the proxy to notice the full disk")
            wait_for(lambda: sum(s == 503 for _, s, _ in clients.answers) >= 16, "refusals")
            freed = time.monotonic()
            free_disk(mitm.proc.pid)
            wait_for(
                lambda: any(s == 200 and t > freed for _, s, t in clients.answers[-50:]), "answers after space returned"
            )
            wait_for(lambda: sum(s == 200 and t > freed for _, s, t in clients.answers) >= 16, "recording to go on")
        finally:
            clients.close()
        answered = {sess for sess, s, _ in clients.answers if s == 200}
        refused = {sess for sess, s, _ in clients.answers if s == 503}
        assert refused and answered and None not in {s for _, s, _ in clients.answers}
        wait_for(lambda: health(mitm.url)["backlog_bytes"] == 0, "the backlog to drain")
        found = read_records(captures)
        recorded = {r["session_id"] for r in found.records}
        assert found.torn == found.unresolved == 0
        assert answered <= recorded  # no call answered 200 went unrecorded
        assert not (refused & recorded)  # refusals are counted, not recorded with their bodies
        assert health(mitm.url)["refused"] == len(refused)

        # The disk fills again and mitmdump is stopped before it frees: bounded, and it says what it lost.
        clients = Clients(mitm.url, 8, "stop")
        try:
            fill_disk(mitm.proc.pid, capture)
            wait_for(lambda: not health(mitm.url)["writable"], "the proxy to notice the full disk again")
            wait_for(lambda: sum(s == 503 for _, s, _ in clients.answers) >= 8, "refusals")
            mitm.proc.send_signal(signal.SIGTERM)
            mitm.proc.wait(DEADLINE_S)  # bounded: the writer gives up after CLOSE_SECONDS and reports
        finally:
            clients.close()
    finally:
        mitm.stop()
    log = mitm.output()
    lost = set(re.findall(r"NOT WRITTEN: record \w+ \(session ([\w.-]+),", log))
    found = read_records(captures)
    recorded = {r["session_id"] for r in found.records}
    answered = {sess for sess, s, _ in clients.answers if s == 200}
    assert found.torn == found.unresolved == 0  # the short write at the limit was cut back
    assert lost and answered <= recorded | lost  # every call answered 200 is on disk or named in the log
    assert not (lost & recorded)


# ---- items 6 and 9 over the wire -----------------------------------------------------------------------


def test_deep_json_and_secrets_over_the_wire(upstream, tmp_path):
    with Mitmdump(upstream, tmp_path / "captures", log=tmp_path / "mitmdump.log") as mitm:
        deep = b'{"model": "m", "max_tokens": 5, "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        r = http.post(
            f"{mitm.url}/v1/messages",
            content=deep,
            headers={"x-api-key": "sess-deep", "content-type": "application/json"},
        )
        assert (
            r.status_code == 400 and r.json()["type"] == "error" and "nested too deeply" in r.json()["error"]["message"]
        )
        secret = "sk-proj-WIRESECRET"
        for path, headers in [
            (f"/v1/chat/completions?API_KEY={secret}", {}),
            (f"/s/{secret}/v1/chat/completions", {}),
            ("/v1/chat/completions", {"x-polar-session": secret}),
        ]:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            assert http.post(f"{mitm.url}{path}", json=body, headers=headers).status_code == 200
        wait_for(lambda: check_proxy(mitm.url)["records_written"] == 4, "the records")
    found = read_records(tmp_path / "captures")
    got = found.records
    deep_record = next(r for r in got if r["session_id"] == "sess-deep")
    assert deep_record["error"]["kind"] == "request" and deep_record["status"] == 400 and found.torn == 0
    assert sorted(r["session_source"] for r in got) == ["api_key", "key_hash", "key_hash", "key_hash"]
    for path in (tmp_path / "captures").rglob("*"):
        assert secret.encode() not in path.read_bytes(), path


# ---- request bodies over polar_max_body_mb ---------------------------------------------------------------

BIG_MB = 300  # sent from a generator of one 1 MiB block: the test never holds it
RSS_BOUND = 1 << 30


class _SessionsSeen(_BenchHandler):
    """The benchmark's fake vLLM, keeping the session of each request that reaches it and its Content-Length."""

    seen: ClassVar[list[tuple[str | None, str | None]]] = []

    def do_POST(self):
        self.seen.append((self.headers.get("x-polar-session"), self.headers.get("content-length")))
        super().do_POST()


@pytest.fixture
def counting_upstream():
    _SessionsSeen.seen = []
    server = _BenchServer(("127.0.0.1", 0), _SessionsSeen)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _SessionsSeen.seen
    server.shutdown()
    server.server_close()


def blocks(n_mb):
    block = b"x" * (1 << 20)
    for _ in range(n_mb):
        yield block


class Peak:
    """The largest resident set of process ``pid`` seen while open, polled from /proc every 20 ms."""

    def __init__(self, pid):
        self.process, self.rss, self.stop = psutil.Process(pid), 0, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self.stop.is_set():
            self.rss = max(self.rss, self.process.memory_info().rss)
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


class Steady:
    """One session calling the proxy every 0.3 s until stopped; every answer's status kept."""

    def __init__(self, url, key):
        self.url, self.key, self.statuses, self.stop = url, key, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=http.TIMEOUT) as client:
            while not self.stop.is_set():
                body = {"model": "m", "messages": [{"role": "user", "content": f"call {len(self.statuses)}"}]}
                try:
                    status = client.post(
                        f"{self.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {self.key}"}
                    ).status_code
                except httpx.HTTPError as e:
                    status = repr(e)
                self.statuses.append(status)
                self.stop.wait(0.3)

    def __enter__(self):
        self.thread.start()
        wait_for(lambda: self.statuses, "the steady session's first answer")
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def too_large_kind(path, answer):
    """The refusal's type in its API's shape."""
    if path.startswith("/v1/messages"):
        assert answer["type"] == "error"
        return answer["error"]["type"]
    if ":generateContent" in path:
        return answer["error"]["status"]
    return answer["error"]["type"]


def test_a_300_mb_body_is_refused_413_unread_unforwarded_unrecorded_while_another_session_records(
    counting_upstream, tmp_path
):
    url, seen = counting_upstream
    secret_file = new_secret_file(tmp_path / "secret")
    secret = read_secret(secret_file)
    captures = tmp_path / "captures"
    big_calls = [  # (path, headers): each API's own key header; valid signed keys, so only the size refuses them
        ("/v1/chat/completions", {"authorization": f"Bearer {signed_key('big-chat', secret)}"}),
        ("/v1/messages", {"x-api-key": signed_key("big-anthropic", secret), "anthropic-version": "2023-06-01"}),
        ("/v1/responses", {"authorization": f"Bearer {signed_key('big-responses', secret)}"}),
        ("/v1beta/models/m:generateContent", {"x-goog-api-key": signed_key("big-google", secret)}),
    ]
    kinds = {}
    with Mitmdump(url, captures, log=tmp_path / "mitmdump.log", secret_file=secret_file) as mitm:
        assert mitm.health["options"]["polar_max_body_mb"] == 32 and mitm.health["too_large"] == 0
        with Steady(mitm.url, signed_key("steady", secret)) as steady, Peak(mitm.proc.pid) as peak:
            for path, headers in big_calls:
                for framing in ("content-length", "chunked"):
                    sized = {"content-length": str(BIG_MB << 20)} if framing == "content-length" else {}
                    r = httpx.post(
                        f"{mitm.url}{path}",
                        content=blocks(BIG_MB),
                        headers={**headers, **sized, "content-type": "application/json"},
                        timeout=http.TIMEOUT,
                    )
                    assert r.status_code == 413, (path, framing, r.status_code, r.text[:300])
                    assert "polar_max_body_mb" in r.text and r.headers["connection"] == "close"
                    kinds[path, framing] = too_large_kind(path, r.json())
            answered = len(steady.statuses)
            wait_for(lambda: len(steady.statuses) >= answered + 2, "the steady session to go on after the refusals")
        health = check_proxy(mitm.url)
        assert health["too_large"] == 2 * len(big_calls) and health["refused"] == health["refused_keys"] == 0
        wait_for(lambda: check_proxy(mitm.url)["records_written"] == len(steady.statuses), "the steady records")
    assert set(steady.statuses) == {200}, steady.statuses
    assert peak.rss < RSS_BOUND, f"mitmdump's RSS reached {peak.rss >> 20} MiB"
    assert set(kinds.values()) == {"invalid_request_error", "request_too_large", "INVALID_ARGUMENT"}
    assert kinds["/v1/messages", "chunked"] == "request_too_large"
    # Nothing of the large bodies went upstream or to disk; every steady call did both.
    assert seen == [("steady", seen[0][1])] * len(seen) and len(seen) == len(steady.statuses)
    found = read_records(captures)
    assert [r["session_id"] for r in found.records] == ["steady"] * len(steady.statuses) and found.torn == 0
    log = (tmp_path / "mitmdump.log").read_text()
    assert log.count("its body is over polar_max_body_mb=32") == 2 * len(big_calls)
