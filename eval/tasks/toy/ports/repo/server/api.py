from server.settings import DEFAULT_PORT


def address(host: str = "localhost") -> str:
    return f"{host}:{DEFAULT_PORT}"
