_VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
_TABLE = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


def to_roman(number: int) -> str:
    """Roman numeral of ``number`` (1..3999)."""
    if not 0 < number < 4000:
        raise ValueError(f"{number} is out of range 1..3999")
    out = []
    for value, symbol in _TABLE:
        count, number = divmod(number, value)
        out.append(symbol * count)
    return "".join(out)


def from_roman(text: str) -> int:
    """Integer value of a Roman numeral, additive or subtractive form."""
    total = 0
    largest = 0
    for char in reversed(text.strip().upper()):
        if char not in _VALUES:
            raise ValueError(f"{text!r} is not a Roman numeral")
        value = _VALUES[char]
        if value < largest:
            total -= value
        else:
            total += value
            largest = value
    return total
