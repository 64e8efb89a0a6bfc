"""The replica checker's verdicts on hand-made replicas (ddp/replica_check.py): what must count as a
disagreement (swapped elements, drift below fp32 resolution, a difference of 1e-20) and what must not
(identical NaNs), the message's count of further parameters, and its argument errors. The training
cases live in test_ddp_buckets.py.
"""

import pytest
import torch

from megatron_ext.cpu_ranks import run_on_ranks
from megatron_ext.ddp.replica_check import ReplicaMismatch, check_replicas, maybe_check_replicas

# case -> (rank 0's values, rank 1's values, dtype, should the checker report it?)
CASES = {
    "swapped elements": ([1.0, 2.0, 3.0], [2.0, 1.0, 3.0], torch.float32, True),  # same sum and sum of squares
    "identical NaNs": ([float("nan"), 1.0], [float("nan"), 1.0], torch.float32, False),
    "a 1e-20 difference": ([0.0, 0.0], [0.0, 1e-20], torch.float32, True),  # bitwise means no absolute slack
    "fp64 drift below fp32 resolution": ([1.0], [1.0 + 1e-12], torch.float64, True),
    "equal": ([0.5, -2.0], [0.5, -2.0], torch.bfloat16, False),
}


def _one_parameter(values, dtype):
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.tensor(values, dtype=dtype))
    return model


def _verdicts_rank(rank, world):
    group = {"dense": torch.distributed.group.WORLD}
    verdicts = {}
    for case, (first, second, dtype, _) in CASES.items():
        verdicts[case] = check_replicas(_one_parameter(first if rank == 0 else second, dtype), group,
                                        lambda name, param: "dense")
    three = torch.nn.Module()  # three parameters that all disagree: one raised message, "2 more"
    for i in range(3):
        setattr(three, f"w{i}", torch.nn.Parameter(torch.full((2,), float(rank))))
    with pytest.raises(ReplicaMismatch) as raised:
        check_replicas(three, group, lambda name, param: "dense", raise_on_mismatch=True)
    return verdicts, str(raised.value)


def test_the_checker_reports_exactly_the_disagreeing_replicas():
    for verdicts, raised in run_on_ranks(_verdicts_rank, 2):
        for case, (_, _, _, bad) in CASES.items():
            assert bool(verdicts[case]) == bad, (case, verdicts[case])
        assert raised.startswith("parameter 'w0' differs between replicas: rank 0 vs rank 1")
        assert raised.endswith("(2 more parameters disagree)"), raised


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="put 'weight' in group 'expert', which is not in \\['dense'\\]"):
        check_replicas(torch.nn.Linear(1, 1), {"dense": None}, lambda name, param: "expert")
    with pytest.raises(ValueError, match="every_n must be >= 0 \\(0 = never\\), got -1"):
        maybe_check_replicas(0, -1, torch.nn.Linear(1, 1), {"dense": None})
