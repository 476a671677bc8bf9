import pytest

from addon.session import is_session_id, looks_secret, recordable_headers, resolve

SALT = b"salt"


def test_header_wins_over_path_and_key():
    s = resolve({"x-polar-session": "hdr", "authorization": "Bearer key1"}, "/s/pathid/v1/chat/completions", SALT)
    assert (s.id, s.source, s.path) == ("hdr", "header", "/v1/chat/completions")


def test_path_prefix_is_stripped():
    s = resolve({}, "/s/run-7.a_b/v1/chat/completions?x=1", SALT)
    assert (s.id, s.source, s.path) == ("run-7.a_b", "path", "/v1/chat/completions?x=1")


@pytest.mark.parametrize(
    ("headers", "path", "where"),
    [
        ({"authorization": "Bearer sess-1"}, "/v1/chat/completions", "authorization"),
        ({"x-api-key": "sess-1"}, "/v1/messages", "x-api-key"),
        ({"x-goog-api-key": "sess-1"}, "/v1beta/models/m:generateContent", "x-goog-api-key"),
        ({}, "/v1beta/models/m:generateContent?key=sess-1&alt=sse", "query"),
    ],
)
def test_api_key_that_looks_like_a_session(headers, path, where):
    s = resolve(headers, path, SALT)
    assert (s.id, s.source, s.credential_header) == ("sess-1", "api_key", where)
    assert "key=" not in s.path


@pytest.mark.parametrize("key", ["sk-proj-abc123", "sk-ant-api03-xyz", "AIzaSyA-123", "has space", "x" * 200])
def test_secret_or_odd_key_is_hashed(key):
    s = resolve({"authorization": f"Bearer {key}"}, "/v1/chat/completions", SALT)
    assert s.source == "key_hash" and s.id.startswith("key-") and key not in s.id
    assert s.id == resolve({"x-api-key": key}, "/", SALT).id  # stable per key and salt
    assert s.id != resolve({"x-api-key": key}, "/", b"other").id


def test_no_key_is_anonymous():
    s = resolve({}, "/v1/chat/completions", SALT)
    assert (s.id, s.source) == ("anonymous", "anonymous")


def test_query_key_removed_keeps_other_params():
    s = resolve({}, "/v1beta/models/m:streamGenerateContent?alt=sse&key=AIzaSecret", SALT)
    assert s.path == "/v1beta/models/m:streamGenerateContent?alt=sse"
    assert s.source == "key_hash"


def test_invalid_explicit_session_falls_through():
    s = resolve({"x-polar-session": "../etc"}, "/v1/chat/completions", SALT)
    assert s.source == "anonymous"


def test_helpers():
    assert is_session_id("a" * 128) and not is_session_id("a" * 129) and not is_session_id("-a")
    assert looks_secret("sk-ant-1") and not looks_secret("session-1")
    assert recordable_headers({"authorization": "x", "cookie": "c", "x-api-key": "k", "user-agent": "u"}) == {
        "user-agent": "u"
    }
