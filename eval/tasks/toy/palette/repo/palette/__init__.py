from palette.api import css

__all__ = ["css"]
