"""Helpers for megatron_ext's own tests and tools (simulated peers, reference layers).

Shipped inside the package so tests and tools import one copy; nothing here runs in training.

  reference      the dense MoE oracle every layer is compared with (MoEWeights, dense_moe)
  megatron_moe   Megatron's own MoE layer and config for a shape; oracle weights in and out
  single_rank    one-rank process group + Megatron parallel state (one-GPU tests, benchmarks)
  threaded_peers simulated EP ranks in one process (threads, CPU "symmetric memory")
"""
