"""The CPU shims (megatron_ext/_cpu.py): each replaced Megatron name does what the code it stands in
for does on GPUs, and check_shim_targets refuses a Megatron that moved or re-signed a target."""

import pytest
import torch

from megatron_ext import _cpu
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks

ALL_SHIMS = ["dynamo", "streams", "device", "rng", "split_sizes", "uneven_all_gather", "sequence_parallel_norm"]


@pytest.fixture(autouse=True)
def _cpu_only():
    if torch.cuda.is_available():
        pytest.skip("the shims apply only without CUDA")


def test_shims_are_applied_once_however_often_asked():
    """tests/conftest.py applies them, so does every run_on_ranks: a second application would wrap the
    wrappers again and list every shim twice."""
    assert _cpu.apply_cpu_shims() == ALL_SHIMS
    assert _cpu.apply_cpu_shims() == ALL_SHIMS


def test_check_shim_targets_refuses_a_renamed_parameter_a_missing_name_and_another_version(monkeypatch):
    renamed = [("megatron.core.parallel_state", "initialize_model_parallel",
                ("tensor_model_parallel_size", "tensor_parallel_size"))]
    monkeypatch.setattr(_cpu, "SHIM_TARGETS", renamed)
    with pytest.raises(RuntimeError, match=r"initialize_model_parallel changed: parameters \['tensor_parallel_size'\] "
                                           r"are gone"):
        _cpu.check_shim_targets()
    monkeypatch.setattr(_cpu, "SHIM_TARGETS", [("megatron.core.parallel_state", "no_such_function", ())])
    with pytest.raises(RuntimeError, match="CPU shim target megatron.core.parallel_state.no_such_function no longer "
                                           "exists"):
        _cpu.check_shim_targets()
    monkeypatch.setattr(_cpu, "SHIM_TARGETS", [])
    _cpu.check_shim_targets()  # the installed Megatron is the one the shims were written for
    monkeypatch.setattr(_cpu, "MEGATRON_VERSION", "0.18.0")
    with pytest.raises(RuntimeError, match="written for megatron-core 0.18.0, found 0.19.2"):
        _cpu.check_shim_targets()


def test_split_sizes_become_numpy_only_when_asked():
    """Megatron's alltoall dispatcher asks for numpy split sizes (all_to_all_single's lists)."""
    import numpy as np
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    sizes = torch.tensor([3, 0, 5])
    for move in (moe_utils.maybe_move_tensor_to_cpu, token_dispatcher.maybe_move_tensor_to_cpu):
        as_numpy = move(sizes, as_numpy=True)
        assert isinstance(as_numpy, np.ndarray) and as_numpy.tolist() == [3, 0, 5]
        assert torch.is_tensor(move(sizes, as_numpy=False))


def _uneven_gather(rank, world):
    from megatron.core.tensor_parallel import mappings

    rows = [torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]), torch.tensor([[10.0, 11.0]])][rank]
    group = torch.distributed.group.WORLD
    return mappings._gather_along_first_dim(rows, group, output_split_sizes=[3, 1]).tolist()


def test_uneven_all_gather_returns_each_ranks_rows_and_nothing_else():
    """gloo has no uneven all_gather: the shim pads to the longest and trims each rank's rows back."""
    want = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [10.0, 11.0]]
    assert run_on_ranks(_uneven_gather, 2, timeout=60) == [want, want]


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("normalization,norm_type", [("RMSNorm", torch.nn.RMSNorm), ("LayerNorm", torch.nn.LayerNorm)])
def test_torch_norm_under_sequence_parallel_tags_its_parameters(sequence_parallel, normalization, norm_type):
    """Tagged like FusedLayerNorm's, so finalize_model_grads all-reduces them over TP."""
    import types

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = types.SimpleNamespace(normalization=normalization, sequence_parallel=sequence_parallel)
    norm = WrappedTorchNorm(config, 8, eps=1e-6)
    assert type(norm) is norm_type and norm.eps == 1e-6 and tuple(norm.weight.shape) == (8,)
    assert [p.sequence_parallel for p in norm.parameters()] == [sequence_parallel] * len(list(norm.parameters()))


def _model_parallel_draws(rank, world):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.manual_seed(99)  # the default generator elsewhere: the tracker's state must not depend on it
    with get_cuda_rng_tracker().fork():  # "model-parallel-rng", seeded by init_megatron_parallel (1234)
        tracked = torch.rand(3).tolist()
    return tracked, torch.rand(3).tolist()


def test_the_model_parallel_rng_is_seeded_by_megatrons_formula_and_leaves_the_default_generator():
    """On CPU the tracker's states are CPU generator states: model_parallel_cuda_manual_seed(1234) seeds
    the model-parallel one with 1234 + 2718 + tp_rank (megatron-core 0.19.2), and a fork restores the
    default generator afterwards."""
    tracked, after = run_on_ranks(_model_parallel_draws, 1, sizes=ParallelSizes(), timeout=60)[0]
    assert tracked == torch.rand(3, generator=torch.Generator().manual_seed(1234 + 2718)).tolist()
    assert after == torch.rand(3, generator=torch.Generator().manual_seed(99)).tolist()
