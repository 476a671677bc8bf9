"""Constants of server."""

DEFAULT_PORT = 8000
