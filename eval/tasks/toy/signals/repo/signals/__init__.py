"""A tiny synchronous event bus."""

from signals.bus import EventBus

__all__ = ["EventBus"]
