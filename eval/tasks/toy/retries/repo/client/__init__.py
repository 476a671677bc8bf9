from client.api import attempts

__all__ = ["attempts"]
