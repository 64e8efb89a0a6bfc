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
