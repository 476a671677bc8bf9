import pytest

from signals import EventBus


def test_handlers_run_in_order():
    bus = EventBus()
    bus.subscribe("saved", lambda path: f"first {path}")
    bus.subscribe("saved", lambda path: f"second {path}")
    assert bus.publish("saved", "a.txt") == ["first a.txt", "second a.txt"]


def test_publish_without_handlers():
    assert EventBus().publish("nothing") == []


def test_unsubscribe():
    bus = EventBus()
    seen = []
    handler = bus.subscribe("tick", seen.append)
    bus.publish("tick", 1)
    bus.unsubscribe("tick", handler)
    bus.publish("tick", 2)
    assert seen == [1]


def test_unsubscribe_unknown_raises():
    with pytest.raises(KeyError):
        EventBus().unsubscribe("tick", print)
