"""CUDA graphs for the synchronization-free MoE layer (docs/design.md, "CUDA graphs")."""

from megatron_ext.cuda_graphs.runner import GraphedMoELayer, capture_blockers, release_cuda_graphs
from megatron_ext.cuda_graphs.schedule import live_microbatches

__all__ = ["GraphedMoELayer", "capture_blockers", "live_microbatches", "release_cuda_graphs"]
