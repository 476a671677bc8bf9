"""Environment-variable overrides for loaded config values."""

from collections.abc import Mapping


def apply_env(values: dict, environ: Mapping[str, str], prefix: str = "APP_") -> dict:
    """``values`` overridden by ``PREFIX + KEY`` variables (``APP_PORT`` sets ``port``)."""
    merged = dict(values)
    for name, raw in environ.items():
        if name.startswith(prefix):
            merged[name[len(prefix) :].lower()] = raw
    return merged
