"""Read ``key = value`` files (``#`` starts a comment)."""

import os
from collections.abc import Mapping
from pathlib import Path

from confit.coerce import coerce
from confit.env import apply_env


def parse(text: str) -> dict:
    """Typed values of ``key = value`` lines; keys are lower-cased."""
    values = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, raw = line.partition("=")
        if not sep:
            raise ValueError(f"line {number}: expected 'key = value', got {line!r}")
        values[key.strip().lower()] = coerce(raw)
    return values


def load(path: str | Path, environ: Mapping[str, str] | None = None) -> dict:
    """The file's values, overridden by ``APP_*`` variables of ``environ`` (default: the process environment)."""
    return apply_env(parse(Path(path).read_text()), os.environ if environ is None else environ)
