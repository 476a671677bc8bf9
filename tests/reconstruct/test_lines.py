"""reconstruct/_lines.py: record lines and their heads, split at every boundary, from real capture files."""

import json

import pytest

from reconstruct._lines import HEAD_BYTES, LineIndexer, LineRef, parse_head


def lines_of(data, chunks):
    indexer = LineIndexer()
    refs = [ref for chunk in chunks for ref in indexer.decode(chunk)]
    return refs, indexer.flush()


def expected(data):
    refs, offset = [], 0
    for line in data.split(b"\n")[:-1]:
        refs.append(LineRef(offset, len(line), line[:HEAD_BYTES]))
        offset += len(line) + 1
    return refs


def small_lines(captures):
    """Three real records, shrunk (the request dropped) to keep an every-split test quick, plus one holding
    U+2028 and U+2029 inside a string (JSON text may carry them raw; only b"\\n" ends a line)."""
    records = captures.records()[:3]
    for r in records:
        r["request"] = r["upstream_request"] = None
        r["response_body"] = r["response_body"][:300]
    records[0]["response_body"] += "\u2028 and \u2029 \u00e9"
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)


@pytest.mark.slow
def test_every_split_of_real_lines(captures):
    data = small_lines(captures)
    want = expected(data)
    assert len(want) == 3 and "\u2028".encode() in data
    for i in range(0, len(data) + 1, 7):
        assert lines_of(data, [data[:i], data[i:]]) == (want, None), i
    assert lines_of(data, [data[i : i + 1] for i in range(len(data))]) == (want, None)


@pytest.mark.slow
def test_torn_last_line_is_reported_not_returned(captures):
    data = small_lines(captures)
    torn_at = data.index(b"\n") + 40
    refs, torn = lines_of(data, [data[:torn_at]])
    assert refs == expected(data)[:1]
    assert torn == LineRef(refs[0].length + 1, torn_at - refs[0].length - 1, data[refs[0].length + 1 : torn_at])


@pytest.mark.slow
def test_head_of_every_real_record(captures):
    for path in sorted(captures.vllm_dir.glob("*.jsonl")) + sorted(captures.plain_dir.glob("*.jsonl")):
        data = path.read_bytes()
        refs, torn = lines_of(data, [data])
        assert torn is None and refs
        for ref in refs:
            record = json.loads(data[ref.offset : ref.offset + ref.length])
            head = parse_head(ref.head)
            assert head is not None and (head.version, head.id, head.session_id) == (
                record["v"],
                record["id"],
                record["session_id"],
            )


def test_head_with_escapes_and_unknown_layouts():
    head = parse_head(b'{"v": 1, "id": "ab12", "session_id": "a\\"b\\\\c\\u00e9", "api": "chat"')
    assert head is not None and head.session_id == 'a"b\\c\u00e9'
    assert parse_head(b'{"id": "ab12", "v": 1, "session_id": "s"}') is None  # another key order: parse it all
    assert parse_head(b'{"v": 1, "id": "ab12", "session_id": "cut here') is None  # head ends mid-session
    assert parse_head(b"\x00garbage") is None
