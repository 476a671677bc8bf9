import pytest

from ledger import Invoice, summary


def test_totals():
    invoice = Invoice("INV-1", tax_percent=10).add("Widget", 3, 1250).add("Gadget", 1, 999)
    assert (invoice.subtotal_cents(), invoice.tax_cents(), invoice.total_cents()) == (4749, 475, 5224)


def test_zero_quantity_rejected():
    with pytest.raises(ValueError):
        Invoice("INV-2").add("Nothing", 0, 100)


def test_negative_price_rejected():
    with pytest.raises(ValueError):
        Invoice("INV-3").add("Widget", 1, -100)


def test_summary_lists_lines_and_total():
    text = summary(Invoice("INV-4").add("Widget", 2, 1250))
    assert text.splitlines()[0] == "Invoice INV-4"
    assert "Widget" in text and text.splitlines()[-1].endswith("$25.00")
