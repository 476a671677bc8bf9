import hashlib
import hmac

import pytest

from addon.session import (
    is_session_id,
    is_signed_form,
    looks_secret,
    read_secret,
    recordable_headers,
    resolve,
    signed_key,
    verify_key,
)

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


# Issue 34: signed keys. A key a harness gets is <session_id>~<tag>; with a secret, nothing else names a session.
SECRET = b"0123456789abcdef" * 4


def test_issue34_signed_key_is_the_id_and_its_hmac_tag():
    key = signed_key("run-1.a_b", SECRET)
    session_id, sep, tag = key.partition("~")
    assert (session_id, sep) == ("run-1.a_b", "~") and len(tag) == 32 and tag == tag.lower()
    assert tag == hmac.new(SECRET, b"run-1.a_b", hashlib.sha256).hexdigest()[:32]
    assert verify_key(key, SECRET) == "run-1.a_b" and is_signed_form(key) and not is_session_id(key)
    assert signed_key("run-1.a_b", b"other") != key and signed_key("run-2", SECRET).partition("~")[2] != tag
    for bad in ("", "../x", "a~b", "x" * 129):
        with pytest.raises(ValueError, match="not a session id"):
            signed_key(bad, SECRET)
    with pytest.raises(ValueError, match="empty secret"):
        signed_key("run-1", b"")


@pytest.mark.parametrize(
    "key",
    [
        "run-1",  # unsigned
        "run-1~",  # no tag
        "run-1~" + "0" * 32,  # a forged tag
        signed_key("run-1", b"another secret"),  # signed with another secret
        signed_key("run-2", SECRET).replace("run-2", "run-1"),  # another session's tag
        signed_key("run-1", SECRET)[:-1],  # a tag cut short
        signed_key("run-1", SECRET) + "0",  # a tag too long
        signed_key("run-1", SECRET).upper(),  # the id changed
        signed_key("run-1", SECRET)[:-1] + "\u00e9",  # not ASCII
        "~" + signed_key("run-1", SECRET).partition("~")[2],  # no id
    ],
)
def test_issue34_verify_key_refuses_anything_but_the_exact_signed_key(key):
    assert verify_key(key, SECRET) is None


def test_issue34_verify_key_compares_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    key = signed_key("run-1", SECRET)
    flipped = key[:-1] + ("1" if key.endswith("0") else "0")
    assert verify_key(key, SECRET) == "run-1" and verify_key(flipped, SECRET) is None
    assert len(calls) == 2


WHERE = [
    ({"authorization": "Bearer {key}"}, "/v1/chat/completions", "api_key", "authorization"),
    ({"x-api-key": "{key}"}, "/v1/messages", "api_key", "x-api-key"),
    ({"x-goog-api-key": "{key}"}, "/v1beta/models/m:generateContent", "api_key", "x-goog-api-key"),
    ({}, "/v1beta/models/m:generateContent?alt=sse&key={key}", "api_key", "query"),
    ({}, "/v1/chat/completions?api_key={key}", "api_key", "query"),
    ({"x-polar-session": "{key}"}, "/v1/chat/completions", "header", None),
    ({}, "/s/{key}/v1/chat/completions", "path", None),
]


def fill(headers, path, key):
    return {k: v.format(key=key) for k, v in headers.items()}, path.format(key=key)


@pytest.mark.parametrize(("headers", "path", "source", "where"), WHERE)
def test_issue34_a_signed_key_names_its_session_wherever_it_is_given(headers, path, source, where):
    key = signed_key("run-7", SECRET)
    s = resolve(*fill(headers, path, key), SALT, SECRET)
    assert (s.id, s.source, s.credential_header, s.refused) == ("run-7", source, where, None)
    assert key not in s.path and "~" not in s.path and not s.path.startswith("/s/")
    assert "x-polar-session" not in recordable_headers(fill(headers, path, key)[0])  # the tag stays off disk


def test_issue34_a_quoted_tilde_in_the_path_prefix_is_read_as_one():
    key = signed_key("run-7", SECRET).replace("~", "%7E")
    assert resolve({}, f"/s/{key}/v1/chat/completions", SALT, SECRET).id == "run-7"


@pytest.mark.parametrize(("headers", "path", "source", "where"), WHERE)
@pytest.mark.parametrize(
    ("key", "claimed", "reason"),
    [
        ("run-7", "run-7", "an unsigned session id"),
        ("run-7~" + "f" * 32, "run-7", "a wrong tag"),
        (signed_key("run-8", SECRET).replace("run-8", "run-7"), "run-7", "a wrong tag"),
        ("sk-proj-abc123", None, "a provider key"),
        ("AIzaSyA-123", None, "a provider key"),
        ("has space\x1b[2J", None, "not a session key"),
    ],
)
def test_issue34_any_other_key_is_refused_naming_only_the_session_it_claimed(
    headers, path, source, where, key, claimed, reason
):
    s = resolve(*fill(headers, path, key), SALT, SECRET)
    assert (s.id, s.source, s.claimed) == ("", "refused", claimed)
    assert s.refused is not None and s.refused.startswith(reason) and key not in s.refused


def test_issue34_no_key_is_refused_and_the_first_key_given_is_the_one_checked():
    assert resolve({}, "/v1/chat/completions", SALT, SECRET).refused == "no key"
    good = signed_key("run-1", SECRET)
    # The order of precedence decides which key is read; a good key behind a bad one does not rescue it.
    s = resolve({"x-polar-session": "run-2", "authorization": f"Bearer {good}"}, "/v1/chat/completions", SALT, SECRET)
    assert s.refused is not None and s.claimed == "run-2"
    s = resolve({"x-polar-session": good, "authorization": "Bearer sk-real"}, "/s/run-2/v1/x", SALT, SECRET)
    assert (s.id, s.source, s.path) == ("run-1", "header", "/v1/x")


def test_issue34_without_a_secret_a_signed_key_is_only_a_key_as_before():
    key = signed_key("run-1", SECRET)
    s = resolve({"authorization": f"Bearer {key}"}, "/v1/chat/completions", SALT)
    assert s.source == "key_hash" and key not in s.id and s.refused is None
    assert resolve({"authorization": "Bearer run-1"}, "/v1/chat/completions", SALT).id == "run-1"


def test_issue34_read_secret(tmp_path):
    (tmp_path / "s").write_text("  abc123\n")
    assert read_secret(tmp_path / "s") == b"abc123"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_secret(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        read_secret(tmp_path / "missing")
