"""Symmetric-memory row transport: Triton PUT/GET straight into peers' capacity buffers.

Cost removed (vs the reference transport and Megatron's alltoall): no per-peer send blocks,
no zero fill, no split sizes on the host, no receiver permutation; each kept row moves once,
from the source token to its final row in the owner's buffer, and the grouped GEMM reads that
buffer in place. Costs accepted: a device-side barrier over the EP group after every PUT phase
and before every GET phase (none with one rank), and, with EP > 1, a copy per GET phase of the rows
that arrived (not all C) into the shared symmetric scratch (torch._grouped_mm cannot write into a
given buffer).

Ordering (one stream per rank; docs/design.md, "Ordering"): a PUT phase writes peers' buffers,
then barriers, so its readers see every row. A GET phase first copies its source into scratch,
barriers, then reads peers. A scratch buffer is rewritten only after the barrier of a later
phase, which every rank reaches after finishing its reads of the previous phase. Debug poison
of a buffer that peers PUT into is fenced before the PUT (buffers.poison_then_fence).
Router probabilities ride with the rows (buffers.rows_with_values): the dispatch PUT also stores
each kept route's probability at its row of the owner's [C] value array, the tail of the same
leased allocation, and the dispatch-backward GET fetches each route's probability gradient from
the same scratch. No phase and no barrier is added for them.
With `return_put` (MoEExtConfig.return_transfer="put", transport/put_return.py) the two GET
phases become a PUT back into the sources' receive buffers, a barrier and a local sum: no copy.

The per-layer route-count exchange also runs over symmetric memory (`gather_counts`): each rank
PUTs its [E] counts into row `rank` of every peer's [M, E] table, then barriers. No NCCL call is
left in the layer, so a CUDA graph of it holds no NCCL work (a graph that does keeps
destroy_process_group from returning, pytorch/pytorch#115388).
Works with one GPU (EP=1: the tables hold local buffers only) and with GPUs in one NVLink
domain (CUDA backend of torch symmetric memory, whose buffer_ptrs are peer-mapped addresses).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from megatron_ext.kernels.mxfp8_put import put_rows_mxfp8
from megatron_ext.kernels.row_transfer import copy_rows_below, get_rows, put_rows, put_rows_back
from megatron_ext.moe.buffers import (LeasePool, SymmetricBuffer, SymmetricHeap, TorchSymmetricHeap, poison,
                                     poison_then_fence, rows_with_values)
from megatron_ext.formats.mxfp8 import packed_row_bytes
from megatron_ext.moe.peer_failure import BarrierWatchdog
from megatron_ext.moe.route_map import RouteMap
from megatron_ext.moe.transport.put_return import ReceiveBuffer, receive_buffer, sum_returned


_PHASE_OF_ROLE = {"combine_source": "combine", "dispatch_grad": "dispatch backward"}


class SymmRowTransport:
    reads_row_source = False  # its kernels need no per-row writer (route maps leave it None)
    leases_dispatch_buffers = True  # a dispatch slot stays taken until the dispatch backward (LeasePool)

    def __init__(self, group, capacity: int, lease_slots: int = 1, poison: bool = False,
                 heap: SymmetricHeap | None = None, rank: int | None = None, world: int | None = None,
                 timeout_s: float | None = None, return_put: bool = False, max_routes: int | None = None):
        """`heap`, `rank` and `world` replace the process group's (simulated peers in tests).
        `timeout_s` bounds every device barrier (moe/peer_failure.py); None: unbounded.
        `return_put`: combine and dispatch backward return rows by PUT (transport/put_return.py).
        `max_routes`: T_max * K, the rows of every rank's receive buffer in that mode (None: this
        rank's T * K at its first return, for callers whose ranks all hold T tokens)."""
        # The kernel's own bound is a backstop at twice the watchdog's, so the watchdog's message
        # (phase and group) comes first; a trapped barrier would only say "unspecified launch failure".
        self.timeout_ms = 0 if timeout_s is None else max(1, int(2 * timeout_s * 1000))
        self.watchdog = None
        if heap is None and timeout_s is not None and group is not None and dist.get_world_size(group) > 1:
            self.watchdog = BarrierWatchdog(timeout_s, group)
        if heap is None:
            group = group if group is not None and dist.get_world_size(group) > 1 else None
            world = 1 if group is None else dist.get_world_size(group)
            rank = 0 if group is None else dist.get_rank(group)
            heap = TorchSymmetricHeap(group)
        self.heap, self.rank, self.world = heap, rank, world
        self.capacity = capacity
        self.lease_slots = lease_slots
        self.poison = poison
        self.pool: LeasePool | None = None
        self.slot_source = None  # a callable returning the dispatch slot's lease instead of the pool (moe/arena.py)
        self._values_scratch: dict[tuple, SymmetricBuffer] = {}
        self._counts: SymmetricBuffer | None = None
        self.return_put, self.max_routes = return_put, max_routes
        # return_put: per dispatched route map, its slot (the rows' return ids), dropped with the
        # route map, as DeepEP's per-route state is (transport/deepep.py); the receive buffers
        self._returns: dict[int, SymmetricBuffer] = {}
        self._receive: dict[tuple, ReceiveBuffer] = {}

    def _ensure_buffers(self, row_width: int, dtype: torch.dtype, device: torch.device) -> None:
        """Dispatch slots hold payload rows (BF16 tokens, or packed MXFP8 viewed as float32) and,
        after them in the same allocation, each row's router probability (buffers.rows_with_values)."""
        if self.pool is not None:
            local = self.pool.slots[0].local
            if local.shape[1] != row_width or local.dtype != dtype:
                raise ValueError(f"this layer's dispatch buffers were allocated for rows of {local.shape[1]} "
                                 f"{local.dtype}, got {row_width} {dtype}: row size and dtype must stay fixed")
            return
        slots = [rows_with_values(self.heap, self.capacity, row_width, dtype, device, return_ids=self.return_put)
                 for _ in range(self.lease_slots)]
        self.pool = LeasePool(slots, poison=self.poison, fence=self.poison_fence)

    def _scratch(self, role: str, rows_like: torch.Tensor):
        """Shared [C, H] scratch for BF16 rows shaped like `rows_like` (combine and backward)."""
        return self.heap.scratch(role, (self.capacity, rows_like.shape[1]), rows_like.dtype, rows_like.device)

    def _scratch_with_values(self, role: str, rows_like: torch.Tensor) -> SymmetricBuffer:
        """Shared scratch of [C, H] rows followed by [C] fp32 values (built once per layer and role)."""
        key = (role, rows_like.shape[1], rows_like.dtype)
        if key not in self._values_scratch:
            self._values_scratch[key] = rows_with_values(self.heap, self.capacity, rows_like.shape[1],
                                                         rows_like.dtype, rows_like.device, scratch_role=role)
        return self._values_scratch[key]

    def _fence(self, buffer: SymmetricBuffer, phase: str) -> None:
        """The phase's barrier, bounded by the peer timeout and watched (no-op with one rank)."""
        buffer.barrier(self.timeout_ms)
        if self.watchdog is not None:
            self.watchdog.record(phase)

    def poison_fence(self, buffer: SymmetricBuffer) -> None:
        """The barrier after a debug poison fill of a buffer peers PUT into (bounded and watched)."""
        self._fence(buffer, "debug poison fence")

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[E] int32 route counts of every EP rank -> [M, E] (this layer's table; PUT + barrier).

        A peer rewrites row r of this table at the layer's next forward, after passing this
        forward's dispatch barrier, which this rank reaches only after the route map read it.
        """
        if self.world == 1:
            return counts[None]
        num_experts = counts.shape[0]
        if self._counts is None:
            self._counts = self.heap.allocate((self.world, num_experts), torch.float32, counts.device)
            self._count_ranks = torch.arange(self.world, dtype=torch.int32, device=counts.device)[None]
            self._count_rows = torch.full((1, self.world), self.rank, dtype=torch.int32, device=counts.device)
        # int32 counts travel as float32 words (the PUT copies bits: no arithmetic without a scale).
        put_rows(counts.to(torch.int32).view(torch.float32)[None], self._count_ranks, self._count_rows,
                 self._counts.peer_table, capacity=self.world)
        self._fence(self._counts, "route-count exchange")
        return self._counts.local.view(torch.int32)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, route: RouteMap):
        if self.slot_source is not None:
            lease = self.slot_source()
        else:
            self._ensure_buffers(tokens.shape[1], tokens.dtype, tokens.device)
            lease = self.pool.acquire()
        slot = lease.buffer
        if self.return_put and slot.return_table is None:
            raise ValueError("return_transfer='put' needs dispatch slots with return ids, and this slot (from "
                             "slot_source) has none: allocate it with return ids (moe/arena.RowArena.allocate)")
        put_rows(tokens.contiguous(), route.dest_rank, route.dest_row, slot.peer_table,
                 route_values=probs.float().contiguous(), value_table=slot.values_table,
                 return_table=slot.return_table if self.return_put else None, source_rank=self.rank,
                 capacity=self.capacity)
        self._fence(slot, "dispatch")
        self._remember_returns(route, slot)
        return slot.local, slot.values, lease

    def _remember_returns(self, route: RouteMap, slot: SymmetricBuffer) -> None:
        """return_put: the slot whose return ids the route map's combine and dispatch backward use."""
        if self.return_put:
            self._returns[id(route)] = slot
            weakref.finalize(route, self._returns.pop, id(route), None)

    def dispatch_quantized(self, tokens: torch.Tensor, probs: torch.Tensor, route: RouteMap):
        """PUT of MXFP8 rows: tokens [T, H] bf16/fp32 are quantized inside the PUT kernel straight
        into the leased slot (no packed staging tensor). Returns (uint8 [C, packed_row_bytes(H)],
        the rows' probabilities [C], lease).

        Slots are float32 [C, P/4] words (byte-viewed for the kernel and the caller), so the
        pool's NaN poisoning and the slot shape are those of dispatch(packed.view(float32)).
        """
        row_bytes = packed_row_bytes(tokens.shape[1])
        self._ensure_buffers(row_bytes // 4, torch.float32, tokens.device)
        lease = self.pool.acquire()
        slot = lease.buffer
        put_rows_mxfp8(tokens.contiguous(), route.dest_rank, route.dest_row, slot.peer_table,
                       route_values=probs.float().contiguous(), value_table=slot.values_table,
                       return_table=slot.return_table if self.return_put else None, source_rank=self.rank,
                       capacity=self.capacity)
        self._fence(slot, "MXFP8 dispatch")
        self._remember_returns(route, slot)
        return slot.local.view(torch.uint8), slot.values, lease

    def combine(self, expert_out: torch.Tensor, route: RouteMap) -> torch.Tensor:
        if self.return_put:
            return self._put_back("combine", expert_out, None, route)[0]
        out = torch.empty(route.dest_row.shape[0], expert_out.shape[1], dtype=expert_out.dtype,
                          device=expert_out.device)
        return self._get("combine_source", expert_out, route, out)

    def combine_backward(self, grad_out: torch.Tensor, route: RouteMap) -> torch.Tensor:
        target = self._scratch("combine_grad", grad_out)
        if self.poison:  # peers PUT into this buffer next: fence the fill before them
            poison_then_fence(target, self.poison_fence)
        put_rows(grad_out, route.dest_rank, route.dest_row, target.peer_table, capacity=self.capacity)
        self._fence(target, "combine backward")
        return target.local

    def dispatch_backward(self, grad_buffer: torch.Tensor, grad_row_probs: torch.Tensor | None, route: RouteMap):
        if self.return_put:
            return self._put_back("dispatch backward", grad_buffer, grad_row_probs, route)
        num_tokens, topk = route.dest_row.shape
        out = torch.empty(num_tokens, grad_buffer.shape[1], dtype=grad_buffer.dtype, device=grad_buffer.device)
        grad_probs = None
        if grad_row_probs is not None:
            grad_probs = torch.empty(num_tokens, topk, dtype=torch.float32, device=grad_buffer.device)
        self._get("dispatch_grad", grad_buffer, route, out, grad_row_probs, grad_probs)
        return out, grad_probs

    def _get(self, role: str, rows: torch.Tensor, route: RouteMap, out: torch.Tensor,
             values: torch.Tensor | None = None, values_out: torch.Tensor | None = None) -> torch.Tensor:
        """A GET phase: each route fetches its row of `rows` (and its value of `values`, [C] fp32, into
        `values_out`) from the rank that owns it, summed into `out`. With one rank nobody else reads
        the rows, so the GET reads them in place (no copy, no address table); at EP > 1 from the
        role's symmetric scratch (_gather_source)."""
        if self.world == 1:
            return get_rows(rows, route.dest_rank, route.dest_row, out, value_table=values, values_out=values_out,
                            capacity=self.capacity, in_place=True)
        source = self._gather_source(role, rows, route, values)
        return get_rows(source.peer_table, route.dest_rank, route.dest_row, out, value_table=source.values_table,
                        values_out=values_out, capacity=self.capacity)

    def _gather_source(self, role: str, rows: torch.Tensor, route: RouteMap, values: torch.Tensor | None = None):
        """EP > 1: copy this rank's received rows (and their per-row `values`, [C] fp32) into the
        role's symmetric scratch and fence the group.

        Only the rows below route.recv_offsets[-1] are copied (a device count): peers' routes
        point at no other row, so the tail, up to C - received rows, is never read. With debug
        poison the tail holds NaN, so a read there would show.
        """
        source = self._scratch(role, rows) if values is None else self._scratch_with_values(role, rows)
        if self.poison:  # written in the same window as the copy: the previous readers passed a barrier
            poison(source)
        copy_rows_below(rows, source.local, route.recv_offsets[-1:],
                        None if values is None else (values, source.values))
        self._fence(source, _PHASE_OF_ROLE[role])
        return source

    def _put_back(self, phase: str, rows: torch.Tensor, values: torch.Tensor | None, route: RouteMap):
        """return_transfer='put' (transport/put_return.py): each owner PUTs its rows below the
        received count (and their values) to their routes' rows of the sources' receive buffers,
        barriers, then each source sums its routes from its own buffer. Returns ([T, H], [T, K]
        fp32 values or None)."""
        slot = self._returns.get(id(route))
        if slot is None:
            raise RuntimeError(f"symm transport: {phase} for a route map this transport never dispatched; the "
                               f"rows' return ids come from dispatch(tokens, probs, route) of the same map")
        num_tokens, topk = route.dest_rank.shape
        if self.max_routes is not None and num_tokens * topk > self.max_routes:
            raise ValueError(f"symm transport: {num_tokens} x {topk} routes, but the receive buffers hold "
                             f"max_routes={self.max_routes}")
        routes = self.max_routes or num_tokens * topk  # the same on every rank: one symmetric allocation
        receive = self._receive_buffer(routes, rows)
        target = receive.buffer
        if self.poison:  # peers PUT into this buffer next: fence the fill before them
            poison_then_fence(target, self.poison_fence)
        put_rows_back(rows, slot.return_ids, route.recv_offsets[-1:], target.peer_table, routes,
                      values=None if values is None else (values, target.values_table))
        self._fence(target, phase)
        return sum_returned(receive, route, self.world, self.capacity, values is not None)

    def _receive_buffer(self, routes: int, rows_like: torch.Tensor) -> ReceiveBuffer:
        key = ("returned_rows", routes, rows_like.shape[1], rows_like.dtype)
        if key not in self._receive:
            self._receive[key] = receive_buffer(self.heap, routes, rows_like)
        return self._receive[key]

    def release(self, lease) -> None:
        if lease is not None:
            lease.release()
