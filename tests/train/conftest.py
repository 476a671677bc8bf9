"""Fixtures for the trainer's tests: one CPU thread (the tiny model is overhead-bound, and the machine shared)."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny matmuls on two busy cores run 10-30x slower with two threads than with one.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
