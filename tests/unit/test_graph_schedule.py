"""Slot counting from pipeline schedules and the runner's eager fallback (CPU)."""

import logging

import pytest
import torch

from megatron_ext.cuda_graphs import GraphedMoELayer, capture_blockers, live_microbatches
from megatron_ext.config import MoEExtConfig


@pytest.mark.parametrize("pp,rank,mbs,vpp,expected", [
    (1, 0, 8, None, 1),      # no pipeline
    (1, 0, 8, 2, 1),         # no pipeline whatever the virtual stages: Megatron runs no pipelining at pp 1
    (4, 0, 8, None, 4),      # 1F1B first stage: 3 warm-up forwards + 1
    (4, 3, 8, None, 1),      # last stage: forward then backward
    (4, 1, 2, None, 2),      # bounded by the microbatches of the step
    (4, 0, 8, 2, 8),         # interleaved: (4-0-1)*2 + (2-1)*4 = 10 warm-up, bounded by 8
    (2, 1, 8, 2, 3),         # interleaved last stage: 0 + 2 warm-up + 1
    (4, 0, 8, 1, 4),         # one virtual stage is 1F1B (Megatron's arguments turn it into None): 3 + 1
    (4, 1, 8, 1, 3),         # 1F1B second stage: 2 warm-up forwards + 1
])
def test_live_microbatches(pp, rank, mbs, vpp, expected):
    assert live_microbatches(pp, rank, mbs, vpp) == expected


def test_live_microbatches_rejects_bad_input():
    with pytest.raises(ValueError, match="outside a pipeline"):
        live_microbatches(2, 2, 4)
    with pytest.raises(ValueError, match=r"size \(4\) between the pipeline size \(4\) and the microbatches \(3\)"):
        live_microbatches(4, 0, 3, vpp_size=2)
    with pytest.raises(ValueError, match="num_microbatches \\(6\\) modulo the microbatch group size \\(4\\)"):
        live_microbatches(4, 0, 6, vpp_size=2)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1, got 0"):
        live_microbatches(2, 0, 0)
    with pytest.raises(ValueError, match=r"group size \(2\) between the pipeline size \(4\)"):
        live_microbatches(4, 0, 8, 2, 2)  # a group smaller than the pipeline


def test_a_group_of_all_the_microbatches_is_accepted():
    # the bounds are inclusive: groups equal to the pipeline size and to the step's microbatches
    assert live_microbatches(4, 0, 4, 2) == 4
    assert live_microbatches(2, 1, 4, 2, 4) == 4


def _peak_live_on_a_layer(pp, rank, microbatches, vpp, group, overlap) -> int:
    """Brute force: walk megatron-core's own interleaved (or 1F1B) order for one stage, forwards of
    virtual microbatch k + warm-up before backwards of k, and count the microbatches live in each chunk."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    chunks = vpp or 1
    table = get_schedule_table(microbatches, chunks, group or pp) if vpp else [(m, 0) for m in range(microbatches)]
    total = len(table)
    warmup = pp - rank - 1 if not vpp else (pp - rank - 1) * 2 + (chunks - 1) * (group or pp) + int(overlap)
    warmup = min(warmup, total)
    live, peak = [0] * chunks, 0
    order = [("F", k) for k in range(warmup)]
    order += [step for k in range(total - warmup) for step in (("F", k + warmup), ("B", k))]
    order += [("B", k) for k in range(total - warmup, total)]
    for kind, k in order:
        chunk = table[k][1]
        if kind == "F":
            live[chunk] += 1
            peak = max(peak, live[chunk])
        else:
            live[chunks - 1 - chunk] -= 1  # backwards visit the chunks in reverse
    assert live == [0] * chunks
    return peak


@pytest.mark.parametrize("pp,microbatches,vpp,group,overlap", [
    (4, 8, None, None, False), (2, 8, 2, None, False), (2, 8, 2, 4, False), (2, 8, 2, 4, True),
    (4, 8, 2, None, False), (2, 5, 2, 3, False), (4, 16, 4, 8, True), (3, 9, 3, None, False),
])
def test_live_microbatches_bounds_megatrons_schedule(pp, microbatches, vpp, group, overlap):
    """The slot count covers every stage's peak in megatron-core's schedule, and is that peak where
    one chunk's warm-up alone reaches it (pp 2, group 4: the reviewer's 7 and 8)."""
    for rank in range(pp):
        peak = _peak_live_on_a_layer(pp, rank, microbatches, vpp, group, overlap)
        assert live_microbatches(pp, rank, microbatches, vpp, group, overlap) >= peak, (rank, peak)
    if (pp, microbatches, vpp, group) == (2, 8, 2, 4):
        assert live_microbatches(2, 0, 8, 2, 4, overlap) == _peak_live_on_a_layer(2, 0, 8, 2, 4, overlap) == 7 + overlap


class _EagerLayer(torch.nn.Module):
    def __init__(self, ext_config=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.ext_config = ext_config

    def forward(self, x):
        return x @ self.weight, None


def test_capture_blockers_name_the_reason():
    x = torch.randn(2, 4)
    assert any("GPU" in r for r in capture_blockers(_EagerLayer(MoEExtConfig()), x))
    assert any("rowwise" in r for r in capture_blockers(_EagerLayer(None), x))
    assert any("rowwise" in r for r in capture_blockers(_EagerLayer(MoEExtConfig(dispatcher="megatron")), x))
    assert not any("rowwise" in r for r in capture_blockers(_EagerLayer(MoEExtConfig()), x))
    assert any("debug_checks" in r for r in capture_blockers(_EagerLayer(MoEExtConfig(debug_checks=True)), x))


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


class _Router:
    def __init__(self, tp_cp: int, tp_dp_cp: int, coeff: float, kind: str = "aux_loss"):
        self.tp_cp_group, self.tp_dp_cp_group, self.coeff, self.kind = _Group(tp_cp), _Group(tp_dp_cp), coeff, kind

    def get_aux_loss_coeff(self, kind):
        return self.coeff if kind == self.kind else 0.0


@pytest.mark.parametrize("tp_cp,tp_dp_cp,coeff,kind,blocked", [
    (2, 2, 0.01, "aux_loss", True), (1, 4, 0.01, "aux_loss", False), (2, 2, 0.0, "aux_loss", False),
    (2, 1, 0.01, "seq_aux_loss", True), (1, 4, 0.01, "seq_aux_loss", False),
    (1, 4, 0.01, "global_aux_loss", True), (1, 1, 0.01, "global_aux_loss", False)])
def test_a_load_balancing_all_reduce_blocks_capture(tp_cp, tp_dp_cp, coeff, kind, blocked):
    layer = _EagerLayer(MoEExtConfig())
    layer.router = _Router(tp_cp, tp_dp_cp, coeff, kind)
    reasons = capture_blockers(layer, torch.randn(2, 4))
    assert any("load-balancing loss all-reduces" in r for r in reasons) == blocked, reasons


def test_runner_falls_back_to_eager_with_a_logged_reason(caplog):
    layer = _EagerLayer(MoEExtConfig())
    runner = GraphedMoELayer(layer, num_slots=1)
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING):
        out, _ = runner(x)
    assert torch.equal(out, x @ layer.weight)
    assert "runs eagerly" in caplog.text and "GPU" in runner.eager_reason
    out, _ = runner(x)  # the reason stands: no second attempt, no second warning
    assert torch.equal(out, x @ layer.weight) and caplog.text.count("runs eagerly") == 1


def test_slots_need_as_many_leases():
    with pytest.raises(ValueError, match="lease-slots >= 2"):
        GraphedMoELayer(_EagerLayer(MoEExtConfig(lease_slots=1)), num_slots=2)


@pytest.mark.parametrize("tp_cp,blocked", [(2, True), (1, False)])
def test_quantile_balancings_logit_gather_blocks_capture(tp_cp, blocked):
    """Megatron's quantile-balancing routing all-gathers the router logits over TP x CP in its forward
    (megatron-core 0.19.2, TopKRouter.quantile_balancing): NCCL inside the layer, with no aux loss."""
    layer = _EagerLayer(MoEExtConfig())
    layer.router = _Router(tp_cp, tp_cp, 0.0)
    layer.router.routing_type = "quantile_balancing"
    reasons = [r for r in capture_blockers(layer, torch.randn(2, 4)) if "GPU" not in r]
    assert reasons == ([
        "Megatron's quantile-balancing routing (--moe-router-load-balancing-type quantile_balancing) all-gathers "
        "the router logits over TP x CP (NCCL) inside the layer, and a graph holding NCCL work keeps "
        "destroy_process_group from returning (pytorch/pytorch#115388)"] if blocked else []), reasons


def test_megatrons_quantile_balancing_still_gathers_over_tp_cp():
    """If this fails, revisit runner._quantile_gather (megatron-core moved or dropped the gather)."""
    import inspect

    from megatron.core.transformer.moe.router import TopKRouter

    source = inspect.getsource(TopKRouter.quantile_balancing)
    assert "gather_group = self.tp_cp_group" in source and "all_gather_into_tensor" in source
