"""Helpers for megatron_ext's own tests and tools (simulated peers, reference layers).

Shipped inside the package so tests and tools import one copy; nothing here runs in training.
"""
