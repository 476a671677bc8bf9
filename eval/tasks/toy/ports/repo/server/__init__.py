from server.api import address

__all__ = ["address"]
