"""Row transports: pick one by MoEExtConfig.transport; a backend that cannot run is an error."""

from __future__ import annotations

import importlib.util
import logging
import socket

import torch
import torch.distributed as dist

from megatron_ext.moe.peer_failure import named_phase, peer_timeout_seconds
from megatron_ext.moe.transport.torch_ref import TorchRowTransport
from megatron_ext.quiet import warn_once

logger = logging.getLogger(__name__)


def group_in_one_host(group) -> bool:
    """Whether every rank of `group` runs on this host (init time: gathers host names)."""
    if group is None or dist.get_world_size(group) == 1:
        return True
    names = [None] * dist.get_world_size(group)
    with named_phase("host-name exchange (choosing the row transport)", group, peer_timeout_seconds(None)):
        dist.all_gather_object(names, socket.gethostname(), group=group)
    return len(set(names)) == 1


def resolve_transport(choice: str, group, device: torch.device) -> str:
    """'auto' -> 'symm' on CUDA within one host (NVLink domain), else 'torch'; checks explicit picks."""
    on_gpu = device.type == "cuda"
    if choice == "auto":
        return "symm" if on_gpu and group_in_one_host(group) else "torch"
    if choice == "symm":
        if not on_gpu:
            raise ValueError(f"transport='symm' moves rows with Triton kernels over GPU symmetric memory; the "
                             f"tokens are on {device}. Use --moe-ext-transport torch on CPU.")
        if not group_in_one_host(group):
            raise ValueError("transport='symm' needs the expert-parallel group inside one NVLink domain (one "
                             "host); this group spans hosts. Use --moe-ext-transport torch (the deepep transport "
                             "is intranode only too).")
    if choice == "deepep" and importlib.util.find_spec("deep_ep") is None:
        raise ImportError("transport='deepep' needs the deep_ep package, which has no working PyPI release: "
                          "build DeepEP from source (README, 'DeepEP backend'), or choose --moe-ext-transport "
                          "symm (one host) or torch")
    return choice


def make_transport(ext_config, group, capacity: int, device: torch.device, max_routes: int | None = None):
    """Build the configured transport for one layer's EP group and static capacity (`max_routes`:
    T_max * K, which sizes the symm transport's receive buffers with return_transfer="put")."""
    choice = resolve_transport(ext_config.transport, group, device)
    if ext_config.return_transfer == "put" and choice != "symm":
        raise ValueError(f"return_transfer='put' is a mode of the symm transport, but transport="
                         f"{ext_config.transport!r} resolved to {choice!r} here (the symm transport needs GPUs "
                         f"of one NVLink domain): use return_transfer='get'")
    timeout_s = peer_timeout_seconds(ext_config.peer_timeout_s)
    if choice == "torch":  # its waits are the process group's collectives: the group's own timeout bounds them
        if ext_config.peer_timeout_s is not None:
            warn_once(logger, f"megatron_ext: peer_timeout_s={ext_config.peer_timeout_s} does not bound the torch "
                              f"row transport (transport={ext_config.transport!r} resolved to 'torch' here): its "
                              f"waits are collectives of the expert-parallel process group, bounded by that group's "
                              f"timeout (--distributed-timeout-minutes)")
        return TorchRowTransport(group, capacity, poison_tail=ext_config.debug_poison,
                                 timeout_s=peer_timeout_seconds(None))
    if choice == "symm":
        from megatron_ext.moe.transport.symm import SymmRowTransport

        return SymmRowTransport(group, capacity, lease_slots=ext_config.lease_slots, poison=ext_config.debug_poison,
                                timeout_s=timeout_s, return_put=ext_config.return_transfer == "put",
                                max_routes=max_routes)
    if choice == "deepep":
        from megatron_ext.moe.transport.deepep import DeepEPRowTransport

        return DeepEPRowTransport(group, capacity, poison_tail=ext_config.debug_poison)
    raise ValueError(f"row transport {choice!r} is not available in this build of megatron_ext; "
                     f"use transport='symm' (GPUs in one host) or 'torch'")
