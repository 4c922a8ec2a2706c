"""train.activation_offload: the tensors a training forward saves for its backward go to host memory
(pinned, copied back as the backward needs them) through torch.autograd.graph.save_on_cpu.

With train.activation_checkpointing the checkpointed blocks save only their inputs, so only those
boundaries travel to the host and the rest is recomputed: the two compose into the smallest device
footprint (what torchtune's offloaded checkpointing does, without its second CUDA stream: the copies
here are synchronous, so it trades step time for memory; the gpu_suite `offload` row measures both).
On a CPU the "device" is host memory already: the key is refused there rather than accepted and doing
nothing. Pipeline schedules run their forwards inside torch's schedule, outside the step: refused too.
"""

from __future__ import annotations

import contextlib

import torch

from lmforge.errors import ConfigError


def check_activation_offload(cfg, device: torch.device) -> None:
    if not cfg.train.activation_offload:
        return
    if device.type != "cuda":
        raise ConfigError(f"train.activation_offload=true moves saved activations from the GPU to host "
                          f"memory; this run's device is {device.type}, whose activations are in host memory "
                          "already. Remove it (train.activation_checkpointing is what saves memory on a CPU)")
    if cfg.parallel.pp > 1:
        raise ConfigError("train.activation_offload=true with a pipeline (parallel.pp > 1): the schedule "
                          "runs the forwards itself; use train.activation_checkpointing there")


def offloading(enabled: bool, device: torch.device):
    """The context a training forward runs in: saved tensors to (pinned) host memory when `enabled`."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
