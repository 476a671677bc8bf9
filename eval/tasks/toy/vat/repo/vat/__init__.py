from vat.api import with_vat

__all__ = ["with_vat"]
