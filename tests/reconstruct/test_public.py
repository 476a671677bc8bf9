"""The public surface of the reconstruct package: what __init__ exports, and nothing by accident."""

import reconstruct


def test_all_is_the_sorted_public_names():
    public = sorted(
        n for n in dir(reconstruct) if not n.startswith("_") and n not in ("annotations", "files", "schema")
    )
    assert reconstruct.__all__ == sorted(reconstruct.__all__, key=lambda n: (not n.isupper(), n))
    assert sorted(reconstruct.__all__) == public
