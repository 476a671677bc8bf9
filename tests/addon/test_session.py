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


@pytest.mark.parametrize(
    ("headers", "path"),
    [
        ({"x-polar-session": "../etc"}, "/v1/chat/completions"),
        ({"x-polar-session": "s" * 65536}, "/v1/chat/completions"),
        ({"x-polar-session": "run-1\x00\x1b[2J"}, "/v1/chat/completions"),
        ({}, "/s/..%2F..%2Fetc/v1/chat/completions"),
        ({}, "/s/" + "p" * 300 + "/v1/chat/completions"),
    ],
)
def test_issue27_an_invalid_session_id_is_hashed_into_its_own_session_never_anonymous(headers, path):
    s = resolve(headers, path, SALT)
    given = headers.get("x-polar-session") or path.split("/")[2]
    assert s.source == "id_hash" and s.id.startswith("id-") and given not in s.id and is_session_id(s.id)
    assert s.id == resolve(headers, path, SALT).id  # one id, one session
    other = resolve({k: v + "x" for k, v in headers.items()}, path.replace("/v1", "x/v1", 1), SALT)
    assert other.id != s.id and other.source == "id_hash"  # another invalid id: another session


@pytest.mark.parametrize("token", ["xoxb-1234-5678-abcdef", "xoxp-12-34-ab", "xapp-1-A0-12-ab", "glpat-abcdef"])
def test_issue27_slack_style_tokens_are_hashed_as_secrets(token):
    for headers, path in (
        ({"authorization": f"Bearer {token}"}, "/v1/chat/completions"),
        ({"x-polar-session": token}, "/v1/chat/completions"),
        ({}, f"/s/{token}/v1/chat/completions"),
    ):
        s = resolve(headers, path, SALT)
        assert s.source == "key_hash" and token not in s.id


def test_helpers():
    assert is_session_id("a" * 128) and not is_session_id("a" * 129) and not is_session_id("-a")
    assert looks_secret("sk-ant-1") and not looks_secret("session-1")
    assert recordable_headers({"authorization": "x", "cookie": "c", "x-api-key": "k", "user-agent": "u"}) == {
        "user-agent": "u"
    }
