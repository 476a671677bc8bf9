from greeting.api import greet

__all__ = ["greet"]
