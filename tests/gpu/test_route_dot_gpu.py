"""The route-dot kernel equals the fp32 einsum it replaces."""

import pytest
import torch

from megatron_ext.kernels.route_dot import route_dot
from megatron_ext.testing.reference import assert_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("topk,hidden", [(8, 2048), (4, 1000), (2, 64)])
def test_route_dot_matches_einsum(topk, hidden):
    gen = torch.Generator(device="cuda").manual_seed(0)
    gathered = torch.randn(3000, topk, hidden, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(3000, hidden, device="cuda", generator=gen).bfloat16()
    expected = torch.einsum("tkh,th->tk", gathered.float(), grad.float())
    assert_close(route_dot(gathered, grad), expected, 1e-5, "route dot")
