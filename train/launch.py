"""The ``Accelerator`` of a training run, as the user launched it (``accelerate launch --config_file ...``).

The shipped multi-process configs (``ddp.yaml``, ``fsdp.yaml``) are written for GPUs. Launched on a machine without
one, accelerate starts every process, but each one finds no GPU backend and trains alone on all the data, all
writing the same output. Here a multi-process launch on such a machine runs its processes on the CPU over gloo
instead, each config as what it says:

- ``ddp.yaml`` runs as ``cpu.yaml`` would with ``distributed_type: MULTI_CPU``: DDP, a full replica on every rank.
- ``fsdp.yaml`` runs FSDP2: ``fully_shard`` on each decoder layer (the model's ``_no_split_modules``) and on the
  policy, so each rank holds only its shard of every weight (``runtime.print_placement`` says how many bytes), and
  ``--save-every`` writes sharded checkpoints. Accelerate has no FSDP on the CPU: ``cpu=True`` makes the run
  MULTI_CPU, which drops the FSDP plugin and wraps the model in DDP. So the Accelerator is built as MULTI_CPU (the
  gloo process group, the CPU device) and then given the plugin the launcher configured and the FSDP type;
  from there Accelerate's own FSDP2 code prepares, clips, saves, loads and gathers, as it does on GPUs.

Either way the maths is that of one process, so the adapter is too (tests/train/test_launch.py). ``--mixed_precision
no`` on the command line keeps the CPU in float32.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

__all__ = ["accelerator"]


def accelerator() -> Accelerator:
    """The run's Accelerator (the scheduler steps once per optimizer step, not once per process)."""
    on_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()
    accelerator = Accelerator(step_scheduler_with_optimizer=False, cpu=on_cpu)
    if on_cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":  # set by the launcher for FSDP
        _shard_on_cpu(accelerator)
    return accelerator


def _shard_on_cpu(accelerator: Accelerator) -> None:
    """Turns a MULTI_CPU Accelerator into an FSDP2 one. The type is set in both of Accelerate's shared states: the
    accelerator's (prepare, save_state, get_state_dict read it) and the processes' (barriers, gathers, reductions
    read it; an accelerator state made later copies it from there). Their collectives are the same
    torch.distributed calls for FSDP as for MULTI_CPU, here on gloo."""
    plugin = FullyShardedDataParallelPlugin()  # the launcher's FSDP_* variables: the config's fsdp_config
    if plugin.fsdp_version != 2:
        raise ValueError("FSDP on the CPU runs FSDP2 only: set fsdp_version: 2 in the config's fsdp_config")
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
