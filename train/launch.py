"""The ``Accelerator`` of a training run, as the user launched it (``accelerate launch --config_file ...``).

The shipped multi-process configs (``ddp.yaml``, ``fsdp.yaml``) are written for GPUs. Launched on a machine without
one, accelerate starts every process, but each one finds no GPU backend and trains alone on all the data, all
writing the same output. Here a multi-process launch on such a machine runs its processes on the CPU over gloo
instead, as ``cpu.yaml`` would with ``distributed_type: MULTI_CPU``: the same maths, so the same adapter as one
process (tests/train/test_launch.py). ``--mixed_precision no`` on the command line keeps the CPU in float32.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator

__all__ = ["accelerator"]


def accelerator() -> Accelerator:
    """The run's Accelerator (the scheduler steps once per optimizer step, not once per process)."""
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(step_scheduler_with_optimizer=False, cpu=several and not torch.accelerator.is_available())
