from collections.abc import Iterable

from versions.version import Version


def latest(tags: Iterable[str]) -> str:
    """The newest of ``tags`` (version strings), as given."""
    return max(tags, key=Version.parse)
