"""mitmproxy's own error answers (upstream refused, reset, timed out) as JSON every harness SDK parses, and its
refusal of a request body over ``body_size_limit`` (the addon's ``polar_max_body_mb``) as a 413 in the client's API
shape."""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

from mitmproxy import ctx, http
from mitmproxy.utils import human

from addon import apis, chat, session
from addon.translating import error_body, json_response

log = logging.getLogger(__name__)


def any_api_error(status: int, message: str) -> dict[str, Any]:
    """An error body every client parses: OpenAI's, Anthropic's and Google's shapes in one object.

    mitmproxy builds its error answers without the flow, so the harness's API is unknown there.
    """
    return {
        "type": "error",  # Anthropic
        "error": {
            "message": message,
            "type": "api_error" if status != 504 else "timeout_error",  # OpenAI, Anthropic
            "param": None,
            "code": status,  # OpenAI, Google
            "status": "DEADLINE_EXCEEDED" if status == 504 else "UNAVAILABLE",  # Google
        },
    }


def too_large(request: http.Request) -> http.Response:
    """The 413 for a request whose body is over mitmproxy's ``body_size_limit``, in the shape of its API (told by the
    path alone: the body was never read). The connection closes after it: the rest of the body is not read."""
    api = apis.detect_api(session.bare_path(request.path), {}, None)
    limit = human.parse_size(ctx.options.body_size_limit) if "body_size_limit" in ctx.options else None
    size = f"{limit / (1 << 20):g} MiB" if limit else "its limit"
    message = (
        f"polar: the request body is over this proxy's limit of {size} (polar_max_body_mb); not forwarded or recorded"
    )
    if api in apis.TRANSLATED:
        body = error_body(api, 413, message)
    else:
        body = chat.error_body(413, message, "invalid_request_error")
    response = json_response(413, body)
    response.headers["connection"] = "close"
    return response


def install() -> None:
    """Make mitmproxy's own error answers (upstream refused, reset, timed out) JSON, not HTML, and its refusal of a
    request body over ``body_size_limit`` a 413 in the client's API shape (:func:`too_large`).

    Harness SDKs parse error bodies as JSON, and mitmproxy 11 gives addons no hook to replace its
    HTML error page (mitmproxy PR #7999 proposes one), so its HTTP/1 error builder is swapped. That builder is not
    told the request; the HTTP/1 server connection that sends the error knows it, so its ``send`` answers the 413.
    """
    try:
        from mitmproxy.connection import ConnectionState
        from mitmproxy.net.http import http1
        from mitmproxy.proxy import commands
        from mitmproxy.proxy.layers.http import _http1
        from mitmproxy.proxy.layers.http._events import ResponseProtocolError
    except ImportError:  # pragma: no cover - another mitmproxy layout: keep its HTML errors
        log.warning("polar: cannot install JSON error answers on this mitmproxy version")
        return
    if getattr(_http1.make_error_response, "polar", False):
        return
    send = _http1.Http1Server.send

    def send_too_large_as_api_error(self: _http1.Http1Server, event: Any) -> Generator[commands.Command, Any, None]:
        # check_body_size's refusal: before the request hook, with no answer sent yet on this connection.
        if (
            isinstance(event, ResponseProtocolError)
            and event.code == 413
            and self.request is not None
            and self.response is None
            and self.conn.state & ConnectionState.CAN_WRITE
        ):
            yield commands.SendData(self.conn, http1.assemble_response(too_large(self.request)))
            yield commands.CloseConnection(self.conn)
            return
        yield from send(self, event)

    _http1.Http1Server.send = send_too_large_as_api_error  # type: ignore[method-assign]

    def make_error_response(status_code: int, message: str = "") -> bytes:
        status = 504 if "timed out" in message.lower() or "timeout" in message.lower() else status_code
        response = json_response(status, any_api_error(status, message or "proxy error"))
        response.headers["connection"] = "close"
        data: bytes = http1.assemble_response(response)
        return data

    make_error_response.polar = True  # type: ignore[attr-defined]
    _http1.make_error_response = make_error_response
