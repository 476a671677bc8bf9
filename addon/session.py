"""Which session a request belongs to, and keeping the client's credentials off disk and away from upstream.

Harnesses cannot be told to send a session id, but every one of them sends an API key, so the
rollout runner sets the key to the session id. The order of precedence:

1. header ``x-polar-session``;
2. a path prefix ``/s/<id>/...`` (stripped before forwarding);
3. the API key (``Authorization: Bearer``, ``x-api-key``, ``x-goog-api-key``, or a query parameter
   named like a key: ``?key=``, ``?api_key=``, ``?access_token=``, ... in any casing) when it looks
   like a session id and not like a provider secret;
4. else a salted hash of the key (``key-<16 hex>``): calls with one real key group together, and
   the key itself never reaches disk;
5. else ``anonymous``.

A header or path session id that looks like a provider secret (``sk-...``, ``xoxb-...``) is hashed the
same way (``key_hash``), and every key-like query parameter is removed from the path, so no secret given
in any of these places reaches disk. A header or path session id that is not a valid id (longer than 128
characters, control characters, ``../``, ...) is hashed into a session of its own (``id_hash``): filing it
under the shared ``anonymous`` would mix unrelated calls into one session (issue 27).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode

from addon import apis

SESSION_HEADER = "x-polar-session"
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
PATH_PREFIX = re.compile(r"^/s/([^/?]+)(/.*|$)")
# Prefixes of real provider keys (OpenAI, Anthropic, Google, GitHub, Hugging Face, xAI, Groq, Slack, GitLab,
# AWS, Stripe, ...): such a key is a secret even when it matches SESSION_ID, so it is hashed, never stored.
SECRET_PREFIXES = (
    "sk-", "sk_", "rk_", "AIza", "ya29.", "ghp_", "gho_", "ghs_", "ghu_", "ghr_", "github_pat_", "glpat-", "hf_",
    "xai-", "gsk_", "r8_", "pplx-", "nvapi-", "eyJ", "xoxa-", "xoxb-", "xoxe-", "xoxp-", "xoxr-", "xoxs-", "xapp-",
    "AKIA", "ASIA", "npm_", "pypi-", "shpat_", "dop_v1_",
)  # fmt: skip
# Query parameters that carry credentials, compared lower-cased with "-" read as "_".
SECRET_QUERY_NAMES = frozenset(
    ("key", "api_key", "apikey", "x_api_key", "access_token", "accesstoken", "token", "auth", "auth_token",
     "id_token", "refresh_token", "session_token", "secret", "client_secret", "password", "bearer")
)  # fmt: skip
CREDENTIAL_HEADERS = apis.CREDENTIAL_HEADERS  # each wire API's key header
# Never recorded: credentials and cookies.
PRIVATE_HEADERS = frozenset((*CREDENTIAL_HEADERS, "cookie", "proxy-authorization", "api-key"))


@dataclass(frozen=True)
class Session:
    id: str
    source: str  # header | path | api_key | key_hash | id_hash | anonymous
    path: str  # the request path with a session prefix and any ?key= removed
    credential_header: str | None  # where the client put its key, so the upstream key goes there too


def is_session_id(value: str) -> bool:
    return SESSION_ID.fullmatch(value) is not None


def looks_secret(key: str) -> bool:
    return key.startswith(SECRET_PREFIXES)


def resolve(headers: dict[str, str], path: str, salt: bytes) -> Session:
    """``headers`` with lower-case names; ``path`` with its query string."""
    path, query_key = _pop_query_key(path)
    path_id = None
    if m := PATH_PREFIX.match(path):
        path_id, path = m.group(1), m.group(2) or "/"
    key, credential_header = _client_key(headers, query_key)

    explicit = headers.get(SESSION_HEADER, "").strip()
    for given, source in ((explicit, "header"), (path_id, "path")):
        if not given:
            continue
        if looks_secret(given):  # a key pasted where the session id goes
            return Session(key_hash(given, salt), "key_hash", path, credential_header)
        if not is_session_id(given):  # too long, control characters, "../": its own session, never anonymous
            return Session(id_hash(given, salt), "id_hash", path, credential_header)
        return Session(given, source, path, credential_header)
    if key and is_session_id(key) and not looks_secret(key):
        return Session(key, "api_key", path, credential_header)
    if key:
        return Session(key_hash(key, salt), "key_hash", path, credential_header)
    return Session("anonymous", "anonymous", path, credential_header)


def key_hash(key: str, salt: bytes) -> str:
    digest = hashlib.sha256(salt + key.encode("utf-8", "surrogateescape")).hexdigest()
    return f"key-{digest[:16]}"


def id_hash(given: str, salt: bytes) -> str:
    """The session of an invalid session id: one per distinct id, none shared, no raw bytes on disk."""
    digest = hashlib.sha256(salt + b"id:" + given.encode("utf-8", "surrogateescape")).hexdigest()
    return f"id-{digest[:16]}"


def _client_key(headers: dict[str, str], query_key: str | None) -> tuple[str | None, str | None]:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip(), "authorization"
    for name in CREDENTIAL_HEADERS:
        if name != "authorization" and (value := headers.get(name, "").strip()):  # the key as it is
            return value, name
    if query_key:
        return query_key, "query"
    return None, None


def is_secret_query_name(name: str) -> bool:
    return name.strip().lower().replace("-", "_") in SECRET_QUERY_NAMES


def _pop_query_key(path: str) -> tuple[str, str | None]:
    """Remove every key-like parameter (``key=``, Google's; ``api_key=``, ``TOKEN=``, ...) from the
    query string; the first non-empty one, ``key`` preferred, is the client's key."""
    base, sep, query = path.partition("?")
    if not sep:
        return path, None
    pairs = parse_qsl(query, keep_blank_values=True)
    secret = [(k.strip().lower(), v) for k, v in pairs if is_secret_query_name(k)]
    if not secret:
        return path, None
    key = next((v for k, v in secret if k == "key" and v), None) or next((v for _, v in secret if v), None)
    rest = [(k, v) for k, v in pairs if not is_secret_query_name(k)]
    return (base + "?" + urlencode(rest) if rest else base), key


def recordable_headers(headers: dict[str, str]) -> dict[str, str]:
    """Headers without credentials and cookies, and without a session header that holds a secret."""
    kept = {k: v for k, v in headers.items() if k not in PRIVATE_HEADERS}
    given = kept.get(SESSION_HEADER)
    if given is not None and (looks_secret(given.strip()) or not is_session_id(given.strip())):
        del kept[SESSION_HEADER]  # the record's session_id says which session it was
    return kept
