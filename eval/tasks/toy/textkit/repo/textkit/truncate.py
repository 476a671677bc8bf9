def truncate(text: str, width: int, ellipsis: str = "...") -> str:
    """``text`` cut to at most ``width`` characters, ending in ``ellipsis`` when cut."""
    if len(text) <= width:
        return text
    return text[: max(width - len(ellipsis), 0)] + ellipsis
