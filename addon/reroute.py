"""Transparent mode: mitmproxy as the harness's HTTPS proxy, sending its provider's model calls to our upstream.

    mitmdump --mode regular@127.0.0.1:8080 --set confdir=/tmp/polar-ca -s addon/polar.py \\
        --set polar_reroute=http://127.0.0.1:8000 --set polar_dir=captures

The harness keeps its default base URL and gets only ``HTTPS_PROXY`` and the CA (``confdir/
mitmproxy-ca-cert.pem``) to trust (``python -m eval transparent env HARNESS`` prints the line). This
addon decides, per flow, what ``Polar`` does with it, in ``flow.metadata[ROUTE_KEY]``:

- ``reroute``: the host is named in ``polar_reroute``. The call goes to our upstream instead, through
  the same detection, translation, token fields, sessions and records as in reverse mode; a path that
  is not a model call (Claude Code's ``/api/claude_code/policy_limits``, Codex's WebSocket upgrade,
  ``HEAD /``) is answered here with an empty reply and never leaves the machine.
- ``capture``: the host is named in ``polar_capture`` (capture-only): the call goes on to the real
  provider with the harness's own key, untranslated, and is recorded with credentials removed.
- ``pass``: any other host, untouched and unrecorded; its TLS is not even opened, so pinned
  certificates and telemetry work as without the proxy.
- absent: a reverse-mode flow, handled exactly as before this addon existed.

Sessions: a proxy URL with a user name (``HTTPS_PROXY=http://SESSION@127.0.0.1:8080``) names the
session of every call that process makes, whatever key it sends, the only way to tell runs apart in
capture-only mode where the key must be the real one. The user name becomes the ``x-polar-session``
header (so the record says ``session_source: header``); without one the usual order applies
(``addon/session.py``: header, then the API key, which rollouts set to the session id). With ``polar_secret_file``
set, the user name is a signed key (``SESSION~TAG``) like any other, checked by ``Polar``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import weakref
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import connection, ctx, exceptions, http, tls
from mitmproxy.proxy.mode_specs import ReverseMode

from addon import apis, session

log = logging.getLogger(__name__)

ROUTE_KEY = "polar_route"
REROUTE, CAPTURE, PASS = "reroute", "capture", "pass"
# The provider API hosts a bare upstream URL in polar_reroute stands for.
PROVIDER_HOSTS = apis.PROVIDER_HOSTS


@dataclass(frozen=True)
class Upstream:
    scheme: str
    host: str
    port: int


def parse_reroute(spec: str) -> dict[str, Upstream]:
    """``URL`` (the provider hosts) or ``HOST[:PORT]=URL`` entries, comma-separated, to a host table."""
    routes: dict[str, Upstream] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        host, sep, url = entry.partition("=")
        hosts = [host.lower()] if sep and "://" not in host else list(PROVIDER_HOSTS)
        upstream = _parse_url(url if sep and "://" not in host else entry)
        routes.update(dict.fromkeys(hosts, upstream))
    return routes


def _parse_url(url: str) -> Upstream:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as e:
        raise exceptions.OptionsError(f"polar_reroute: bad port in {url!r}") from e
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        # The request's own path is kept, as in reverse mode: a prefix would only be a second way to say it.
        raise exceptions.OptionsError(f"polar_reroute: give the upstream as http[s]://HOST[:PORT], not {url!r}")
    return Upstream(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80))


def parse_hosts(spec: str) -> frozenset[str]:
    return frozenset(h.strip().lower() for h in spec.split(",") if h.strip())


def proxy_user(value: str) -> str | None:
    """The user name of a ``Proxy-Authorization: Basic`` header, or None."""
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        return None
    return user or None


def is_model_call(method: str, api: str) -> bool:
    """A POST in one of the wire APIs (addon/apis.py): what a rerouted host sends our upstream."""
    return method == "POST" and api in apis.BY_NAME


def local_answer(request: http.Request) -> http.Response:
    """The reply to a non-model request on a rerouted host: empty, well-formed, never forwarded."""
    if request.headers.get("upgrade", "").lower() == "websocket":
        # Codex tries the Responses API over a WebSocket first; a plain HTTP refusal makes it fall back
        # to HTTPS POSTs, which are captured like any other call.
        body = {"error": {"message": "polar: no WebSocket transport here; use HTTPS", "type": "invalid_request_error"}}
        return http.Response.make(426, json.dumps(body), {"content-type": "application/json"})
    return http.Response.make(200, b"" if request.method == "HEAD" else b"{}", {"content-type": "application/json"})


class Reroute:
    """Marks each flow reroute / capture / pass (see the module docstring); rewrites rerouted ones."""

    def __init__(self) -> None:
        self.routes: dict[str, Upstream] = {}
        self.captured: frozenset[str] = frozenset()
        # The session a client connection named in its CONNECT's proxy credentials.
        self.connect_sessions: weakref.WeakKeyDictionary[connection.Client, str] = weakref.WeakKeyDictionary()

    def load(self, loader: Any) -> None:
        loader.add_option(
            "polar_reroute",
            str,
            "",
            "Transparent mode: comma-separated HOST[:PORT]=URL entries sending that host's model calls to our "
            "upstream URL (http[s]://HOST[:PORT]); a bare URL stands for " + ", ".join(PROVIDER_HOSTS) + ". "
            "Other paths on those hosts get an empty local reply. Hosts named nowhere pass untouched, unrecorded.",
        )
        loader.add_option(
            "polar_capture",
            str,
            "",
            "Capture-only: comma-separated HOST[:PORT] whose calls go on to the real provider with the "
            "harness's own key and are recorded, credentials removed.",
        )

    def configure(self, updated: set[str]) -> None:
        if "polar_reroute" in updated:
            self.routes = parse_reroute(ctx.options.polar_reroute)
        if "polar_capture" in updated:
            self.captured = parse_hosts(ctx.options.polar_capture)
        if both := self.captured & self.routes.keys():
            raise exceptions.OptionsError(f"hosts both rerouted and capture-only: {', '.join(sorted(both))}")

    def running(self) -> None:
        forward = [m for m in ctx.options.mode if not m.startswith("reverse")]
        if forward and not (self.routes or self.captured):
            log.warning(
                "polar: --mode %s without polar_reroute or polar_capture: every call is handled as in reverse "
                "mode, provider keys dropped. Name the hosts to reroute or capture.",
                forward[0],
            )

    @staticmethod
    def _names_session(user: str) -> bool:
        """A session id, or with ``polar_secret_file`` set a signed key (checked by Polar, which refuses a bad one)."""
        signed = "polar_secret_file" in ctx.options and bool(ctx.options.polar_secret_file)
        return session.is_session_id(user) or (signed and session.is_signed_form(user))

    def _named(self, host: str, port: int) -> str | None:
        """The entry naming this destination, ``host:port`` first, or None."""
        host = host.lower()
        for key in (f"{host}:{port}", host):
            if key in self.routes or key in self.captured:
                return key
        return None

    def _forward_mode(self, client: connection.Client) -> bool:
        return bool(self.routes or self.captured) and not isinstance(client.proxy_mode, ReverseMode)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        if (user := proxy_user(flow.request.headers.get("proxy-authorization", ""))) is not None:
            self.connect_sessions[flow.client_conn] = user

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        # A host that is not ours keeps its own TLS end to end: nothing of it is decrypted.
        address = data.context.server.address
        if self._forward_mode(data.context.client) and address and self._named(*address) is None:
            data.ignore_connection = True

    def request(self, flow: http.HTTPFlow) -> None:
        if not self._forward_mode(flow.client_conn):
            return
        # Proxy credentials are for us (plain-HTTP requests carry them on every request), never for the host.
        user = proxy_user(flow.request.headers.pop("proxy-authorization", "")) or self.connect_sessions.get(
            flow.client_conn
        )
        key = self._named(flow.request.host, flow.request.port)
        if key is None:
            flow.metadata[ROUTE_KEY] = PASS
            return
        if user and self._names_session(user) and session.SESSION_HEADER not in flow.request.headers:
            flow.request.headers[session.SESSION_HEADER] = user
        if key in self.captured:
            flow.metadata[ROUTE_KEY] = CAPTURE
            return
        flow.metadata[ROUTE_KEY] = REROUTE
        upstream = self.routes[key]
        if flow.server_conn.via is not None:
            # --mode upstream chains another proxy for the provider hosts; our upstream is reached directly.
            flow.server_conn = connection.Server(address=(upstream.host, upstream.port))
        flow.request.scheme, flow.request.port = upstream.scheme, upstream.port
        flow.request.host = upstream.host  # also the Host header / :authority
