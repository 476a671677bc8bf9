"""An upstream that dies mid-stream, behind a real mitmdump with the addon (issue 16, item 7).

The record blames the upstream, not the client, and a translated stream (Anthropic, Responses, Google) ends with its
API's own error event instead of a bare cut, so the harness sees a failed answer rather than a network glitch.
"""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from eval.sessions.procs import Mitmdump
from tests.captures import read_records

pytestmark = pytest.mark.slow

CHUNKS = [
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "prompt_token_ids": [1, 2],
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "token_ids": [3]}]},
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
     "choices": [{"index": 0, "delta": {"content": "lo"}, "token_ids": [4]}]},
]  # fmt: skip


class Dying(BaseHTTPRequestHandler):
    """Answers any POST with a streamed Chat Completion that stops after two chunks: the connection just closes."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for chunk in CHUNKS:
            data = f"data: {json.dumps(chunk)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)  # killed: no final chunk, no [DONE]
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broken-stream")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Dying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Mitmdump(
            f"http://127.0.0.1:{server.server_address[1]}", tmp / "captures", log=tmp / "mitmdump.log"
        ) as mitm:
            mitm.captures = tmp / "captures"
            yield mitm
    finally:
        server.shutdown()
        server.server_close()


def received(url, body, session, headers=None):
    """Everything the client got before its connection ended, however it ended."""
    data = b""
    try:
        with httpx.stream(
            "POST", url, json=body, headers={"x-polar-session": session, **(headers or {})}, timeout=60
        ) as r:
            assert r.status_code == 200
            for piece in r.iter_raw():
                data += piece
    except httpx.RemoteProtocolError:  # the cut itself: the chunked body never ended
        pass
    return data.decode()


def events(text):
    return [block for block in text.split("\n\n") if block.strip()]


def test_anthropic_stream_ends_with_an_error_event(proxy):
    body = {"model": "m", "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    text = received(f"{proxy.url}/v1/messages", body, "broken-anthropic", {"anthropic-version": "2023-06-01"})
    assert "event: content_block_delta" in text and '"text":"Hel"' in text
    last = events(text)[-1]
    assert last.startswith("event: error\n")
    error = json.loads(last.partition("data: ")[2])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "upstream broke off" in error["error"]["message"]
    assert "message_stop" not in text


def test_responses_stream_ends_with_response_failed(proxy):
    body = {"model": "m", "stream": True, "input": "hi"}
    text = received(f"{proxy.url}/v1/responses", body, "broken-responses")
    assert "response.output_text.delta" in text
    last = events(text)[-1]
    assert last.startswith("event: response.failed\n")
    response = json.loads(last.partition("data: ")[2])["response"]
    assert response["status"] == "failed" and "upstream broke off" in response["error"]["message"]


def test_google_stream_ends_with_an_error(proxy):
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    text = received(f"{proxy.url}/v1beta/models/m:streamGenerateContent?alt=sse", body, "broken-google")
    datas = [json.loads(e.partition("data: ")[2]) for e in events(text)]
    assert datas[0]["candidates"][0]["content"]["parts"][0]["text"] == "Hel"
    assert datas[-1]["error"]["status"] == "UNAVAILABLE" and "upstream broke off" in datas[-1]["error"]["message"]


def test_records_blame_the_upstream(proxy):
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    text = received(f"{proxy.url}/v1/chat/completions", body, "broken-chat")
    assert text.count("data: ") == 2  # passed through as the upstream sent it: cut
    records = read_records(proxy.captures, expect=4, timeout=30)
    by_session = {r["session_id"]: r for r in records}
    assert set(by_session) >= {"broken-chat", "broken-anthropic", "broken-responses", "broken-google"}, by_session
    for record in records:
        assert record["complete"] is False and record["error"]["kind"] == "upstream", record["error"]
        assert record["response_body"].count("data: ") == 2  # what the upstream sent before it died
