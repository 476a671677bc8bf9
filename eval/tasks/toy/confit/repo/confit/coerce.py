"""Turn config strings into Python values."""

_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


def coerce(raw: str) -> bool | int | float | str:
    """The typed value of a config string: bool, int, float, or the stripped string itself."""
    text = raw.strip()
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text
