"""Exceptions of the reconstruct package.

    ReconstructError (ValueError)
    ├── CaptureError        no capture file found, or one that cannot be read
    ├── RetokenizeError     a call the chat template cannot render, a bad --eot-token
    └── ConfigError         options that contradict each other (--shard, --sessions)
    schema.SchemaError (ValueError)   a table or file that does not match the trajectory schema

A damaged capture line, an exchange that failed, a call without token ids are not errors: they are counted
in the stats and the run goes on.
"""

from __future__ import annotations

__all__ = ["CaptureError", "ConfigError", "ReconstructError", "RetokenizeError"]


class ReconstructError(ValueError):
    """Base of this package's errors; the CLI prints the message and exits 2."""


class CaptureError(ReconstructError):
    pass


class RetokenizeError(ReconstructError):
    pass


class ConfigError(ReconstructError):
    pass
