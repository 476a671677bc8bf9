from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any


class EventBus:
    """Synchronous publish/subscribe: handlers run in subscription order, in the publisher's thread."""

    def __init__(self) -> None:
        self._handlers: defaultdict[Hashable, list[Callable]] = defaultdict(list)

    def subscribe(self, event: Hashable, handler: Callable) -> Callable:
        """Call ``handler(*args, **kwargs)`` on every ``publish(event, ...)``; returns ``handler``."""
        self._handlers[event].append(handler)
        return handler

    def unsubscribe(self, event: Hashable, handler: Callable) -> None:
        try:
            self._handlers[event].remove(handler)
        except ValueError:
            raise KeyError(f"{handler!r} is not subscribed to {event!r}") from None

    def publish(self, event: Hashable, *args: Any, **kwargs: Any) -> list:
        """Run the event's handlers; returns their results in order."""
        return [handler(*args, **kwargs) for handler in list(self._handlers[event])]
