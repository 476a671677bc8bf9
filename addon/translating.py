"""Plumbing between mitmproxy flows and the native-API translators: requests out, answers and streams back.

A native call (Anthropic, Responses, Google) goes upstream as one Chat Completions call with the
token fields; its answer comes back in the harness's API, event by event when streamed. The
translators themselves (anthropic.py, responses.py, google.py) are pure; see native.py.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mitmproxy import http

from addon import apis, chat, content, native
from addon.record import Body, Exchange, merge_fields

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
TRANSLATION_KEY = "polar_translation"


class TranslatingTee:
    """The stream callable for a translated call: keeps the upstream's Chat Completions chunks and
    sends the client its own API's events for each one as it arrives."""

    def __init__(self, exchange: Exchange, translation: native.Translation) -> None:
        self.exchange = exchange
        self.translation = translation
        self.decoder = native.ChatStream()
        self.broken = False

    def __call__(self, data: bytes) -> list[bytes]:
        if data:
            self.exchange.chunks.append(data)
            self.exchange.chunk_times.append(time.time())
        if self.broken:
            return []
        try:
            chunks = list(self.decoder.decode(data) if data else self.decoder.flush())
            out = [self.translation.events(chunk) for chunk in chunks]
            if not data:
                out.append(self.translation.finish(complete=True))
        except Exception as e:  # never raise into mitmproxy's stream: end the client's stream instead
            log.exception("polar: translating the %s stream failed", self.exchange.api)
            self.exchange.error = {"kind": "translate", "message": f"{type(e).__name__}: {e}"}
            self.broken = True
            return [self.translation.finish(complete=False)]
        return [b for b in out if b]

    def abort(self, message: str) -> bytes:
        """The client's closing events for a stream the upstream broke off: its API's error event (b"" once the
        stream has ended or broken already)."""
        if self.broken:
            return b""
        self.broken = True
        try:
            return self.translation.finish(complete=False, message=message)
        except Exception:  # never raise into mitmproxy's error handling
            log.exception("polar: ending the %s stream with an error event failed", self.exchange.api)
            return b""


def install() -> None:
    """End a translated stream the upstream broke off with the client API's own error event.

    When the upstream's connection dies mid-stream, mitmproxy calls no stream callable; it just cuts the client's
    stream, which harness SDKs read as a network glitch (or a clean end) rather than as a failed answer. mitmproxy 11
    has no hook to send bytes at that point, so its HTTP stream layer's protocol-error handler is wrapped: before
    the cut, it sends the client what ``TranslatingTee.abort`` gives. Streams passed through untranslated (Chat
    Completions) are left as they are: their bytes are the upstream's.
    """
    try:
        from mitmproxy.connection import ConnectionState
        from mitmproxy.proxy.layers import http as layer
        from mitmproxy.proxy.layers.http import _events
    except ImportError:  # pragma: no cover - another mitmproxy layout: streams are cut without an error event
        log.warning("polar: cannot end broken translated streams with an error event on this mitmproxy version")
        return
    original = layer.HttpStream.handle_protocol_error
    if getattr(original, "polar", False):
        return

    def handle_protocol_error(self: Any, event: Any) -> Any:
        response = self.flow.response
        tee = response.stream if response is not None else None
        writable = self.context.client.state & ConnectionState.CAN_WRITE
        if (
            isinstance(event, _events.ResponseProtocolError)
            and isinstance(tee, TranslatingTee)
            and writable
            and (tail := tee.abort(f"the upstream broke off the stream: {event.message}"))
        ):
            yield layer.SendHttp(_events.ResponseData(self.stream_id, tail), self.context.client)
        yield from original(self, event)

    handle_protocol_error.polar = True  # type: ignore[attr-defined]
    layer.HttpStream.handle_protocol_error = handle_protocol_error  # type: ignore[method-assign]


def translate_request(flow: http.HTTPFlow, ex: Exchange, headers: dict[str, str], options: native.Options) -> None:
    """Send a native call upstream as one Chat Completions call, with the token fields."""
    module = apis.TRANSLATED[ex.api]
    try:
        if not isinstance(ex.request.value, dict):
            raise native.BadRequest("the request body is not a JSON object")
        started = module.start(ex.request.value, ex.path, headers, options)
    except native.BadRequest as e:
        flow.response = json_response(400, module.error_body(400, str(e), e.param))
        ex.error = {"kind": "translate", "message": str(e)}
        return
    except Exception as e:  # noqa: BLE001 - a body the field checks passed and the translator choked on: never forwarded
        # The client gets its API's 400 without Python in it; the log and the record say what broke, in one line.
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{Path(frame.filename).name}:{frame.lineno}"
        log.error(
            "polar: the %s translator failed on a request body (%s: %s at %s); answered 400",
            ex.api,
            type(e).__name__,
            e,
            where,
        )
        message = f"polar could not translate this request body: it does not have the shape the {ex.api} API documents"
        flow.response = json_response(400, module.error_body(400, message))
        ex.error = {"kind": "translate", "message": f"{type(e).__name__}: {e} (at {where})"}
        return
    if isinstance(started, native.LocalAnswer):
        flow.response = json_response(started.status, started.body)
        return
    added = chat.token_fields(started.chat_body, options.upstream)
    sent = merge_fields(started.chat_body, added)
    flow.request.method = "POST"
    flow.request.path = CHAT_PATH
    flow.request.headers["content-type"] = "application/json"
    flow.request.content = json.dumps(sent, ensure_ascii=False).encode("utf-8")
    ex.injected = added
    ex.upstream_request = Body(value=sent)
    ex.translated = True
    flow.metadata[TRANSLATION_KEY] = started


def translate_answer(
    flow: http.HTTPFlow, ex: Exchange, translation: native.Translation, decode: Callable[[bytes, str], bytes]
) -> None:
    """Rewrite a buffered upstream answer (or error) into the harness's API; ``decode(bytes, encoding)`` undoes its
    content-encoding with a bound (addon/content.py: mitmproxy's ``.content`` would decode a gzip bomb whole)."""
    assert flow.response is not None
    status = flow.response.status_code
    upstream: Any = None
    too_large: content.TooLarge | None = None
    try:
        data = decode(flow.response.raw_content or b"", flow.response.headers.get("content-encoding", ""))
        upstream = json.loads(data or b"null")
    except content.TooLarge as e:
        too_large = e
    except ValueError:  # also content.Undecodable
        pass
    try:
        if too_large is not None:  # a gzip bomb: the client gets a clear error, the record says why
            ex.error = {"kind": "decode", "message": str(too_large)}
            status, body = 502, translation.error(502, f"polar refused the upstream answer: {too_large}")
        elif status == 200 and isinstance(upstream, dict):
            body = translation.answer(upstream)
        else:
            body = translation.error(status if status >= 400 else 502, upstream_message(upstream, flow.response))
            status = status if status >= 400 else 502
    except Exception as e:
        log.exception("polar: translating the %s answer failed", ex.api)
        ex.error = {"kind": "translate", "message": f"{type(e).__name__}: {e}"}
        status, body = 502, translation.error(502, f"polar could not translate the upstream answer: {e}")
    flow.response.status_code = status
    flow.response.headers["content-type"] = "application/json"
    flow.response.content = json.dumps(body, ensure_ascii=False).encode("utf-8")


def error_body(api: str, status: int, message: str) -> dict[str, Any]:
    """An error body in the shape of the client's API."""
    if (module := apis.TRANSLATED.get(api)) is not None:
        return module.error_body(status, message)
    return chat.error_body(status, message)


def upstream_message(body: Any, response: http.Response) -> str:
    """The error message of an upstream answer, whatever its shape."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(message := error.get("message"), str):
            return message
        if isinstance(message := body.get("message"), str):
            return message
    return (response.get_text(strict=False) or "")[:2000] or f"upstream answered {response.status_code}"


def json_response(status: int, body: dict[str, Any]) -> http.Response:
    return http.Response.make(status, json.dumps(body), {"content-type": "application/json"})
