"""Reference row transport: fixed per-peer blocks through all_to_all_single (any backend).

Each source lays its kept rows into a [M, C, H] send block at (dest_rank, dest_row) — a source
never sends more than C rows to one destination, so the slot is simply the destination row —
and one all_to_all_single with static equal splits moves the blocks (no split sizes on the
host, no host sync). The receiver knows from the replicated keep decision which source owns
each of its rows (route.row_source) and gathers them into place.
Cost accepted: M*C*H elements per exchange instead of the kept rows only, and a zero-filled
block: it is the correctness oracle and the fallback, not the fast path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.kernels.mxfp8_rows import quantize_packed
from megatron_ext.moe.peer_failure import named_phase
from megatron_ext.moe.route_map import RouteMap
from megatron_ext.moe.transport.base import routes_in_range, sum_routes


class TorchRowTransport:
    def __init__(self, group, capacity: int, poison_tail: bool = False, timeout_s: float | None = None):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.capacity = capacity
        self.poison_tail = poison_tail
        self.timeout_s = timeout_s  # the process group's own timeout bounds the wait; named in errors
        self.slot_source = None  # a callable returning an arena lease to place the rows in (moe/arena.py)

    def _exchange(self, send: torch.Tensor, phase: str) -> torch.Tensor:
        """[M * C, H] blocks out, [M * C, H] blocks in (block i to / from rank i)."""
        if self.size == 1:
            return send
        recv = torch.empty_like(send)
        with named_phase(phase, self.group, self.timeout_s):
            dist.all_to_all_single(recv, send, group=self.group)
        return recv

    # The four transfers (transport/base.py); autograd owns every buffer, so no leases.
    def dispatch(self, tokens, probs, route):
        rows = self._put(self._per_route(tokens, route), route, phase="dispatch")
        row_probs = self._put_probs(probs, route)
        if self.slot_source is None:
            return rows, row_probs, None
        lease = self.slot_source()  # a dropless arena's view: the rows are copied there
        lease.place(rows, row_probs, route.recv_offsets[-1])
        return lease.buffer.local, lease.buffer.values, lease

    def dispatch_quantized(self, tokens, probs, route):
        """MXFP8 rows: quantize and pack [T, H] tokens, then the same PUT on the packed rows viewed
        as float32 words (bit-exact: no arithmetic on them). Returns (uint8 [C, P], probs [C], None)."""
        packed = quantize_packed(tokens.contiguous()).view(torch.float32)
        rows = self._put(self._per_route(packed, route), route, phase="MXFP8 dispatch")
        return rows.view(torch.uint8), self._put_probs(probs, route), None

    def combine(self, expert_out, route):
        return sum_routes(self._get(expert_out, route, phase="combine"))

    def combine_backward(self, grad_out, route):
        return self._put(self._per_route(grad_out, route), route, phase="combine backward")

    def dispatch_backward(self, grad_buffer, grad_row_probs, route):
        grad_tokens = sum_routes(self._get(grad_buffer, route, phase="dispatch backward"))
        if grad_row_probs is None:
            return grad_tokens, None
        grad_probs = self._get(grad_row_probs.float()[:, None], route, phase="dispatch backward (probabilities)")
        return grad_tokens, grad_probs[..., 0]

    def release(self, lease) -> None:
        if lease is not None:  # an arena's lease (moe/arena.py); autograd owns the other buffers
            lease.release()

    @staticmethod
    def _per_route(rows: torch.Tensor, route: RouteMap) -> torch.Tensor:
        """[T, W] token rows -> [T, K, W]: every route of a token sends the token's row (a view)."""
        return rows[:, None, :].expand(rows.shape[0], route.dest_row.shape[1], rows.shape[1])

    def _put_probs(self, probs: torch.Tensor, route: RouteMap) -> torch.Tensor:
        """Each kept route's probability at its row of the owner's [C] fp32 array (a second exchange)."""
        return self._put(probs.float()[..., None], route, phase="dispatch (probabilities)")[:, 0]

    def _in_range(self, route: RouteMap) -> torch.Tensor:
        return routes_in_range(route, self.size, self.capacity)

    def _put(self, rows: torch.Tensor, route: RouteMap, phase: str = "dispatch") -> torch.Tensor:
        """[T, K, W] per-route rows -> this rank's [C, W] buffer: row dest_row of rank dest_rank."""
        width, blocks = rows.shape[2], self.size * self.capacity
        kept = self._in_range(route)
        slot = torch.where(kept, route.dest_rank.long() * self.capacity + route.dest_row.long(), blocks)
        send = rows.new_zeros(blocks + 1, width)  # last row: sink for dropped and out-of-range routes
        send.index_copy_(0, slot.reshape(-1), rows.reshape(-1, width))
        recv = self._exchange(send[:blocks], phase)
        owner = route.row_source.long()
        rows_here = torch.arange(self.capacity, device=rows.device)
        buf = recv[owner.clamp(min=0) * self.capacity + rows_here]
        tail_value = float("nan") if self.poison_tail else 0.0
        return torch.where((owner >= 0)[:, None], buf, tail_value)

    def _get(self, buf: torch.Tensor, route: RouteMap, phase: str = "combine") -> torch.Tensor:
        """This rank's [C, W] buffer -> [T, K, W]: each route's row from its owner, zero if dropped."""
        width, blocks = buf.shape[1], self.size * self.capacity
        owner = route.row_source.long()
        rows_here = torch.arange(self.capacity, device=buf.device)
        slot = torch.where(owner >= 0, owner * self.capacity + rows_here, blocks)
        send = buf.new_zeros(blocks + 1, width)
        send.index_copy_(0, slot, buf)  # tail rows go to the sink row, never on the wire
        recv = torch.cat([self._exchange(send[:blocks], phase), buf.new_zeros(1, width)])
        kept = self._in_range(route)
        source_slot = torch.where(kept, route.dest_rank.long() * self.capacity + route.dest_row.long(), blocks)
        return recv[source_slot]
