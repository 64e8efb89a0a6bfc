"""Mutations of the symm transport for the interpreter scripts: each must make an ordering check fail."""

from __future__ import annotations

# The transport's phase barriers (SymmRowTransport._fence's names)
PHASES = ("route-count exchange", "dispatch", "combine", "combine backward", "dispatch backward")


def drop_fences(dropped) -> None:
    """Every rank (this process and those it forks later) skips the transport's phase barriers for
    which `dropped(transport, phase)` holds."""
    from megatron_ext.moe.transport.symm import SymmRowTransport

    kept_fence = SymmRowTransport._fence

    def fence_unless_dropped(self, buffer, phase):
        if not dropped(self, phase):
            kept_fence(self, buffer, phase)
    SymmRowTransport._fence = fence_unless_dropped


def unfence_poison() -> None:
    """The pre-fix debug poison: the owner's NaN fill of a buffer peers PUT into, with no barrier
    before their PUTs (a fast peer's rows land first and are wiped). For every rank forked later."""
    from megatron_ext.moe import arena, buffers
    from megatron_ext.moe.transport import symm

    def unfenced(buffer, fence=None):
        buffers.poison(buffer)
    buffers.poison_then_fence = symm.poison_then_fence = arena.poison_then_fence = unfenced
