"""Constants of client."""

MAX_RETRIES = 3
