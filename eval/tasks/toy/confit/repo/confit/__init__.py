"""``key = value`` config files with typed values and environment overrides."""

from confit.loader import load, parse

__all__ = ["load", "parse"]
