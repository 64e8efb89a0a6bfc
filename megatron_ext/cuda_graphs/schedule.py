"""How many microbatches of one layer are alive at once under Megatron's pipeline schedules.

A microbatch is alive in a layer from its forward until its backward. That count is the
number of graph slots and dispatch-buffer leases a layer needs (docs/design.md, "CUDA graphs"): one slot per layer
is overwritten as soon as a second microbatch runs forward before the first one's backward.
"""

from __future__ import annotations


def live_microbatches(pp_size: int, pp_rank: int, num_microbatches: int, vpp_size: int | None = None,
                      microbatch_group_size: int | None = None,
                      overlap_moe_expert_parallel_comm: bool = False) -> int:
    """Peak number of microbatches in flight on one layer of pipeline stage `pp_rank` (an upper bound).

    No pipeline: 1 (forward then backward of each microbatch). 1F1B: the stage runs
    pp_size - pp_rank - 1 warm-up forwards, then one more forward before its first backward.
    Interleaved (vpp_size model chunks per stage, Megatron's --microbatch-group-size-per-virtual-pipeline-stage
    `microbatch_group_size`, default pp_size): megatron-core 0.19.2 runs
    (pp_size - pp_rank - 1) * 2 + (vpp_size - 1) * microbatch_group_size warm-up forwards across all
    chunks, one more with --overlap-moe-expert-parallel-comm, before the first backward; every layer
    is sized for all of them plus one (the layers of one chunk see only their share). Never more
    than the step's microbatches. tests/unit/test_graph_schedule.py checks the bound against
    Megatron's own schedule table.
    """
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside a pipeline of size {pp_size}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if pp_size == 1:
        return 1
    if vpp_size is None or vpp_size == 1:
        warmup = pp_size - pp_rank - 1
    else:
        group = pp_size if microbatch_group_size is None else microbatch_group_size
        if not pp_size <= group <= num_microbatches:
            raise ValueError(f"the interleaved schedule needs the microbatch group size ({group}) between the "
                             f"pipeline size ({pp_size}) and the microbatches ({num_microbatches})")
        if 0 < num_microbatches % group < pp_size:
            raise ValueError(f"the interleaved schedule needs num_microbatches ({num_microbatches}) modulo the "
                             f"microbatch group size ({group}) to be 0 or >= the pipeline size ({pp_size})")
        warmup = (pp_size - pp_rank - 1) * 2 + (vpp_size - 1) * group + int(overlap_moe_expert_parallel_comm)
    return min(warmup + 1, num_microbatches)
