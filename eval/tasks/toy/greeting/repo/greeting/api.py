from greeting.words import GREETING


def greet(name: str) -> str:
    return f"{GREETING}, {name}!"
