"""tools/bench_moe_layer.py's plumbing on CPU: --grads reaches every step the tool times (and the
result), and TFLOP/s credits only the routes the layer kept."""

import importlib.util
import os

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture()
def tool():
    spec = importlib.util.spec_from_file_location("bench_moe_layer_tool",
                                                  os.path.join(REPO_ROOT, "tools", "bench_moe_layer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TinyLayer(torch.nn.Module):
    """Stands in for a MoE layer: (out, bias) from forward, routing metrics with drops."""

    def __init__(self, hidden: int, dropped: float):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden, bias=False)
        self.dropped = dropped

    def forward(self, x):
        return self.linear(x), None

    def read_metrics(self):
        return {"dropped_routes": self.dropped * 2, "steps": 2, "mean_buffer_fill": 1.0, "capacity": 16,
                "dispatch_buffer_bytes": 1, "dispatched_bytes_per_step": 1}


def test_grads_option_defaults_to_param_and_refuses_others(tool):
    assert tool.parse_args([]).grads == "param"
    assert tool.parse_args(["--grads", "ddp"]).grads == "ddp"
    with pytest.raises(SystemExit):
        tool.parse_args(["--grads", "fsdp"])


@pytest.mark.parametrize("grads", ["param", "ddp"])
def test_measure_uses_the_grads_path_and_credits_kept_routes(tool, monkeypatch, grads):
    import megatron_ext.host_sync as host_sync

    args = tool.parse_args(["--tokens", "16", "--topk", "2", "--hidden", "32", "--ffn", "16", "--experts", "4",
                            "--iters", "2", "--warmup", "1", "--grads", grads])
    layers = []

    def build(path, args, weights):
        layers.append(TinyLayer(args.hidden, dropped=8.0))  # 8 of the 32 routes dropped per step
        return layers[-1]

    monkeypatch.setattr(tool, "build", build)
    monkeypatch.setattr(tool, "peak_memory", lambda step: {"peak_bytes": 0, "peak_above_baseline_bytes": 0})
    monkeypatch.setattr(tool, "held_for_backward", lambda layer, x, grad_out: 0)
    monkeypatch.setattr(tool.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(host_sync, "profiled_sync_calls", lambda step: {})
    x, grad_out = torch.randn(16, 1, 32), torch.randn(16, 1, 32)
    flops = tool.moe_model_flops(16, 2, 32, 16)
    result = tool.measure("rowwise_symm", args, None, x, grad_out, flops)
    weight = layers[0].linear.weight
    assert result["grads"] == grads
    assert hasattr(weight, "main_grad") == (grads == "ddp")
    if grads == "ddp":
        assert weight.grad is None and weight.main_grad.abs().sum() > 0
    assert result["dropped_routes_per_step"] == 8.0
    assert result["credited_flops"] == pytest.approx(flops * 24 / 32)
    assert result["tflops"] == pytest.approx(flops * 24 / 32 / result["fwd_bwd_ms"] / 1e9)
