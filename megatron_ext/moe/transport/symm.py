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

The per-layer route-count exchange also runs over symmetric memory (`gather_counts`): each rank
PUTs its [E] counts into row `rank` of every peer's [M, E] table, then barriers. No NCCL call is
left in the layer, so a CUDA graph of it holds no NCCL work (a graph that does keeps
destroy_process_group from returning, pytorch/pytorch#115388).
Works with one GPU (EP=1: the tables hold local buffers only) and with GPUs in one NVLink
domain (CUDA backend of torch symmetric memory, whose buffer_ptrs are peer-mapped addresses).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.kernels.mxfp8_put import put_rows_mxfp8
from megatron_ext.kernels.row_transfer import copy_rows_below, get_rows, put_rows
from megatron_ext.moe.buffers import LeasePool, SymmetricBuffer, SymmetricHeap, TorchSymmetricHeap, poison_then_fence
from megatron_ext.formats.mxfp8 import packed_row_bytes
from megatron_ext.moe.peer_failure import BarrierWatchdog
from megatron_ext.moe.route_map import RouteMap


_PHASE_OF_ROLE = {"combine_source": "combine", "dispatch_grad": "dispatch backward"}


class SymmRowTransport:
    reads_row_source = False  # its kernels need no per-row writer (route maps leave it None)

    def __init__(self, group, capacity: int, lease_slots: int = 1, poison: bool = False,
                 heap: SymmetricHeap | None = None, rank: int | None = None, world: int | None = None,
                 timeout_s: float | None = None):
        """`heap`, `rank` and `world` replace the process group's (simulated peers in tests).
        `timeout_s` bounds every device barrier (moe/peer_failure.py); None: unbounded."""
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
        self._local_tables: dict[str, torch.Tensor] = {}
        self._counts: SymmetricBuffer | None = None

    def _ensure_buffers(self, row_width: int, dtype: torch.dtype, device: torch.device) -> None:
        """Dispatch slots hold payload rows (BF16 tokens, or packed MXFP8 viewed as float32)."""
        if self.pool is not None:
            local = self.pool.slots[0].local
            if local.shape[1] != row_width or local.dtype != dtype:
                raise ValueError(f"this layer's dispatch buffers were allocated for rows of {local.shape[1]} "
                                 f"{local.dtype}, got {row_width} {dtype}: row size and dtype must stay fixed")
            return
        shape = (self.capacity, row_width)
        slots = [self.heap.allocate(shape, dtype, device) for _ in range(self.lease_slots)]
        self.pool = LeasePool(slots, poison=self.poison)

    def _scratch(self, role: str, rows_like: torch.Tensor):
        """Shared [C, H] scratch for BF16 rows shaped like `rows_like` (combine and backward)."""
        return self.heap.scratch(role, (self.capacity, rows_like.shape[1]), rows_like.dtype, rows_like.device)

    def _fence(self, buffer: SymmetricBuffer, phase: str) -> None:
        """The phase's barrier, bounded by the peer timeout and watched (no-op with one rank)."""
        buffer.barrier(self.timeout_ms)
        if self.watchdog is not None:
            self.watchdog.record(phase)

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

    def dispatch(self, tokens: torch.Tensor, route: RouteMap):
        self._ensure_buffers(tokens.shape[1], tokens.dtype, tokens.device)
        lease = self.pool.acquire()
        put_rows(tokens.contiguous(), route.dest_rank, route.dest_row, lease.buffer.peer_table, capacity=self.capacity)
        self._fence(lease.buffer, "dispatch")
        return lease.buffer.local, lease

    def dispatch_quantized(self, tokens: torch.Tensor, route: RouteMap):
        """PUT of MXFP8 rows: tokens [T, H] bf16/fp32 are quantized inside the PUT kernel straight
        into the leased slot (no packed staging tensor). Returns (uint8 [C, packed_row_bytes(H)], lease).

        Slots are float32 [C, P/4] words (byte-viewed for the kernel and the caller), so the
        pool's NaN poisoning and the slot shape are those of dispatch(packed.view(float32)).
        """
        row_bytes = packed_row_bytes(tokens.shape[1])
        self._ensure_buffers(row_bytes // 4, torch.float32, tokens.device)
        lease = self.pool.acquire()
        put_rows_mxfp8(tokens.contiguous(), route.dest_rank, route.dest_row, lease.buffer.peer_table,
                       capacity=self.capacity)
        self._fence(lease.buffer, "MXFP8 dispatch")
        return lease.buffer.local.view(torch.uint8), lease

    def combine(self, expert_out: torch.Tensor, route: RouteMap, probs: torch.Tensor):
        source = self._gather_source("combine_source", expert_out, route)
        num_tokens, topk = route.dest_row.shape
        out = torch.empty(num_tokens, expert_out.shape[1], dtype=expert_out.dtype, device=expert_out.device)
        gathered = torch.empty(num_tokens, topk, expert_out.shape[1], dtype=expert_out.dtype,
                               device=expert_out.device)
        get_rows(source.peer_table, route.dest_rank, route.dest_row, out, probs.float().contiguous(), gathered,
                 capacity=self.capacity)
        return out, gathered

    def combine_backward(self, grad_out: torch.Tensor, route: RouteMap, probs: torch.Tensor) -> torch.Tensor:
        target = self._scratch("combine_grad", grad_out)
        if self.poison:  # peers PUT into this buffer next: fence the fill before them
            poison_then_fence(target)
        put_rows(grad_out, route.dest_rank, route.dest_row, target.peer_table, probs.float().contiguous(),
                 capacity=self.capacity)
        self._fence(target, "combine backward")
        return target.local

    def dispatch_backward(self, grad_buffer: torch.Tensor, route: RouteMap) -> torch.Tensor:
        source = self._gather_source("dispatch_grad", grad_buffer, route)
        out = torch.empty(route.dest_row.shape[0], grad_buffer.shape[1], dtype=grad_buffer.dtype,
                          device=grad_buffer.device)
        return get_rows(source.peer_table, route.dest_rank, route.dest_row, out, capacity=self.capacity)

    def _gather_source(self, role: str, rows: torch.Tensor, route: RouteMap):
        """Copy this rank's received rows into the role's symmetric scratch and fence the group.

        Only the rows below route.recv_offsets[-1] are copied (a device count): peers' routes
        point at no other row, so the tail, up to C - received rows, is never read. With debug
        poison the tail holds NaN, so a read there would show. With one rank nobody else reads
        them: point a one-entry table at `rows` instead (a fill_ kernel with the address as its
        scalar: no copy, no host transfer, capturable).
        """
        if self.world == 1:
            table = self._local_tables.get(role)
            if table is None:
                table = self._local_tables[role] = torch.empty(1, dtype=torch.int64, device=rows.device)
            table.fill_(rows.data_ptr())
            return SymmetricBuffer(rows, table)
        source = self._scratch(role, rows)
        if self.poison:  # written in the same window as the copy: the previous readers passed a barrier
            source.local.fill_(float("nan"))
        copy_rows_below(rows, source.local, route.recv_offsets[-1:])
        self._fence(source, _PHASE_OF_ROLE[role])
        return source

    def release(self, lease) -> None:
        if lease is not None:
            lease.release()
