"""Runtime shims that let Megatron-Core 0.19.2 run MoE layers and GPTModel on CPU with gloo.

Applied only when CUDA is absent, and only by the tests and the CPU main job
(`apply_cpu_shims()`); the package itself never calls it. Nothing in Megatron's files is
edited: each shim replaces one named function or attribute at runtime, says why, and is
listed in `SHIM_TARGETS` so `tests/unit/test_cpu_shims.py` fails loudly when Megatron
moves or re-signs what a shim relies on.

Written against megatron-core 0.19.2; each shim's docstring names the Megatron code it works
around.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from megatron_ext.rules import MEGATRON_VERSION

# (module, attribute, parameter names the shim assumes) for every Megatron name we replace.
SHIM_TARGETS = [
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", ("device", "clone", "graph_safe")),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", ("new_state", "device", "graph_safe")),
    ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", ("tensor", "as_numpy", "record_stream")),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
     ("tensor", "as_numpy", "record_stream")),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim",
     ("input_", "group", "output_split_sizes", "use_global_buffer")),
    ("megatron.core.transformer.torch_norm", "WrappedTorchNorm", ("config", "hidden_size", "eps")),
]

_applied: list[str] = []


def applied_shims() -> list[str]:
    """Names of the shims applied in this process, in order."""
    return list(_applied)


class _HostEvent:
    """Stands in for torch.cuda.Event: on CPU every op has finished when it returns."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _HostStream:
    """Stands in for torch.cuda.Stream: one serial host stream, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _HostEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


_HOST_STREAM = _HostStream()


def _shim_dynamo():
    # megatron.core.jit: `jit_fuser = torch.compile` decorates router and dispatcher helpers at
    # import time; on CPU each compile goes through inductor+gcc (~15 s apiece). Run them eagerly.
    import torch._dynamo

    torch._dynamo.config.disable = True
    _applied.append("dynamo")


def _shim_streams():
    # token_dispatcher.MoEAlltoAllTokenDispatcher.__init__ creates torch.cuda.Stream() and
    # _maybe_dtoh_and_synchronize uses current_stream()/stream()/Event; shared experts likewise.
    torch.cuda.Stream = _HostStream
    torch.cuda.Event = _HostEvent
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM
    torch.cuda.default_stream = lambda device=None: _HOST_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    _applied.append("streams")


def _shim_device():
    # Megatron passes torch.cuda.current_device() as `device=` in ~200 places (router.gating,
    # mappings._gather_along_first_dim, _AllToAll, ...). On CPU that device is the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    _applied.append("device")


def _shim_rng():
    # tensor_parallel.random.CudaRNGStatesTracker (used by model_parallel_cuda_manual_seed,
    # attention dropout and expert init) reads and writes the CUDA generator. Map it onto the
    # CPU default generator. torch.manual_seed calls torch.cuda.manual_seed_all, which must
    # therefore not recurse into the CPU generator again.
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    # The tracker warns when the CPU generator moves inside a "GPU" RNG fork; here they are the
    # same generator by construction, so the warning carries no information.
    import logging

    logging.getLogger(mrandom.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())
    _applied.append("rng")


def _shim_split_sizes():
    # moe_utils.maybe_move_tensor_to_cpu converts split sizes to numpy only for CUDA tensors, so
    # on CPU the alltoall dispatcher hands tensors to all_to_all_single (TypeError). The
    # dispatcher imported the name, so both module globals are replaced.
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _applied.append("split_sizes")


def _shim_uneven_all_gather():
    # mappings._gather_along_first_dim(output_split_sizes=...) (alltoall dispatcher with
    # expert-TP > 1) relies on NCCL's uneven all_gather; gloo rejects it. Pad, gather, trim.
    import megatron.core.tensor_parallel.mappings as mappings

    from megatron_ext.moe.route_map import gather_into_one_tensor

    original = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((longest * group.size(),) + tuple(input_.shape[1:]))
        gather_into_one_tensor(gathered, padded.contiguous(), group=group)
        return torch.cat([gathered[i * longest : i * longest + s] for i, s in enumerate(sizes)], dim=0)

    mappings._gather_along_first_dim = _gather_along_first_dim
    _applied.append("uneven_all_gather")


def _shim_sequence_parallel_norm():
    # torch_norm.WrappedTorchNorm (the only norm without TE/apex) asserts not sequence_parallel,
    # but MoE with TP>1 requires SP in training. Allow it and tag the parameters the way
    # FusedLayerNorm does, so finalize_model_grads all-reduces them over TP.
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                zero_centered_gamma=False, normalization="LayerNorm"):
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm

    WrappedTorchNorm.__new__ = __new__
    _applied.append("sequence_parallel_norm")


def check_shim_targets() -> None:
    """Raise if a Megatron name a shim replaces is gone or changed its parameters."""
    import importlib

    import megatron.core

    if megatron.core.__version__.split("+")[0] != MEGATRON_VERSION:  # "+<git hash>" local builds too
        raise RuntimeError(
            f"megatron_ext._cpu was written for megatron-core {MEGATRON_VERSION}, found "
            f"{megatron.core.__version__}; re-check every shim against the new version.")
    for module_name, attr, params in SHIM_TARGETS:
        module = importlib.import_module(module_name)
        target = getattr(module, attr, None)
        if target is None:
            raise RuntimeError(f"CPU shim target {module_name}.{attr} no longer exists")
        signature_of = target.__new__ if inspect.isclass(target) else target
        if getattr(signature_of, "__module__", "").startswith("megatron_ext"):
            continue  # already shimmed in this process
        found = tuple(inspect.signature(signature_of).parameters)
        missing = [p for p in params if p not in found]
        if missing:
            raise RuntimeError(
                f"CPU shim target {module_name}.{attr} changed: parameters {missing} are gone "
                f"(now {found})")


def apply_cpu_shims() -> list[str]:
    """Apply every shim once (idempotent). A no-op on machines with CUDA."""
    if torch.cuda.is_available() or _applied:
        return applied_shims()
    # Shims that must precede `import megatron.core` first, then the ones that patch it.
    _shim_dynamo()
    _shim_streams()
    _shim_device()
    check_shim_targets()
    _shim_rng()
    _shim_split_sizes()
    _shim_uneven_all_gather()
    _shim_sequence_parallel_norm()
    return applied_shims()
