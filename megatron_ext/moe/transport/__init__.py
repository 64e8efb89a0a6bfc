"""Row transports: pick one by MoEExtConfig.transport; a backend that cannot run is an error."""

from __future__ import annotations

import importlib.util

import torch

from megatron_ext.moe.transport.torch_ref import TorchRowTransport


def make_transport(ext_config, group, capacity: int, device: torch.device):
    """Build the configured transport for one layer's EP group and static capacity."""
    choice = ext_config.transport
    poison = ext_config.debug_poison
    if choice == "auto":
        choice = "torch"  # symm joins "auto" once its transport lands (issue 5)
    if choice == "torch":
        return TorchRowTransport(group, capacity, poison_tail=poison)
    if choice == "deepep":
        if importlib.util.find_spec("deep_ep") is None:
            raise ImportError("transport='deepep' needs the deep_ep package, which has no working PyPI "
                              "release: build DeepEP from source (README, 'DeepEP backend'), or choose "
                              "--moe-ext-transport torch")
    raise ValueError(f"row transport {choice!r} is not available in this build of megatron_ext; "
                     f"use transport='torch' (--moe-ext-transport torch)")
