from palette.colors import RED


def css(name: str) -> str:
    return f"color: {dict(red=RED)[name]}"
