from dataclasses import dataclass, field

from ledger.money import percent_of


@dataclass(frozen=True)
class Line:
    description: str
    quantity: int
    unit_cents: int

    def __post_init__(self) -> None:
        if self.quantity <= 0:
            raise ValueError(f"quantity must be positive, got {self.quantity}")
        if self.unit_cents < 0:
            raise ValueError(f"unit price must not be negative, got {self.unit_cents}")

    @property
    def cents(self) -> int:
        return self.quantity * self.unit_cents


@dataclass
class Invoice:
    number: str
    tax_percent: float = 0.0
    lines: list[Line] = field(default_factory=list)

    def add(self, description: str, quantity: int, unit_cents: int) -> "Invoice":
        self.lines.append(Line(description, quantity, unit_cents))
        return self

    def subtotal_cents(self) -> int:
        return sum(line.cents for line in self.lines)

    def tax_cents(self) -> int:
        return percent_of(self.subtotal_cents(), self.tax_percent)

    def total_cents(self) -> int:
        return self.subtotal_cents() + self.tax_cents()
