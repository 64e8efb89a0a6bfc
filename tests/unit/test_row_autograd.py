"""The dispatch autograd node: probabilities travel with the rows, and the layer's persistent slot
tensors never carry a step's graph (which would keep the router weight's gradient accumulator
alive into the next step and break a later CUDA-graph capture)."""

from __future__ import annotations

import torch

from megatron_ext.moe.route_map import route
from megatron_ext.moe.row_autograd import combine_rows, dispatch_rows
from megatron_ext.moe.transport.torch_ref import TorchRowTransport


class _PersistentSlotTransport(TorchRowTransport):
    """The torch transport, but dispatch returns the same two tensor objects every call, as the
    symm transport's leased slots do."""

    def __init__(self, capacity: int):
        super().__init__(None, capacity)
        self.slot_rows = self.slot_probs = None

    def dispatch(self, tokens, probs, route_map):
        rows, row_probs, lease = super().dispatch(tokens, probs, route_map)
        if self.slot_rows is None:
            self.slot_rows, self.slot_probs = rows.clone(), row_probs.clone()
        self.slot_rows.copy_(rows)
        self.slot_probs.copy_(row_probs)
        return self.slot_rows, self.slot_probs, lease


def test_dispatch_matches_dense_and_leaves_slot_tensors_without_history():
    gen = torch.Generator().manual_seed(0)
    T, E, K, H, C = 12, 4, 2, 8, 24
    top_idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).sort(1).values
    route_map = route(top_idx, num_experts=E, capacity=C)
    transport = _PersistentSlotTransport(C)
    tokens = torch.randn(T, H, generator=gen, requires_grad=True)
    probs = torch.rand(T, K, generator=gen, requires_grad=True)
    rows, row_probs, _ = dispatch_rows(tokens, probs, transport, route_map)
    assert transport.slot_rows.grad_fn is None and transport.slot_probs.grad_fn is None
    assert rows.grad_fn is not None and row_probs.grad_fn is not None
    scale = torch.linspace(0.5, 2.0, C)[:, None]  # a per-row "expert": out = p * scale * row
    out = combine_rows(row_probs[:, None] * scale * rows, transport, route_map, (T, H))
    grad_out = torch.randn(T, H, generator=gen)
    out.backward(grad_out)
    # Dense from the definition: out[t] = sum_k p[t, k] * scale[dest_row[t, k]] * x[t] (all kept at C = 24).
    assert bool((route_map.dest_row >= 0).all())
    s = scale[route_map.dest_row.long(), 0]  # [T, K]
    x, p = tokens.detach(), probs.detach()
    torch.testing.assert_close(out.detach(), (p * s).sum(1, keepdim=True) * x)
    torch.testing.assert_close(tokens.grad, (p * s).sum(1, keepdim=True) * grad_out)
    torch.testing.assert_close(probs.grad, s * (grad_out * x).sum(1, keepdim=True))


class _LeasingTransport(TorchRowTransport):
    """The torch transport holding each dispatch's buffer until the dispatch backward, as the symm
    transport's LeasePool does: `live` counts the leases taken and not released."""

    leases_dispatch_buffers = True

    def __init__(self, capacity: int):
        super().__init__(None, capacity)
        self.live = 0

    def dispatch(self, tokens, probs, route_map):
        rows, row_probs, _ = super().dispatch(tokens, probs, route_map)
        self.live += 1
        return rows, row_probs, "lease"

    def release(self, lease) -> None:
        self.live -= lease == "lease"


def _frozen_router_rank(rank, world, keep_backward):
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.moe import dispatcher
    from megatron_ext.specs import moe_builder
    from megatron_ext.testing.megatron_moe import load_weights, moe_config
    from megatron_ext.testing.reference import MoEWeights

    dispatcher.make_transport = lambda ext_config, group, capacity, device, **_: _LeasingTransport(capacity)
    if not keep_backward:  # the mutation: no probability leaf for a dispatch that needs no gradient
        dispatcher.RowwiseTokenDispatcher._keep_dispatch_backward = lambda self, hidden, probs: probs
    grads, live = [], []
    for frozen in (False, True):
        layer = moe_builder(MoEExtConfig(transport="torch"))(config=moe_config(hidden=16, ffn=8, experts=4, topk=2,
                                                                                ep=1))
        load_weights(layer, MoEWeights.random(4, 16, 8, seed=5))
        layer.router.weight.requires_grad_(not frozen)
        x = torch.randn(12, 1, 16, generator=torch.Generator().manual_seed(1), requires_grad=not frozen)
        layer(x)[0].square().sum().backward()
        live.append(layer.token_dispatcher.transport.live)
        grads.append([layer.experts.fc1_weight.grad, layer.experts.fc2_weight.grad])
    return live, all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_dispatch_that_needs_no_gradient_still_releases_its_lease():
    """Expert-only training (input and router frozen): autograd would skip the dispatch backward,
    which releases a leasing transport's buffer; the experts' gradients are those of the layer with
    everything training. Without the dispatcher's probability leaf the lease stays taken."""
    from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks

    (live, equal), = run_on_ranks(_frozen_router_rank, 1, True, sizes=ParallelSizes())
    assert live == [0, 0] and equal, (live, equal)
    (live, _), = run_on_ranks(_frozen_router_rank, 1, False, sizes=ParallelSizes())
    assert live == [0, 1], "the mutation is not caught"


def test_a_tokens_routes_are_summed_in_fp32_and_rounded_once():
    """combine and the dispatch backward sum a token's K route rows in fp32 (docs/design.md): in bf16
    step by step, 1 + 2^-8 + 2^-8 stays 1 (each addition a tie rounded to even); in fp32 it is 1 + 2^-7."""
    from megatron_ext.moe.transport.base import sum_routes

    rows = torch.tensor([[[1.0], [2.0 ** -8], [2.0 ** -8]]], dtype=torch.bfloat16)
    summed = sum_routes(rows)
    assert summed.dtype == torch.bfloat16 and summed.item() == 1 + 2.0 ** -7
    stepwise = rows[:, 0] + rows[:, 1] + rows[:, 2]
    assert stepwise.item() == 1.0  # what the contract rules out
