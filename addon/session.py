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

Signed keys (issue 34). Anything that can reach a proxy could otherwise write into any session whose id it can
guess. With the addon's ``polar_secret_file`` set, the key a harness gets is :func:`signed_key`:
``<session_id>~<tag>``, ``tag`` the first 32 hex digits of HMAC-SHA256(secret, session_id) (``~`` is outside the
session-id characters, so the split is unambiguous). It goes wherever a session id goes today (the header, the path
prefix, any of the key headers or query parameters; the same order decides which one is read), and
:func:`resolve` given the ``secret`` accepts only a key whose tag :func:`verify_key` checks (a constant-time
compare). The session of an accepted call is the id part; the tag never reaches disk. Anything else (an unsigned
id, a wrong tag, a provider key, no key at all) comes back with ``refused`` set and ``claimed`` the id it named
(never the key), and the addon answers it 403 itself: never forwarded, never recorded, counted. Without a secret
nothing above changes. :func:`read_secret` reads the file for both the addon and the code that signs keys.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path
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


TAG_SEPARATOR = "~"  # not a session-id character
TAG_HEX = 32  # hex digits of the HMAC-SHA256 a signed key carries
SIGNED_FORM = re.compile(SESSION_ID.pattern + TAG_SEPARATOR + f"[0-9a-f]{{{TAG_HEX}}}")  # shape only, unverified


@dataclass(frozen=True)
class Session:
    id: str
    source: str  # header | path | api_key | key_hash | id_hash | anonymous | refused
    path: str  # the request path with a session prefix and any ?key= removed
    credential_header: str | None  # where the client put its key, so the upstream key goes there too
    refused: str | None = None  # signed keys required and none valid: why (``id`` is then empty)
    claimed: str | None = None  # the session id a refused key named, when it named a valid one (never the key)


def is_session_id(value: str) -> bool:
    return SESSION_ID.fullmatch(value) is not None


def looks_secret(key: str) -> bool:
    return key.startswith(SECRET_PREFIXES)


def session_tag(session_id: str, secret: bytes) -> str:
    """The tag of ``session_id``'s signed key: the first :data:`TAG_HEX` hex digits of HMAC-SHA256(secret, id)."""
    return hmac.new(secret, session_id.encode("utf-8"), hashlib.sha256).hexdigest()[:TAG_HEX]


def signed_key(session_id: str, secret: bytes) -> str:
    """The key to give a harness for ``session_id`` when the addon checks keys: ``<session_id>~<tag>``."""
    if not is_session_id(session_id):
        raise ValueError(f"not a session id: {session_id!r}")
    if not secret:
        raise ValueError("an empty secret signs nothing")
    return f"{session_id}{TAG_SEPARATOR}{session_tag(session_id, secret)}"


def verify_key(key: str, secret: bytes) -> str | None:
    """The session id of ``key`` if it is that id's signed key under ``secret``, else None (constant-time compare)."""
    session_id, sep, tag = key.partition(TAG_SEPARATOR)
    if not sep or not is_session_id(session_id):
        return None
    expected = session_tag(session_id, secret).encode("ascii")
    # Bytes, so a tag with any characters compares (str operands must be ASCII); a length differing is no secret.
    return session_id if hmac.compare_digest(expected, tag.encode("utf-8", "surrogateescape")) else None


def is_signed_form(value: str) -> bool:
    """``value`` has a signed key's shape (``<session_id>~<32 hex>``); whether the tag is right, :func:`verify_key`
    says."""
    return SIGNED_FORM.fullmatch(value) is not None


def claimed_id(key: str) -> str | None:
    """The session id a key names, to log or count (``<id>`` of ``<id>~<anything>``, or the key itself): None for
    a provider key or anything that is not a valid id, which must not reach a log."""
    given = key.partition(TAG_SEPARATOR)[0]
    return given if is_session_id(given) and not looks_secret(given) else None


def read_secret(path: str | Path) -> bytes:
    """The secret in ``path`` (its bytes without surrounding whitespace): the addon's and the signer's reading of
    one ``polar_secret_file``. Raises OSError, or ValueError for a file that holds nothing."""
    secret = Path(path).read_bytes().strip()
    if not secret:
        raise ValueError(f"the secret file {str(path)!r} is empty")
    return secret


def bare_path(path: str) -> str:
    """``path`` without what may hold a key: its query string and a session prefix (for logs and refusals)."""
    path = path.partition("?")[0]
    if m := PATH_PREFIX.match(path):
        path = m.group(2) or "/"
    return path


def resolve(headers: dict[str, str], path: str, salt: bytes, secret: bytes | None = None) -> Session:
    """``headers`` with lower-case names; ``path`` with its query string. With ``secret``, only a signed key
    (:func:`verify_key`) names a session; anything else is a :class:`Session` with ``refused`` set."""
    path, query_key = _pop_query_key(path)
    path_id = None
    if m := PATH_PREFIX.match(path):
        path_id, path = m.group(1), m.group(2) or "/"
    key, credential_header = _client_key(headers, query_key)

    explicit = headers.get(SESSION_HEADER, "").strip()
    if secret is not None:
        return _resolve_signed(
            ((explicit, "header"), (path_id, "path"), (key, "api_key")), path, credential_header, secret
        )
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


def _resolve_signed(
    given: tuple[tuple[str | None, str], ...], path: str, credential_header: str | None, secret: bytes
) -> Session:
    """The first key given, in the order of precedence, must be a signed one; the others are not read."""
    key, source = next(((k, src) for k, src in given if k), (None, "anonymous"))
    if key is None:
        return Session("", "refused", path, credential_header, refused="no key")
    if source == "path":
        key = key.replace("%7E", TAG_SEPARATOR).replace("%7e", TAG_SEPARATOR)  # a client that quoted the "~"
    if (session_id := verify_key(key, secret)) is not None:
        return Session(session_id, source, path, credential_header)
    claimed = claimed_id(key)
    if claimed is None:
        reason = "a provider key" if looks_secret(key) else "not a session key"
    else:
        reason = "a wrong tag" if TAG_SEPARATOR in key else "an unsigned session id"
    where = {"header": SESSION_HEADER, "path": "/s/<id>/ path"}.get(source) or f"{credential_header} key"
    return Session("", "refused", path, credential_header, refused=f"{reason} in the {where}", claimed=claimed)


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
