"""Record every model call a harness makes, at token level, on its way to the inference server.

    mitmdump --mode reverse:http://127.0.0.1:8000 --listen-host 127.0.0.1 -p 8080 \\
        -s addon/polar.py --set polar_dir=captures --set polar_upstream=vllm

Point the harness's base URL at the proxy and set its API key to a session id, or run it unchanged
through the proxy in regular mode (transparent mode, ``addon/reroute.py``). Each finished
exchange becomes one JSON line under ``polar_dir`` (format v2: ``addon/record_v2.py``; v1:
``addon/record.py``). Chat Completions streams pass through untouched: a tee keeps a copy of every
chunk as it passes. Anthropic, Responses and Google calls go upstream as Chat Completions and come
back translated, chunk by chunk (``addon/translating.py``). ``GET /polar/health`` is answered here (loaded, options,
writable, records written), so clients can tell a recording proxy from one whose script failed to
load; while records cannot be written, calls are refused with 503, never forwarded unrecorded. With
``polar_secret_file`` set, only a call whose key is signed with that secret (``addon/session.py``) names a session;
any other is answered 403 here, never forwarded, never recorded, and counted (``refused_keys`` in the health answer).
A request body over ``polar_max_body_mb`` is answered 413 by mitmproxy before more than that is read (the addon sets
its ``body_size_limit``), never forwarded, never recorded, and counted (``too_large``); one session whose records wait
to be written past its share of ``polar_backlog_mb`` gets 503 for its own calls while the others go on.
Imports only the standard library and mitmproxy, so a standalone mitmproxy can load it.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.proxy import mode_specs

if __package__ in (None, "", "__mitmproxy_script__"):
    # `mitmdump -s addon/polar.py` loads this file as a loose script: make its package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from addon import (
    apis,
    chat,
    clamp,
    constrained,
    content,
    health,
    native,
    proxy_errors,
    record_v2,
    reroute,
    resent,
    responses,
    session,
    translating,
)
from addon.record import Body, Exchange, merge_fields
from addon.writer import CaptureWriter

log = logging.getLogger(__name__)

UPSTREAMS = ("vllm", "sglang", "plain")
TRANSLATE = ("auto", "never")
FORMATS = (1, record_v2.FORMAT_VERSION)
TOO_LARGE_ERROR = "Request body exceeds"  # mitmproxy 11's flow error for a request body over its body_size_limit
METADATA_KEY = "polar"
CAP_KEY = "polar.cap"  # (models URL, model) of a call whose output cap the addon checked
SALT_FILE = ".session-salt"
# polar_max_body_mb's default. The largest real harness requests: Claude Code's first is 50-87 KB, Codex's 27-42 KB;
# a long session resends its history and grows to a few MB at most (a 128K-256K-token context is ~1-2 MB of JSON,
# base64 images add to it). 32 MiB is ten times that, and what Anthropic's own Messages API takes in one request, so
# no call a provider would take is refused; it bounds what one request can make the proxy hold (mitmdump holds a
# body it takes at about 7x its size at the peak, docs/failures.md).
MAX_BODY_MB = 32
# One session may hold at most this fraction (1/N) of polar_backlog_mb in records waiting to be written: a session
# flooding records gets 503 for its own calls, and the other sessions keep three quarters of the backlog. An
# agent has one call in flight and a record of a few MB at most, far under a quarter of the 256 MiB default.
SESSION_SHARE = 4


def guarded(hook: Callable[..., None]) -> Callable[..., None]:
    """An error in the addon is logged and costs at most this exchange's record, never the proxy.

    A model call whose request hook failed is answered here (400 for a body nested too deeply to
    handle, else 500, in the API's shape) and recorded as an error, never forwarded half-handled:
    it could otherwise reach the upstream unrecorded or untranslated.
    """

    @functools.wraps(hook)
    def run(self: Polar, flow: http.HTTPFlow) -> None:
        try:
            hook(self, flow)
        except Exception as e:
            # The path only: a query string may still hold a ?key= secret.
            log.exception(
                "polar: %s failed for %s %s", hook.__name__, flow.request.method, flow.request.path.partition("?")[0]
            )
            ex = flow.metadata.get(METADATA_KEY)
            if isinstance(ex, Exchange) and ex.error is None:
                ex.error = {"kind": "addon", "message": f"{hook.__name__}: {type(e).__name__}: {e}"}
            if hook.__name__ == "request" and flow.response is None:
                self._refuse_failed_request(flow, e)

    return run


class Tee:
    """The response stream callable: passes each chunk on unchanged and keeps a copy."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    def __call__(self, data: bytes) -> bytes:
        if data:
            self.exchange.chunks.append(data)
            self.exchange.chunk_times.append(time.time())
        return data


class Polar:
    def __init__(self) -> None:
        self.writer: CaptureWriter | None = None
        self._salt: bytes | None = None
        self.refused = 0  # model calls answered 503 because recording did not work
        self.secret: bytes | None = None  # polar_secret_file's: only keys signed with it name a session
        self.secret_problem: str | None = None  # polar_secret_file is set but could not be read: every call refused
        self.refused_keys = 0  # calls answered 403 because their key was not a signed one
        self.refused_share = 0  # model calls answered 503 because their session held its share of the backlog
        self.too_large = 0  # requests answered 413 because their body was over polar_max_body_mb
        self.backlog_bytes = 256 << 20
        self.max_body = MAX_BODY_MB << 20  # polar_max_body_mb
        self._body_size_limit: str | None = None  # the value of mitmproxy's body_size_limit this addon set
        self.max_decoded = 128 << 20  # polar_max_decoded_mb
        self._handing_over: dict[str, Exchange] = {}  # by id: submitted on the next loop step; done() flushes them
        self.upstream = "vllm"
        self.upstream_key = ""
        self.translate = True
        self.native_options = native.Options(model="", upstream="vllm")
        self.clamp = True
        self.context_lengths = clamp.ContextLengths()
        self.resent = resent.ResentBodies()  # each session's last body: the next is checked only where it differs

    def load(self, loader: Any) -> None:
        loader.add_option("polar_dir", str, "captures", "Folder for capture files (created 0700, files 0600).")
        loader.add_option(
            "polar_upstream",
            str,
            "vllm",
            "Which token fields to ask the upstream for: vllm | sglang | plain (none, only record).",
        )
        loader.add_option(
            "polar_upstream_key",
            str,
            "",
            "Credential sent upstream in place of the client's key (which is never forwarded). Empty: none.",
        )
        loader.add_option(
            "polar_translate",
            str,
            "auto",
            "auto: answer Anthropic, Responses and Google calls through the upstream's Chat Completions "
            "(token ids on every chunk; vllm/sglang upstreams); never: pass them through and only record.",
        )
        loader.add_option(
            "polar_model", str, "", "Model name translated calls ask the upstream for (empty: the client's own)."
        )
        loader.add_option(
            "polar_clamp_max_tokens",
            bool,
            True,
            "Cut max_tokens / max_completion_tokens beyond the upstream model's context (its /models "
            "max_model_len) to that context before sending: vLLM refuses a larger cap (addon/clamp.py).",
        )
        loader.add_option(
            "polar_format",
            int,
            record_v2.FORMAT_VERSION,
            "Capture format: 2 (a request stored as what is new since the session's previous one, bodies "
            "compressed; addon/record_v2.py) or 1 (every record whole, as JSON; addon/record.py).",
        )
        loader.add_option(
            "polar_secret_file",
            str,
            "",
            "File holding the secret session keys are signed with (addon/session.py): every call must then carry "
            "<session_id>~<tag> as its key, anything else is refused with 403 and counted. Empty: keys unchecked.",
        )
        loader.add_option("polar_fsync", bool, False, "fsync each batch of records (survives power loss; slower).")
        loader.add_option(
            "polar_rotate_mb", int, 256, "Start a new capture file once the current one passes this size (MiB)."
        )
        loader.add_option(
            "polar_max_decoded_mb",
            int,
            128,
            "Largest body (MiB) the addon decodes from gzip or deflate; a larger one (a gzip bomb) is refused "
            "(a request) or recorded encoded with a decode error (an answer).",
        )
        loader.add_option(
            "polar_backlog_mb",
            int,
            256,
            "Refuse model calls (503) while more than this many MiB of records wait to be written "
            "(a slow or full disk), and one session's calls while a quarter of that is its own.",
        )
        loader.add_option(
            "polar_max_body_mb",
            int,
            MAX_BODY_MB,
            "Largest request body (MiB): a larger one is answered 413 before more than this is read (sets "
            "mitmproxy's body_size_limit, which then also bounds the answers it buffers), never forwarded or recorded.",
        )

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        if "polar_secret_file" in updated:
            self._load_secret(opts.polar_secret_file)
        if "polar_upstream" in updated:
            if opts.polar_upstream not in UPSTREAMS:
                raise exceptions.OptionsError(
                    f"polar_upstream must be one of {', '.join(UPSTREAMS)}, not {opts.polar_upstream!r}"
                )
            self.upstream = opts.polar_upstream
        if "polar_rotate_mb" in updated and opts.polar_rotate_mb < 1:
            raise exceptions.OptionsError(f"polar_rotate_mb must be at least 1, not {opts.polar_rotate_mb}")
        if "polar_backlog_mb" in updated:
            if opts.polar_backlog_mb < 1:
                raise exceptions.OptionsError(f"polar_backlog_mb must be at least 1, not {opts.polar_backlog_mb}")
            self.backlog_bytes = opts.polar_backlog_mb << 20
        if "polar_max_decoded_mb" in updated:
            if opts.polar_max_decoded_mb < 1:
                raise exceptions.OptionsError(
                    f"polar_max_decoded_mb must be at least 1, not {opts.polar_max_decoded_mb}"
                )
            self.max_decoded = opts.polar_max_decoded_mb << 20
        if updated & {"polar_max_body_mb", "body_size_limit"}:
            self._limit_bodies(opts.polar_max_body_mb)
        if "polar_translate" in updated and opts.polar_translate not in TRANSLATE:
            raise exceptions.OptionsError(f"polar_translate must be auto or never, not {opts.polar_translate!r}")
        self.upstream_key = opts.polar_upstream_key
        self.clamp = opts.polar_clamp_max_tokens
        self.translate = opts.polar_translate == "auto" and self.upstream != "plain"
        self.native_options = native.Options(model=opts.polar_model, upstream=self.upstream)
        if "polar_format" in updated and opts.polar_format not in FORMATS:
            raise exceptions.OptionsError(f"polar_format must be 1 or 2, not {opts.polar_format!r}")
        if updated & {"polar_dir", "polar_fsync", "polar_rotate_mb", "polar_format"}:
            directory = Path(opts.polar_dir)
            if directory.exists() and not directory.is_dir():
                raise exceptions.OptionsError(f"polar_dir {opts.polar_dir!r} exists and is not a folder")
            if self.writer is not None:
                self.writer.close()
            # Files and the folder appear with the first record, not before.
            self.writer = CaptureWriter(
                directory,
                rotate_bytes=opts.polar_rotate_mb << 20,
                fsync=opts.polar_fsync,
                decode_content=self.decode_content,
                format_version=opts.polar_format,
            )
            self._salt = None

    def _limit_bodies(self, mb: int) -> None:
        """Bound request bodies by mitmproxy's own ``body_size_limit``. It refuses a body whose Content-Length is over
        it right after the headers, before reading any of it, and a chunked one as soon as it has read past it, with a
        413 that ``proxy_errors`` shapes as the client's API; the request hook never runs, so nothing is forwarded or
        recorded, and the error hook counts it. An addon hook could not do this: a response set in ``requestheaders``
        is sent only after mitmproxy has read the whole body."""
        if mb < 1:
            raise exceptions.OptionsError(f"polar_max_body_mb must be at least 1, not {mb}")
        self.max_body = mb << 20
        if "body_size_limit" not in ctx.options:  # a test context without mitmproxy's proxy server
            return
        current = ctx.options.body_size_limit
        if current is not None and current != self._body_size_limit:
            raise exceptions.OptionsError(
                f"body_size_limit is set by the polar addon from polar_max_body_mb; set that instead of {current!r}"
            )
        self._body_size_limit = str(self.max_body)
        if current != self._body_size_limit:
            ctx.options.body_size_limit = self._body_size_limit

    def _load_secret(self, path: str) -> None:
        """Read ``polar_secret_file``; an error stops mitmdump at start (and names the file), and until a later
        value is read every call is refused: a proxy told to check keys never stops checking them."""
        self.secret, self.secret_problem = None, None
        if not path:
            return
        try:
            self.secret = session.read_secret(path)
        except (OSError, ValueError) as e:
            self.secret_problem = f"polar_secret_file {path!r} cannot be read ({e})"
            raise exceptions.OptionsError(
                f"{self.secret_problem}: it must hold the secret session keys are signed with"
            ) from e

    def decode_content(self, data: bytes, encoding: str) -> bytes:
        """A body with its content-encoding undone, bounded by ``polar_max_decoded_mb`` (addon/content.py)."""
        return content.decode(data, encoding, self.max_decoded)

    @property
    def salt(self) -> bytes:
        if self._salt is None:
            try:
                self._salt = _load_salt(Path(ctx.options.polar_dir) / SALT_FILE)
            except OSError as e:  # hashing must not fail: the key would then travel on
                log.error("polar: cannot keep a session salt in polar_dir (%s); key hashes change on restart", e)
                self._salt = secrets.token_bytes(32)
        return self._salt

    def running(self) -> None:
        # --mode regular@HOST:PORT names its own address; --listen-host is the default for the others.
        for host in {mode_specs.ProxyMode.parse(m).listen_host(ctx.options.listen_host) for m in ctx.options.mode}:
            if not _is_loopback(host):
                log.warning(
                    "polar: the proxy listens on %s, beyond loopback; captures hold users' code and prompts. "
                    "Use --listen-host 127.0.0.1 unless other machines must reach it.",
                    host or "all interfaces",
                )
        if "connection_strategy" in ctx.options and ctx.options.connection_strategy == "eager":
            # Eager reverse mode dials the upstream when the client connects and, if that fails,
            # hangs up without an answer or a flow; lazy dials per request, so the refusal
            # reaches the client as a 502 and the record says why.
            ctx.options.connection_strategy = "lazy"
        proxy_errors.install()
        translating.install()  # issue 16: a translated stream the upstream breaks off ends with an error event

    def done(self) -> None:
        if self.writer is not None:
            for ex in list(self._handing_over.values()):  # answered calls whose hand-over the loop did not reach
                self._hand_over(ex)
            self.writer.close()  # bounded, also on a full disk; logs every record it could not write
            self.writer = None

    def health(self, nonce: str | None = None) -> dict[str, Any]:
        """What ``GET /polar/health`` answers: the addon is loaded (with the proof of the client's ``nonce``, see
        addon/health.py), its options, and whether it records."""
        opts = ctx.options
        problem = self._recording_problem()
        writer = self.writer
        return {
            "loaded": True,
            "proof": health.proof(nonce) if nonce is not None else None,
            "format_version": opts.polar_format,
            "options": {
                "polar_dir": str(Path(opts.polar_dir).resolve()),
                "polar_upstream": opts.polar_upstream,
                "polar_translate": opts.polar_translate,
                "polar_model": opts.polar_model,
                "polar_upstream_key_set": bool(opts.polar_upstream_key),
                "polar_format": opts.polar_format,
                "polar_fsync": opts.polar_fsync,
                "polar_rotate_mb": opts.polar_rotate_mb,
                "polar_backlog_mb": opts.polar_backlog_mb,
                "polar_max_body_mb": opts.polar_max_body_mb,
                "polar_secret_file": opts.polar_secret_file,
            },
            "writable": problem is None and _writable_folder(Path(opts.polar_dir)),
            "problem": problem,
            "records_written": writer.records_written if writer else 0,
            "backlog_bytes": writer.backlog_bytes if writer else 0,
            "refused": self.refused,
            "refused_share": self.refused_share,
            "too_large": self.too_large,
            "signed_keys": self.checks_keys,
            "refused_keys": self.refused_keys,
            "capture_file": str(writer.path) if writer and writer.path else None,
        }

    def _recording_problem(self) -> str | None:
        """Why model calls cannot be recorded now, or None."""
        if self.writer is None:
            return "the capture writer is not running"
        if self.writer.failure:
            return f"capture writes fail ({self.writer.failure})"
        if self.writer.folder_removed:  # seen before the next write fails: one stat, on the writer's files only
            return f"the capture folder {self.writer.directory} was removed"
        if self.writer.backlog_bytes > self.backlog_bytes:
            mb = self.writer.backlog_bytes / (1 << 20)
            return f"{mb:.0f} MiB of records wait to be written (polar_backlog_mb={self.backlog_bytes >> 20})"
        return None

    def _over_share(self, session_id: str) -> str | None:
        """Why ``session_id``'s calls are refused while others go on (its records hold more than its share of the
        backlog), or None."""
        if self.writer is None:
            return None
        held, share = self.writer.session_backlog(session_id), self.backlog_bytes // SESSION_SHARE
        if held <= share:
            return None
        return (
            f"{held / (1 << 20):.1f} MiB of its records wait to be written, over its share of "
            f"{share / (1 << 20):.1f} MiB: 1/{SESSION_SHARE} of polar_backlog_mb={self.backlog_bytes >> 20}"
        )

    def _refuse_failed_request(self, flow: http.HTTPFlow, e: Exception) -> None:
        """A request hook that raised: answer the model call here and record why; forward nothing else."""
        ex = flow.metadata.get(METADATA_KEY)
        api = ex.api if isinstance(ex, Exchange) else apis.detect_api(flow.request.path, {}, None)
        if api == apis.OTHER and not isinstance(ex, Exchange) and not self.checks_keys:
            return  # not a model call and not recorded: forwarded untouched, as any unknown path
        if isinstance(e, RecursionError):
            status, message = 400, "the request body is nested too deeply to handle"
        else:
            status, message = 500, f"polar could not handle this request: {type(e).__name__}"
        flow.response = translating.json_response(status, translating.error_body(api, status, message))
        if not isinstance(ex, Exchange) and self.checks_keys:
            return  # answered, not forwarded; no session was accepted, so nothing is recorded in one
        if not isinstance(ex, Exchange):
            path = session.bare_path(flow.request.path)  # no query string nor session prefix: they may hold a key
            ex = Exchange(
                session_id="anonymous",
                session_source="anonymous",
                api=api,
                upstream=self.upstream,
                method=flow.request.method,
                path=path,
                t_start=flow.request.timestamp_start or time.time(),
                request_headers={},
            )
            flow.metadata[METADATA_KEY] = ex
        ex.error = {"kind": "request" if status == 400 else "addon", "message": message}

    @guarded
    def request(self, flow: http.HTTPFlow) -> None:
        # One hook for the whole request: each hook a script defines costs every flow a dispatch.
        if flow.error is not None:
            # Killed by an addon before this one (mitmproxy's refusal of an HTTP/2 prior-knowledge preface,
            # ``PRI *``): it goes nowhere, so there is no call to record (issue 27).
            return
        if flow.request.path.partition("?")[0] == health.PATH and flow.request.method in ("GET", "HEAD"):
            answer = self.health(flow.request.headers.get(health.NONCE_HEADER))
            flow.response = http.Response.make(200, json.dumps(answer), {"content-type": "application/json"})
            return
        route = flow.metadata.get(reroute.ROUTE_KEY)  # None: reverse mode, every call is ours
        if route == reroute.PASS:
            return
        # Capture-only calls go on to the real provider, which needs the harness's own key.
        to_provider = route == reroute.CAPTURE
        headers = {name.lower(): value for name, value in header_items(flow.request.headers).items()}
        if not to_provider:
            for name in session.CREDENTIAL_HEADERS:  # first, so no later failure can forward them
                if name in headers:
                    del flow.request.headers[name]
        found = self._session(headers, flow.request.path)
        if found.refused is not None:  # keys are checked and this one is not a signed key: nothing goes anywhere
            self._refuse_key(flow, found, headers)
            return
        ours: dict[str, str] = {}
        if to_provider:
            flow.request.headers.pop(session.SESSION_HEADER, None)  # ours, not the provider's
        else:
            flow.request.path = found.path
            if self.upstream_key:
                self._set_upstream_key(flow, found.credential_header)
            ours[session.SESSION_HEADER] = found.id
        # The tee must see plain bytes; a gzipped stream could not be recorded chunk by chunk.
        ours["accept-encoding"] = "identity"
        set_headers(flow.request.headers, ours)
        data = flow.request.raw_content or b""
        if "content-encoding" in headers:
            try:
                data = self.decode_content(data, headers["content-encoding"])
            except content.TooLarge as e:  # a gzip bomb: never forwarded, never decoded past the bound
                self._refuse_too_large(flow, found, headers, e)
                return
            except content.Undecodable:  # an encoding we cannot undo: record the bytes as sent
                pass
        # A call to translate reads its whole body; the others only its top-level fields.
        to_translate = (
            self.translate and not to_provider and apis.detect_api(found.path, headers, None) in apis.TRANSLATED
        )
        request = Body.parse(data) if to_translate else self.resent.parse(found.id, data)
        api = apis.detect_api(found.path, headers, request.value)
        if route == reroute.REROUTE and not reroute.is_model_call(flow.request.method, api):
            flow.response = reroute.local_answer(flow.request)  # not a model call: unrecorded, never forwarded
            return
        upstream = "plain" if to_provider else self.upstream
        ex = Exchange(
            session_id=found.id,
            session_source=found.source,
            api=api,
            upstream=upstream,
            method=flow.request.method,
            path=found.path,
            t_start=flow.request.timestamp_start or time.time(),
            request_headers=session.recordable_headers(headers),
            request=request,
        )
        if problem := self._recording_problem():
            # Refused and counted, not recorded: a refusal kept with its body would fill the memory the
            # backlog needs. Paths the addon does not know are refused too: nothing it records goes unrecorded.
            self.refused += 1
            message = f"polar is not recording ({problem}); refusing calls until it is"
            flow.response = translating.json_response(503, translating.error_body(ex.api, 503, message))
            return
        if problem := self._over_share(found.id):  # this session's records flood the backlog: only its calls wait
            self.refused_share += 1
            message = f"polar refuses this session's calls until more of its records are written ({problem})"
            flow.response = translating.json_response(503, translating.error_body(ex.api, 503, message))
            return
        flow.metadata[METADATA_KEY] = ex
        if request.too_deep and api != apis.OTHER:  # json.loads gave up: answered and recorded, never forwarded
            message = "the request body is JSON nested too deeply to handle"
            flow.response = translating.json_response(400, translating.error_body(api, 400, message))
            ex.error = {"kind": "request", "message": message}
            return
        self._rewrite(flow, ex, headers, data, to_provider)
        if self.clamp and not to_provider and self.upstream != "plain":
            self._clamp(flow, ex)
        if not to_provider:  # a provider's own decoding is not ours to judge; its records are retokenized anyway
            sent = ex.upstream_request if ex.upstream_request is not None else ex.request
            ex.constrained = constrained.constraints(sent.value)
        # The record keeps the body's bytes; the parsed copy would double what a large body costs.
        for kept in (ex.request, ex.upstream_request):
            if kept is not None and kept.json_bytes is not None:
                kept.value = None

    @property
    def checks_keys(self) -> bool:
        """``polar_secret_file`` is set: only signed keys name a session (refused all while it cannot be read)."""
        return self.secret is not None or self.secret_problem is not None

    def _session(self, headers: dict[str, str], path: str) -> session.Session:
        if self.secret is not None:
            return session.resolve(headers, path, b"", self.secret)  # no key is hashed: the salt is not read
        if self.secret_problem is not None:
            path = session.resolve(headers, path, b"").path  # without the prefix and ?key=; nothing verifies
            return session.Session("", "refused", path, None, refused=self.secret_problem)
        return session.resolve(headers, path, self.salt)

    def _refuse_key(self, flow: http.HTTPFlow, found: session.Session, headers: dict[str, str]) -> None:
        """Answer 403 in the API's shape, count it, log the session it claimed (never its key), record nothing."""
        self.refused_keys += 1
        log.warning(
            "polar: refused %s %s claiming session %s: %s (%d refused so far)",
            flow.request.method,
            found.path.partition("?")[0],
            found.claimed or "(none)",
            found.refused,
            self.refused_keys,
        )
        flow.request.path = found.path  # no session prefix, no ?key=: whatever logs the flow sees no key
        message = f"polar: this proxy takes only signed session keys; refused: {found.refused}"
        flow.response = translating.json_response(
            403, _error_body(apis.detect_api(found.path, headers, None), 403, message)
        )

    def _refuse_too_large(
        self, flow: http.HTTPFlow, found: session.Session, headers: dict[str, str], e: content.TooLarge
    ) -> None:
        """Answer 413 in the API's shape and record why (the body is not kept: it may be the bomb itself)."""
        api = apis.detect_api(found.path, headers, None)
        flow.response = translating.json_response(413, translating.error_body(api, 413, str(e)))
        flow.metadata[METADATA_KEY] = Exchange(
            session_id=found.id,
            session_source=found.source,
            api=api,
            upstream=self.upstream,
            method=flow.request.method,
            path=found.path,
            t_start=flow.request.timestamp_start or time.time(),
            request_headers=session.recordable_headers(headers),
            error={"kind": "request", "message": str(e)},
        )

    def _rewrite(
        self, flow: http.HTTPFlow, ex: Exchange, headers: dict[str, str], data: bytes, to_provider: bool
    ) -> None:
        """Translate a native call, or add the token fields to a chat (or vLLM Responses) call."""
        upstream = ex.upstream
        body = ex.request.value
        if ex.api in apis.TRANSLATED and self.translate and not to_provider and flow.request.method == "POST":
            ex.request.full()  # a translation reads the whole conversation
            translating.translate_request(flow, ex, headers, self.native_options)
        elif isinstance(body, dict) and (ex.api == "chat" or (ex.api == "responses" and upstream == "vllm")):
            added = chat.token_fields(body, upstream) if ex.api == "chat" else responses.vllm_token_fields(body)
            if added and any(key.partition(".")[0] in body for key in added):
                body = ex.request.full()  # splice re-serialises the whole body to change a field the client sent
            if added:
                sent, pure_addition = chat.splice(data, body, added)
                _set_content(flow.request, sent, headers)
                ex.injected = added
                if not pure_addition:
                    ex.upstream_request = Body.parse(sent)

    def _clamp(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        """Cut the output cap of a Chat Completions body bound upstream to the model's context (addon/clamp.py)."""
        translated = flow.metadata.get(translating.TRANSLATION_KEY) is not None
        if not (translated or (ex.api == "chat" and flow.request.method == "POST")):
            return
        sent = ex.upstream_request if ex.upstream_request is not None else ex.request
        field = clamp.cap_field(sent.value)
        if field is None:
            return
        assert isinstance(sent.value, dict)  # cap_field found a field in it
        url, model = clamp.models_url(flow.request.url), sent.value.get("model")
        model = model if isinstance(model, str) else ""
        flow.metadata[CAP_KEY] = (url, model)  # a refusal that names the context teaches it (response hook)
        auth = {
            k: v for k, v in header_items(flow.request.headers).items() if k.lower() in ("authorization", "x-api-key")
        }
        length = self.context_lengths.length(url, model, auth, verify=not ctx.options.ssl_insecure)
        asked = sent.value[field]
        if length is None or asked <= length:
            return
        body = sent.full() if sent is ex.upstream_request else merge_fields(ex.request.full(), ex.injected)
        body = {**body, field: length}
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        flow.request.content = data
        ex.upstream_request = Body.parse(data)
        ex.clamped = {"field": field, "asked": asked, "sent": length}

    def _set_upstream_key(self, flow: http.HTTPFlow, where: str | None) -> None:
        if where == "query":
            flow.request.query["key"] = self.upstream_key
        elif where in apis.CREDENTIAL_HEADERS and where != "authorization":
            flow.request.headers[where] = self.upstream_key
        else:
            flow.request.headers["authorization"] = f"Bearer {self.upstream_key}"

    @guarded
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        ex = flow.metadata.get(METADATA_KEY)
        if not isinstance(ex, Exchange) or flow.response is None:
            return
        ex.t_first_byte = time.time()
        ex.status = flow.response.status_code
        items = header_items(flow.response.headers)
        ex.response_headers = _recordable_response_headers(items)
        lower = {name.lower(): value for name, value in items.items()}
        ex.streamed = lower.get("content-type", "").startswith("text/event-stream")
        ex.content_encoding = lower.get("content-encoding", "")
        # Only event streams are teed: mitmproxy forwards a JSON answer in one piece once it is
        # complete anyway, and streaming it chunk-wise costs ~2 ms per call on loopback.
        translation = flow.metadata.get(translating.TRANSLATION_KEY)
        if ex.streamed and translation is not None:
            flow.response.headers.pop("content-length", None)  # the client's events differ in size
            flow.response.headers["cache-control"] = "no-cache"
            flow.response.stream = translating.TranslatingTee(ex, translation)
        elif ex.streamed:
            flow.response.stream = Tee(ex)

    @guarded
    def response(self, flow: http.HTTPFlow) -> None:
        ex = flow.metadata.get(METADATA_KEY)
        if not isinstance(ex, Exchange) or flow.response is None:
            return
        if ex.status is None:  # answered by the addon itself, without an upstream
            ex.status = flow.response.status_code
            ex.response_headers = _recordable_response_headers(header_items(flow.response.headers))
        if not ex.streamed:  # buffered by mitmproxy, still content-encoded: encode() undoes that
            ex.chunks, ex.chunk_times = [flow.response.raw_content or b""], [time.time()]
            if ex.status == 400 and (cap := flow.metadata.get(CAP_KEY)) is not None:
                url, model = cap
                self.context_lengths.learn(url, model, flow.response.get_text(strict=False) or "")
            if (translation := flow.metadata.get(translating.TRANSLATION_KEY)) is not None:
                translating.translate_answer(flow, ex, translation, self.decode_content)
        ex.complete = ex.error is None
        self._submit(ex)

    @guarded
    def error(self, flow: http.HTTPFlow) -> None:
        message = flow.error.msg if flow.error else "unknown error"
        if message.startswith(TOO_LARGE_ERROR):  # mitmproxy refused the body (body_size_limit) before our request hook
            self.too_large += 1
            log.warning(
                "polar: refused %s %s: its body is over polar_max_body_mb=%d (%d refused so far)",
                flow.request.method,
                session.bare_path(flow.request.path),
                self.max_body >> 20,
                self.too_large,
            )
            return
        ex = flow.metadata.get(METADATA_KEY)
        if not isinstance(ex, Exchange):
            return
        # Before response headers the upstream failed us; after them, whoever hung up (issue 16).
        upstream_side = ex.status is None or _upstream_broke_off(flow, message)
        wire_api = "chat" if flow.metadata.get(translating.TRANSLATION_KEY) is not None else ex.api
        if not upstream_side and ex.error is None and apis.stream_ended(wire_api, ex.chunks):
            # SDKs hang up once they read the final event, sometimes before the upstream's
            # end-of-body reaches the proxy: nothing was lost, the exchange is complete.
            ex.complete = True
        else:
            ex.error = ex.error or {"kind": "upstream" if upstream_side else "client", "message": message}
            ex.complete = False
        self._submit(ex)

    def _submit(self, ex: Exchange) -> None:
        if ex.written:
            return
        if self.writer is None:  # an exchange ending after shutdown began: say so, never lose it silently
            log.error(
                "polar: NOT WRITTEN: record %s (session %s, %s): it ended after shutdown", ex.id, ex.session_id, ex.api
            )
            return
        ex.written = True
        ex.t_end = time.time()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a hook called directly, outside mitmproxy
            self.writer.submit(ex)
            return
        # Hand over once this event-loop step is done: mitmproxy sends the answer to the client
        # after the response hook, and a writer woken now would compete with that for the GIL.
        self._handing_over[ex.id] = ex
        loop.call_soon(self._hand_over, ex)

    def _hand_over(self, ex: Exchange) -> None:
        if self._handing_over.pop(ex.id, None) is not None and self.writer is not None:
            self.writer.submit(ex)


def _error_body(api: str, status: int, message: str) -> dict[str, Any]:
    """``translating.error_body``, with a Chat Completions refusal typed for what it is, not as the upstream's."""
    if api in apis.TRANSLATED:
        return translating.error_body(api, status, message)
    return chat.error_body(status, message, "permission_error" if status == 403 else "upstream_error")


def _load_salt(path: Path) -> bytes:
    """A per-folder secret for hashing API keys: stable across restarts, so one key is one session."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        salt = secrets.token_bytes(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another proxy on this folder won the race
            return path.read_bytes()
        with os.fdopen(fd, "wb") as f:
            f.write(salt)
        return salt


def _writable_folder(directory: Path) -> bool:
    """The capture folder, or the nearest folder above it that exists (it is created with the first record), is
    writable."""
    for folder in (directory, *directory.resolve().parents):
        if folder.exists():
            return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
    return False


def _recordable_response_headers(items: dict[str, str]) -> dict[str, str]:
    # A real provider (capture-only mode) sets cookies; like the client's, they stay off disk.
    return {k: v for k, v in items.items() if k.lower() != "set-cookie"}


def header_items(headers: http.Headers) -> dict[str, str]:
    """``dict(headers.items())`` (a name as first sent, repeated values joined with ", "), read from the raw
    fields in one pass: mitmproxy's ``items()`` looks every name up again across all fields."""
    items: dict[str, str] = {}
    first: dict[str, str] = {}  # lower-case name -> the name as first sent
    for raw_name, raw_value in headers.fields:
        name = raw_name.decode("utf-8", "surrogateescape")  # as mitmproxy decodes header names and values
        value = raw_value.decode("utf-8", "surrogateescape")
        name = first.setdefault(name.lower(), name)
        items[name] = f"{items[name]}, {value}" if name in items else value
    return items


def _set_content(request: http.Request, data: bytes, headers: dict[str, str]) -> None:
    """``request.content = data`` without its header look-ups where the client sent no content-encoding
    (``headers``: the client's, lower-case names)."""
    if "content-encoding" in headers:
        request.content = data  # encoded again as the client sent it
        return
    request.raw_content = data
    if "transfer-encoding" not in headers:
        set_headers(request.headers, {"content-length": str(len(data))})


def set_headers(headers: http.Headers, values: dict[str, str]) -> None:
    """``headers[name] = value`` for each of ``values`` (lower-case names) in one pass over the fields, as
    mitmproxy sets one: the first field of a name takes the value in place, its repeats go, a new name is added at
    the end. (mitmproxy's own setter rebuilds the fields once per header.)"""
    new = {name.encode(): value.encode("utf-8", "surrogateescape") for name, value in values.items()}
    fields: list[tuple[bytes, bytes]] = []
    taken: set[bytes] = set()
    for name, value in headers.fields:
        key = name.lower()
        if key not in new:
            fields.append((name, value))
        elif key not in taken:
            fields.append((name, new[key]))
            taken.add(key)
    headers.fields = (*fields, *((name, value) for name, value in new.items() if name not in taken))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _upstream_broke_off(flow: http.HTTPFlow, message: str) -> bool:
    """Whether a stream broke on the upstream's side: mitmproxy names the client when it hangs up ("Client
    disconnected.", "stream reset by client"); otherwise a client still connected did not break it (the upstream's
    cut reads as an HTTP/1 protocol error: "peer closed connection without sending complete message body")."""
    if "client" in message.lower():
        return False
    return "server" in message.lower() or bool(flow.client_conn.state & connection.ConnectionState.CAN_READ)


# Reroute first: it marks each flow (and rewrites rerouted ones) before Polar's request hook reads it.
addons = [reroute.Reroute(), Polar()]
