import re
import unicodedata

_UNSAFE = re.compile(r"[^a-z0-9]")


def slugify(text: str, sep: str = "-") -> str:
    """A URL-safe slug of ``text``: lowercase ASCII letters and digits, words joined by ``sep``."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return _UNSAFE.sub(sep, ascii_text.lower())
