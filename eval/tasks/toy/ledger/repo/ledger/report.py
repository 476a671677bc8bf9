from ledger.invoice import Invoice
from ledger.money import format_cents


def summary(invoice: Invoice) -> str:
    """A plain-text invoice: one row per line, then subtotal, tax and total."""
    rows = [f"Invoice {invoice.number}"]
    for line in invoice.lines:
        rows.append(f"{line.description:<24}{line.quantity:>5} x {format_cents(line.unit_cents):>12}")
    rows.append(f"{'Subtotal':<33}{format_cents(invoice.subtotal_cents()):>12}")
    rows.append(f"{f'Tax {invoice.tax_percent:g}%':<33}{format_cents(invoice.tax_cents()):>12}")
    rows.append(f"{'Total':<33}{format_cents(invoice.total_cents()):>12}")
    return "\n".join(rows)
