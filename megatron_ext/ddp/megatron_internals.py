"""The guard of megatron_ext.ddp.megatron_hook: every private Megatron DDP name, signature and
assignment the hook relies on (megatron-core 0.19.2, megatron/core/distributed/).

`check_megatron_ddp_internals()` raises MegatronInternalsChanged naming each one that moved, was
renamed or changed its signature; the hook calls it before touching a DDP, and a CPU test calls it
on every run. Re-exported by megatron_ext.ddp.megatron_hook.
"""

from __future__ import annotations

import inspect

from megatron_ext.rules import MEGATRON_VERSION, MegatronInternalsChanged  # noqa: F401 - re-exported


def _params(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def check_megatron_ddp_internals() -> None:
    """Raise MegatronInternalsChanged listing every Megatron DDP internal that is not as in 0.19.2."""
    import megatron.core
    from megatron.core.distributed import distributed_data_parallel as ddp_module
    from megatron.core.distributed import param_and_grad_buffer as buffer_module

    problems: list[str] = []

    def attribute(owner, name: str, where: str):
        value = getattr(owner, name, None)
        if value is None:
            problems.append(f"{where}.{name} no longer exists")
        return value

    def parameters(fn, names: tuple[str, ...], where: str):
        if fn is None:
            return
        missing = [n for n in names if n not in _params(fn)]
        if missing:
            problems.append(f"{where} lost parameters {missing} (now {_params(fn)})")

    def assigns(fn, snippets: tuple[str, ...], where: str):
        if fn is None:
            return
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            problems.append(f"{where}: source not available to check (installed without .py files?)")
            return
        for snippet in snippets:
            if snippet not in source:
                problems.append(f"{where} no longer contains `{snippet}`")

    ddp_name = "distributed_data_parallel.DistributedDataParallel"
    ddp_cls = attribute(ddp_module, "DistributedDataParallel", "distributed_data_parallel")
    if ddp_cls is not None:
        parameters(ddp_cls.__init__, ("config", "ddp_config", "module", "disable_bucketing", "pg_collection"),
                   f"{ddp_name}.__init__")
        assigns(ddp_cls.__init__, ("self.bucket_groups = partition_buckets(",
                                   "self.expert_parallel_bucket_groups = partition_buckets(",
                                   "self.expert_parallel_buffers.append(buffer)",
                                   "data_parallel_group = self.intra_expt_dp_group",
                                   "data_parallel_group = self.intra_dp_cp_group",
                                   "self.param_to_bucket_group[param] = bucket_group"), f"{ddp_name}.__init__")
        for method, names in (("finish_grad_sync", ("force_all_reduce",)), ("start_grad_sync", ()),
                              ("zero_grad_buffer", ()), ("no_sync", ())):
            parameters(attribute(ddp_cls, method, ddp_name), names, f"{ddp_name}.{method}")
    partition = attribute(buffer_module, "partition_buckets", "param_and_grad_buffer")
    parameters(partition, ("buffers", "force_single_bucket_group"), "param_and_grad_buffer.partition_buckets")
    if partition is not None and getattr(ddp_module, "partition_buckets", None) is not partition:
        problems.append("distributed_data_parallel.partition_buckets is no longer param_and_grad_buffer's")

    group_name = "param_and_grad_buffer._ParamAndGradBucketGroup"
    group_cls = attribute(buffer_module, "_ParamAndGradBucketGroup", "param_and_grad_buffer")
    if group_cls is not None:
        parameters(group_cls.__init__, ("buckets", "ddp_config", "collective_group", "collective_group_size"),
                   f"{group_name}.__init__")
        assigns(group_cls.__init__, ("self.data_parallel_group = collective_group",
                                     "self.intra_distributed_optimizer_instance_group = collective_group",
                                     "self.grad_reduce_handle = None", "self.grad_reduce_finished = False",
                                     "self.is_first_batch = True"), f"{group_name}.__init__")
        for method, names in (("start_grad_sync", ("force_all_reduce",)), ("finish_grad_sync", ("force_all_reduce",)),
                              ("register_grad_ready", ("param", "force_all_reduce")), ("reset", ())):
            parameters(attribute(group_cls, method, group_name), names, f"{group_name}.{method}")
        for method in ("register_grad_ready", "finish_grad_sync"):
            assigns(getattr(group_cls, method, None), ("self.start_grad_sync(",), f"{group_name}.{method}")
    bucket_cls = attribute(buffer_module, "_ParamAndGradBucket", "param_and_grad_buffer")
    if bucket_cls is not None:
        assigns(bucket_cls.__init__, ("self.params_list", "self.grad_data", "self.gradient_scaling_factor"),
                "param_and_grad_buffer._ParamAndGradBucket.__init__")
    buffer_cls = attribute(buffer_module, "_ParamAndGradBuffer", "param_and_grad_buffer")
    if buffer_cls is not None:
        assigns(buffer_cls.__init__, ("self.data_parallel_group = data_parallel_group", "self.buckets"),
                "param_and_grad_buffer._ParamAndGradBuffer.__init__")
    if problems:
        raise MegatronInternalsChanged(
            f"megatron_ext.ddp.megatron_hook was written against megatron-core {MEGATRON_VERSION}; the "
            f"installed megatron-core {megatron.core.__version__} changed what it relies on "
            f"(megatron/core/distributed/):\n  - " + "\n  - ".join(problems))
