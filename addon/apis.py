"""The wire APIs a harness may speak through the proxy: one entry each, read by everything that tells them apart.

A record's ``api`` is an entry's ``name``. Who reads what:

- ``addon/polar.py``: :func:`detect_api` (by path, then header, then body shape) and :func:`stream_ended` (the
  stream's last event tells a client that hung up after the end from one that cut the stream);
- ``addon/reroute.py``: every entry is a model call on a rerouted host (anything else there gets an empty local
  answer), and a bare ``polar_reroute`` URL stands for :data:`PROVIDER_HOSTS`;
- ``addon/session.py``: :data:`CREDENTIAL_HEADERS`, dropped before anything is forwarded or recorded;
- ``addon/translating.py``: an entry's ``translator`` answers the API through the upstream's Chat Completions;
- ``reconstruct/_extract.py``: a record of a translated API carries its Chat Completions exchange, and the
  translator's ``to_chat_completion`` converts one passed through untranslated.

Adding an API is one :class:`WireAPI` here and its translator module (contract: ``addon/native.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from addon import anthropic, chat, google, native, responses


@dataclass(frozen=True)
class WireAPI:
    name: str  # the record's ``api``
    is_path: Callable[[str], bool]  # the request path (no query string, no trailing "/") is one of this API's
    header: str | None  # a request header only this API sends (Claude Code's probes at "/" carry it)
    is_body: Callable[[dict[str, Any], str], bool] | None  # (body, path): a body shape specific to this API
    stream_end: bytes  # the last event of a finished stream, as it appears in the stream's bytes
    hosts: tuple[str, ...]  # the provider's API hosts (transparent mode)
    credential: str  # the header the client's key comes in (a ``?key=`` query parameter is removed for any API)
    translator: native.Translator | None  # None: Chat Completions itself, passed through with the token fields


def _ends(*suffixes: str) -> Callable[[str], bool]:
    return lambda path: path.endswith(suffixes)


# In the order body shapes are tried, the most specific first (embeddings also send "input"; Anthropic bodies
# have "messages" and "model" too, and are told by path or header).
APIS = (
    WireAPI(
        name="anthropic",
        is_path=_ends("/messages", "/messages/count_tokens"),
        header="anthropic-version",
        is_body=None,
        stream_end=b"message_stop",
        hosts=("api.anthropic.com",),
        credential="x-api-key",
        translator=anthropic,
    ),
    WireAPI(
        name="google",
        is_path=_ends(":generateContent", ":streamGenerateContent"),
        header=None,
        is_body=lambda body, path: "contents" in body,
        stream_end=b'"finishReason"',
        hosts=("generativelanguage.googleapis.com",),
        credential="x-goog-api-key",
        translator=google,
    ),
    WireAPI(
        name="responses",
        is_path=_ends("/responses"),
        header=None,
        is_body=lambda body, path: "input" in body and "instructions" in body,
        stream_end=b"response.completed",
        hosts=("api.openai.com",),
        credential="authorization",
        translator=responses,
    ),
    WireAPI(
        name="chat",
        is_path=chat.is_chat_path,
        header=None,
        is_body=lambda body, path: (
            "messages" in body and "model" in body and not path.endswith(("/embeddings", "/completions"))
        ),
        stream_end=b"data: [DONE]",
        hosts=("api.openai.com",),
        credential="authorization",
        translator=None,
    ),
)
BY_NAME = {api.name: api for api in APIS}
OTHER = "other"  # the ``api`` of a request no entry claims: forwarded and recorded, never translated

PROVIDER_HOSTS = tuple(dict.fromkeys(host for api in APIS for host in api.hosts))
CREDENTIAL_HEADERS = tuple(dict.fromkeys(api.credential for api in APIS))
TRANSLATED = {api.name: api.translator for api in APIS if api.translator is not None}


def detect_api(path: str, headers: dict[str, str], body: Any) -> str:
    """The wire API of a request: by path, then by header, then by body shape; :data:`OTHER` when none claims it.

    ``headers`` have lower-case names; ``body`` is the parsed JSON body (anything else is no body shape)."""
    base = path.partition("?")[0].rstrip("/")
    for api in APIS:
        if api.is_path(base):
            return api.name
    if isinstance(body, dict):  # not Claude Code's HEAD / probe, which carries anthropic-version without a body
        for api in APIS:
            if api.header is not None and api.header in headers:
                return api.name
        for api in APIS:
            if api.is_body is not None and api.is_body(body, base):
                return api.name
    return OTHER


def stream_ended(api: str, chunks: list[bytes]) -> bool:
    """Whether the stream's bytes so far end with the API's last event (looked for in the last few KiB)."""
    entry = BY_NAME.get(api)
    tail = b"".join(chunks[-3:])[-4096:]
    return entry is not None and entry.stream_end in tail
