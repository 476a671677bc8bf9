from client.policy import MAX_RETRIES


def attempts() -> int:
    return 1 + MAX_RETRIES
