"""CUDA graphs for the synchronization-free MoE layer (docs/design.md, "CUDA graphs")."""

from megatron_ext.cuda_graphs.runner import GraphedMoELayer, capture_blockers
from megatron_ext.cuda_graphs.schedule import live_microbatches

__all__ = ["GraphedMoELayer", "capture_blockers", "live_microbatches"]
