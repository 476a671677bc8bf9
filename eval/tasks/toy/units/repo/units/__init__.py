from units.api import miles_to_km

__all__ = ["miles_to_km"]
