import functools
import re
from dataclasses import dataclass

_PATTERN = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:-([0-9A-Za-z.-]+))?$")


@functools.total_ordering
@dataclass(frozen=True, eq=True)
class Version:
    """A ``MAJOR.MINOR.PATCH[-PRERELEASE]`` version; a release sorts after its prereleases."""

    major: str
    minor: str
    patch: str
    prerelease: str = ""

    @classmethod
    def parse(cls, text: str) -> "Version":
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(f"not a version: {text!r}")
        major, minor, patch, prerelease = match.groups()
        return cls(major, minor, patch, prerelease or "")

    def _key(self) -> tuple:
        return (self.major, self.minor, self.patch, self.prerelease == "", self.prerelease)

    def __lt__(self, other: "Version") -> bool:
        return self._key() < other._key()

    def __str__(self) -> str:
        core = f"{self.major}.{self.minor}.{self.patch}"
        return f"{core}-{self.prerelease}" if self.prerelease else core
