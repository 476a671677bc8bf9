"""Parse and order semantic versions."""

from versions.version import Version
from versions.select import latest

__all__ = ["Version", "latest"]
