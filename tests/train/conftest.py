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


@pytest.fixture(autouse=True)
def float32_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    # --dtype auto takes bf16 on CPUs with bf16 units (train/precision.py), and these tests compare losses and
    # gradients to fp32 tolerances: here auto sees a CPU where bf16 does not pay. test_precision.py checks the rule.
    monkeypatch.setattr("train.precision.bf16_matmul_speedup", lambda: 1.0)
