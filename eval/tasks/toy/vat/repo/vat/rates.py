"""Constants of vat."""

STANDARD_RATE = 0.2
