"""Multi-group gradient buckets: each bucket reduced over its own replica group.

Dense parameters (attention, router, shared experts, norms, embeddings) are replicated over
DP x CP; routed-expert parameters only over EP_DP (docs/design.md, "Parallel Folding and DDP buckets"). Reducing an
expert gradient over the full DP would add the gradients of *different* expert shards: it
silently trains a wrong model. This module:

* plans buckets (`plan.plan_buckets`, a pure function): parameters in reverse registration order
  (roughly the order backward produces their gradients), a new bucket whenever the replica
  group or dtype changes or the next parameter would pass the byte cap;
* keeps one flat gradient buffer per bucket and binds every `param.grad` to a view of it, so
  autograd accumulates in place (no copy, no per-parameter collective);
* launches each bucket's async all-reduce from `register_post_accumulate_grad_hook` as soon as
  the bucket and every bucket before it in the plan are ready. The launch sequence is the plan
  order on every rank, whatever order the hooks fire in, so the collectives of the two
  communicators (DP x CP and EP_DP) never interleave differently on different ranks;
* `finish_grad_sync()` launches what is left in the same order and waits on the handles
  (`Work.wait()`: a stream wait on CUDA, not a host sync). A parameter that got no gradient
  this step (an expert that received no tokens) keeps the zeros of its slot: no
  `find_unused_parameters`, no host sync.

Averaging rule (`average_over`): the objective is the mean of the per-rank losses over all
DP x CP ranks, so every group's sum is divided by the size of the dense group (DP x CP). For
expert parameters this is right because the expert-parallel all-to-all already summed the
gradients of the tokens of all EP_MP ranks into the local expert shard; summing over EP_DP then
covers every data-parallel rank once (D*C = M_E*D_E). This equals Megatron's
`gradient_scaling_factor` rule for both buffers. `average_over` overrides the divisor per group
with an int or another group's name (1 = plain sum, e.g. with a per-token loss).

Cost accepted: buckets are pre-scaled in place before the all-reduce (one elementwise pass;
keeps low-precision sums in range); a parameter whose `.grad` was set to None by the caller is
copied into its slot once by its hook (call `zero_grad_buffers()` instead of
`optimizer.zero_grad()` to avoid that copy). Host-side bookkeeping only (sets and counters).
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch
import torch.distributed as dist

from megatron_ext.ddp.plan import (
    DEFAULT_BUCKET_BYTES,
    DENSE,
    EXPERT,
    AssignFn,
    expert_or_dense,
    param_infos,
    plan_buckets,
    resolve_divisors,
)

# ---------------------------------------------------------------- groups from the mesh


def groups_from_folding(folding_groups) -> dict[str, dist.ProcessGroup]:
    """{"dense": DP x CP, "expert": EP_DP} from FoldingMesh.create_groups()."""
    return {DENSE: folding_groups.dp_cp_group, EXPERT: folding_groups.ep_dp_group}


def groups_from_parallel_state() -> dict[str, dist.ProcessGroup]:
    """{"dense": DP x CP, "expert": EP_DP} from Megatron's parallel_state (0.19.2 getters)."""
    from megatron.core import parallel_state as ps

    return {DENSE: ps.get_data_parallel_group(with_context_parallel=True, with_gtp_remat=False),
            EXPERT: ps.get_expert_data_parallel_group(with_gtp_remat=False)}


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _tensor_parallel_size() -> int:
    """Megatron's TP size where its parallel state is initialized (1 otherwise: a loop of one's own)."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _refuse_finalize_reductions(named) -> None:
    """Megatron's finalize_model_grads reduces some gradients beyond the replica groups (0.19.2):
    sequence-parallel norms and router over TP (attribute `sequence_parallel`, or
    `average_gradients_across_tp_domain`), q/k layernorms over TP (by name, with qk_layernorm: each
    TP rank's heads give a partial gradient), the embedding shared by the first and last pipeline
    stages (`shared_embedding`). MultiGroupGradBuckets does not run those reductions, so such a
    model would train each TP rank or stage on its own partial gradient: refused."""
    needs = {"sequence_parallel": "summed over tensor-parallel ranks (sequence parallelism)",
             "average_gradients_across_tp_domain": "averaged over tensor-parallel ranks",
             "shared_embedding": "summed over the first and last pipeline stages (shared embedding)"}
    found = [(name, why) for name, param in named for attr, why in needs.items() if getattr(param, attr, False)]
    qk_norms = [name for name, _ in named if "q_layernorm" in name or "k_layernorm" in name]
    if qk_norms and _tensor_parallel_size() > 1:
        found += [(name, "summed over tensor-parallel ranks (qk_layernorm: each rank's heads give part of it)")
                  for name in qk_norms]
    if found:
        names = ", ".join(repr(name) for name, _ in found[:3]) + (" ..." if len(found) > 3 else "")
        raise ValueError(f"MultiGroupGradBuckets reduces each gradient over its replica group only (DP x CP, EP_DP); "
                         f"{names} must also be {found[0][1]} by Megatron's finalize_model_grads, which it does not "
                         f"run. Use Megatron's DistributedDataParallel with megatron_ext.ddp.megatron_hook "
                         f"(FoldingDistributedDataParallel) and finalize_model_grads for this model")


# ---------------------------------------------------------------- the runtime


class MultiGroupGradBuckets:
    """Flat per-bucket gradient storage for `model`, reduced from backward hooks.

    Use per step::

        buckets.zero_grad_buffers()          # instead of optimizer.zero_grad()
        with buckets.no_sync(): ...backward  # every microbatch but the last (optional)
        loss.backward()                      # launches bucket all-reduces as they fill
        buckets.finish_grad_sync()           # param.grad now holds the averaged gradient
        optimizer.step()

    `groups` maps a group name (what `assign(name, param)` returns) to its process group (None
    = this rank alone). `overlap=False` launches everything in `finish_grad_sync` (debugging).
    """

    def __init__(self, model: torch.nn.Module, groups: Mapping[str, dist.ProcessGroup | None],
                 assign: AssignFn = expert_or_dense, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                 average_over: Mapping[str, int | str] | None = None, overlap: bool = True):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameters that require gradients")
        infos = param_infos(model, assign)
        unknown = sorted({i.group for i in infos} - set(groups))
        if unknown:
            example = next(i.name for i in infos if i.group in unknown)
            raise ValueError(f"assign() returned groups {unknown} (e.g. for {example!r}) that are not "
                             f"in groups {sorted(groups)}")
        _refuse_finalize_reductions(named)
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}; "
                             f"MultiGroupGradBuckets expects one device per rank")
        self.groups = dict(groups)
        self.divisors = resolve_divisors({g: _group_size(pg) for g, pg in self.groups.items()}, average_over)
        self.plan = plan_buckets(infos, bucket_bytes)
        self.overlap = overlap
        by_name = dict(named)
        device = devices.pop()
        self.flat = [torch.zeros(b.numel, dtype=b.dtype, device=device) for b in self.plan]
        self._params: list[list[torch.nn.Parameter]] = []
        self._views: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._bucket_of: dict[torch.nn.Parameter, int] = {}
        for b, flat in zip(self.plan, self.flat):
            params = []
            for slot in b.slots:
                param = by_name[slot.name]
                self._views[param] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                self._bucket_of[param] = b.index
                params.append(param)
            self._params.append(params)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_accumulated) for _, p in named]
        self._sync = True
        self._reset_step_state()
        self._bind_grads()

    # ------------------------------------------------------------ per-step state

    def _reset_step_state(self) -> None:
        self._fired: set[torch.nn.Parameter] = set()
        self._missing = [len(ps) for ps in self._params]  # params not yet ready, per bucket
        self._next_launch = 0
        self._works: list = []
        self.launch_order: list[int] = []  # bucket indices, in the order launched this step
        self.launched_in_backward = 0

    def _bind_grads(self) -> None:
        for param, view in self._views.items():
            param.grad = view

    def _on_grad_accumulated(self, param: torch.nn.Parameter) -> None:
        index = self._bucket_of[param]
        if index < self._next_launch:
            raise RuntimeError(
                f"gradient of {self.plan[index].names[self._params[index].index(param)]!r} arrived "
                f"after bucket {index} was launched: a second backward in one sync step. Run every "
                f"microbatch but the last under no_sync(), then finish_grad_sync().")
        view = self._views[param]
        if param.grad.data_ptr() != view.data_ptr():
            # .grad was None (caller set it to None) or replaced: this is the whole gradient.
            view.copy_(param.grad)
            param.grad = view
        if not self._sync:
            return
        if param in self._fired:
            return
        self._fired.add(param)
        self._missing[index] -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch buckets in plan order while the next one is complete."""
        while self._next_launch < len(self.plan) and self._missing[self._next_launch] == 0:
            self._launch(self._next_launch)
            self.launched_in_backward += 1

    def _launch(self, index: int) -> None:
        bucket, flat = self.plan[index], self.flat[index]
        divisor = self.divisors[bucket.group]
        if divisor != 1:
            flat.mul_(1.0 / divisor)
        group = self.groups[bucket.group]
        if _group_size(group) > 1:
            self._works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True))
        self.launch_order.append(index)
        self._next_launch = index + 1

    # ------------------------------------------------------------ public

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients into the buffers without marking them ready (microbatches)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish_grad_sync(self) -> None:
        """Launch the remaining buckets in plan order and wait for every reduction.

        A parameter whose hook did not fire this step keeps its slot's contents (zeros after
        `zero_grad_buffers()`, or earlier microbatches' sums); if the caller set its .grad to
        None, its slot is zero-filled first. Host bookkeeping only; no device value is read.
        """
        for index in range(self._next_launch, len(self.plan)):
            for param in self._params[index]:
                if param not in self._fired and param.grad is None:
                    self._views[param].zero_()
            self._launch(index)
        for work in self._works:
            work.wait()
        self._bind_grads()
        self._reset_step_state()

    def zero_grad_buffers(self) -> None:
        """Zero every bucket and bind each param.grad to its slot (start of a step)."""
        if self._works or self._next_launch:
            raise RuntimeError("zero_grad_buffers() while reductions are in flight; call finish_grad_sync() first")
        for flat in self.flat:
            flat.zero_()
        self._bind_grads()
        self._reset_step_state()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def describe(self) -> str:
        """One line per bucket: index, group (and divisor), dtype, size, first and last parameter."""
        lines = []
        for b in self.plan:
            lines.append(f"bucket {b.index}: {b.group} / {self.divisors[b.group]}, {b.dtype}, "
                         f"{b.nbytes} bytes, {len(b.slots)} params ({b.names[0]} .. {b.names[-1]})")
        return "\n".join(lines)
