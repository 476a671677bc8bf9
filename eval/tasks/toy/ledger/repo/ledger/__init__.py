"""Invoices with tax, in integer cents, and a plain-text summary."""

from ledger.invoice import Invoice, Line
from ledger.report import summary

__all__ = ["Invoice", "Line", "summary"]
