"""The dense oracle's own inputs and arithmetic, by hand: MoEWeights.random must give every
expert its own, non-zero weights (with all-zero fc1 every output and gradient is zero, and with
identical experts a token sent to the wrong expert changes nothing, so the layer tests would pass
whatever the layer did), and dense_moe must equal the formula written out in plain Python."""

import math

import torch

from megatron_ext.testing.reference import MoEWeights, dense_moe, route_topk


def test_random_weights_give_each_expert_its_own_nonzero_weights():
    experts, hidden, ffn = 4, 32, 16
    for dtype in (torch.float32, torch.bfloat16):
        w = MoEWeights.random(experts, hidden, ffn, seed=7, dtype=dtype)
        assert (w.router.shape, w.fc1.shape, w.fc2.shape) == ((experts, hidden), (experts, 2 * ffn, hidden),
                                                              (experts, hidden, ffn))
        for name, t in (("router", w.router), ("fc1", w.fc1), ("fc2", w.fc2)):
            assert t.dtype == dtype, name
            assert torch.count_nonzero(t) == t.numel(), f"{name} has zeros"
            for i in range(experts):
                for j in range(i):
                    assert not torch.equal(t[i], t[j]), f"{name}: experts {i} and {j} are equal"
        gate, up = w.fc1.float().chunk(2, dim=1)
        assert not torch.equal(gate, up), "fc1's gate and up rows are equal"
        for name, t, fan_in in (("router", w.router, hidden), ("fc1", w.fc1, hidden), ("fc2", w.fc2, ffn)):
            std = t.float().std().item()
            assert 0.7 < std * math.sqrt(fan_in) < 1.3, f"{name}: std {std:.3f} is not 1/sqrt({fan_in})"


def _silu(v):
    return v / (1 + math.exp(-v))


def test_dense_moe_equals_the_formula_in_plain_python():
    # Two tokens, three experts, top-2, H=2, F=1: fc1 rows are [gate, up], fc2 is [H, F].
    router = [[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]
    fc1 = [[[0.5, -1.0], [1.0, 2.0]], [[-0.3, 0.7], [0.2, -0.4]], [[1.5, 0.5], [-1.0, 1.0]]]
    fc2 = [[[2.0], [-1.0]], [[0.5], [1.5]], [[-2.0], [3.0]]]
    xs = [[0.8, -0.5], [-0.6, 0.9]]
    want, tops = [], []
    for x in xs:
        logits = [sum(r[h] * x[h] for h in range(2)) for r in router]
        top = sorted(range(3), key=lambda e: -logits[e])[:2]
        tops.append(top)
        z = [math.exp(logits[e]) for e in top]
        probs = [v / sum(z) for v in z]
        y = [0.0, 0.0]
        for p, e in zip(probs, top):
            gate = sum(fc1[e][0][h] * x[h] for h in range(2))
            up = sum(fc1[e][1][h] * x[h] for h in range(2))
            act = _silu(gate) * up
            for h in range(2):
                y[h] += p * fc2[e][h][0] * act
        want.append(y)
    weights = MoEWeights(torch.tensor(router), torch.tensor(fc1), torch.tensor(fc2))
    x = torch.tensor(xs)
    got = dense_moe(x, weights, 2)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)
    top_idx, probs = route_topk(x, weights.router, 2)
    assert top_idx.tolist() == tops == [[0, 2], [1, 2]]
    # keep drops a route: token 0 keeps only its second choice, token 1 only its first
    keep = torch.tensor([[False, True], [True, False]])
    kept = dense_moe(x, weights, 2, top_idx=top_idx, probs=probs, keep=keep)
    for t, k in ((0, 1), (1, 0)):
        e, p = int(top_idx[t, k]), float(probs[t, k])
        gate, up = (sum(fc1[e][r][h] * xs[t][h] for h in range(2)) for r in (0, 1))
        expected = [p * fc2[e][h][0] * _silu(gate) * up for h in range(2)]
        torch.testing.assert_close(kept[t], torch.tensor(expected), rtol=1e-6, atol=1e-6)
