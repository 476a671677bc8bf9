"""mitmproxy's own error answers (upstream refused, reset, timed out) as JSON every harness SDK parses."""

from __future__ import annotations

import logging
from typing import Any

from addon.translating import json_response

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


def install() -> None:
    """Make mitmproxy's own error answers (upstream refused, reset, timed out) JSON, not HTML.

    Harness SDKs parse error bodies as JSON, and mitmproxy 11 gives addons no hook to replace its
    HTML error page (mitmproxy PR #7999 proposes one), so its HTTP/1 error builder is swapped.
    """
    try:
        from mitmproxy.net.http import http1
        from mitmproxy.proxy.layers.http import _http1
    except ImportError:  # pragma: no cover - another mitmproxy layout: keep its HTML errors
        log.warning("polar: cannot install JSON error answers on this mitmproxy version")
        return
    if getattr(_http1.make_error_response, "polar", False):
        return

    def make_error_response(status_code: int, message: str = "") -> bytes:
        status = 504 if "timed out" in message.lower() or "timeout" in message.lower() else status_code
        response = json_response(status, any_api_error(status, message or "proxy error"))
        response.headers["connection"] = "close"
        data: bytes = http1.assemble_response(response)
        return data

    make_error_response.polar = True  # type: ignore[attr-defined]
    _http1.make_error_response = make_error_response
