"""reconstruct/_tokens.py: token sequences compared as canonical JSON text, and prompt arrays lifted out of bodies."""

import json

import pytest

from reconstruct._tokens import TokenText, cut_array, find_array


def test_prefix_is_by_token_not_by_character():
    p = TokenText.from_ids([1, 2])
    assert p.is_prefix_of(TokenText.from_ids([1, 2, 3]))
    assert p.is_prefix_of(TokenText.from_ids([1, 2]))
    assert not p.is_prefix_of(TokenText.from_ids([1, 23]))  # "[1,2" starts "[1,23]" as text
    assert not p.is_prefix_of(TokenText.from_ids([1]))
    assert TokenText.from_ids([]).is_prefix_of(p)
    assert TokenText.from_ids([1, 2, 3, 40]).tail_after(p) == [3, 40]
    assert p.tail_after(TokenText.from_ids([])) == [1, 2] and p.tail_after(p) == []


@pytest.mark.parametrize("text", ["[1, 2, 3]", "[1,2,3]", "[\n  1,\n  2,\n  3\n]", "[1,\t2 ,3]"])
def test_any_server_spacing_gives_one_canonical_form(text):
    t = TokenText.from_json(text)
    assert t == TokenText.from_ids([1, 2, 3]) and len(t) == 3 and t.ids() == [1, 2, 3]
    assert TokenText.from_json("[]").n == 0


def test_bad_arrays_are_refused():
    with pytest.raises(ValueError, match="not a JSON array"):
        TokenText.from_json('{"a": 1}')
    with pytest.raises(ValueError, match="something other than token ids"):
        TokenText.from_json("[1, 2.5, 3]").ids()


def test_cut_array_lifts_the_key_and_ignores_the_key_inside_strings():
    body = {
        "choices": [{"message": {"content": 'he wrote "prompt_token_ids": [9, 9] here'}, "token_ids": [5]}],
        "prompt_token_ids": [1, 2, 3],
        "usage": {"prompt_tokens": 3},
    }
    for text in (json.dumps(body), json.dumps(body, separators=(",", ":")), json.dumps(body, indent=2)):
        rest, array = cut_array(text, "prompt_token_ids")
        assert json.loads(array) == [1, 2, 3]
        assert json.loads(rest) == {**body, "prompt_token_ids": None}
    assert cut_array('{"prompt_token_ids": null}', "prompt_token_ids") == ('{"prompt_token_ids": null}', None)
    assert cut_array('{"a": 1}', "prompt_token_ids") == ('{"a": 1}', None)
    assert cut_array('{"prompt_token_ids": [1, 2', "prompt_token_ids") == ('{"prompt_token_ids": [1, 2', None)


def test_find_array_gives_the_span_cut_array_lifts():
    text = '{"a": "x", "prompt_token_ids": [1, 2, 3], "b": 1}'
    start, stop = find_array(text, "prompt_token_ids")
    assert text[start:stop] == "[1, 2, 3]"
    assert cut_array(text, "prompt_token_ids") == (text[:start] + "null" + text[stop:], "[1, 2, 3]")
    assert find_array('{"prompt_token_ids": null}', "prompt_token_ids") is None
