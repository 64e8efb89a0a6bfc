"""Expert variants for parity tests: Megatron's activations, gated or not, with biases, clamps and
probabilities on the input; random parameters (biases included) loaded into Megatron's
SequentialMLP or the grouped experts alike, and their gradients read back in one layout.

Used by the CPU tests (tests/multirank/test_expert_variants.py) and the GPU ones
(tests/gpu/test_expert_variants_gpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_ext.moe.expert_checkpoint import stacked
from megatron_ext.testing.megatron_moe import moe_config


def _activations():
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return squared_relu, quick_gelu


def variants() -> dict[str, dict]:
    """name -> TransformerConfig overrides (on top of moe_config's SwiGLU without biases)."""
    squared_relu, quick_gelu = _activations()
    plain = dict(gated_linear_unit=False)
    return {
        "swiglu": {},
        "swiglu_bias": dict(add_bias_linear=True),
        "gelu": dict(plain, activation_func=F.gelu),  # Megatron's default activation
        "gelu_bias": dict(plain, activation_func=F.gelu, add_bias_linear=True),
        "squared_relu": dict(plain, activation_func=squared_relu),
        "relu_bias": dict(plain, activation_func=F.relu, add_bias_linear=True),
        "silu": dict(plain, activation_func=F.silu),
        "geglu": dict(activation_func=F.gelu),
        "geglu_bias": dict(activation_func=F.gelu, add_bias_linear=True),
        # gpt-oss style: clamped quick-GEGLU with a linear offset and biases (clamp small enough to bite)
        "quick_geglu_clamped": dict(activation_func=quick_gelu, activation_func_clamp_value=0.5,
                                    glu_linear_offset=1.0, add_bias_linear=True),
        # the same under Megatron's fused weighted kernel (--quick-geglu's default): clamp(x) + b, not clamp(x + b)
        "quick_geglu_clamped_fused": dict(activation_func=quick_gelu, activation_func_clamp_value=0.5,
                                          glu_linear_offset=1.0, add_bias_linear=True, bias_activation_fusion=True),
        # gpt-oss style SwiGLU: clamped, with a linear offset and biases (Megatron's unfused formula)
        "swiglu_clamped": dict(activation_func_clamp_value=0.5, glu_linear_offset=1.0, add_bias_linear=True),
        # under --bias-swiglu-fusion (Megatron's default) the fused kernel has no clamp (nor, weighted, a bias):
        # Megatron ignores the clamp
        "swiglu_clamped_fused": dict(activation_func_clamp_value=0.5, bias_activation_fusion=True),
        "probs_on_input": dict(plain, activation_func=F.gelu, add_bias_linear=True, moe_apply_probs_on_input=True),
        # SequentialMLP runs the fused kernel with probabilities of one: still clamp(x) + b
        "probs_on_input_quick_geglu_clamped_fused": dict(
            activation_func=quick_gelu, activation_func_clamp_value=0.5, glu_linear_offset=1.0, add_bias_linear=True,
            bias_activation_fusion=True, moe_apply_probs_on_input=True),
    }


def variant_config(name: str, **kwargs):
    """moe_config for variant `name` (top-1 where the variant applies probabilities on the input)."""
    overrides = dict(variants()[name])
    if overrides.get("moe_apply_probs_on_input"):  # Megatron: top-1, which needs the pre-softmax router
        kwargs.update(topk=1, moe_router_pre_softmax=True)
    overrides.update(kwargs)
    return moe_config(**overrides)


@dataclass
class ExpertParams:
    """All experts' parameters in Megatron's per-expert layout, stacked."""

    fc1: torch.Tensor  # [E, gF, H]
    fc2: torch.Tensor  # [E, H, F]
    fc1_bias: torch.Tensor | None  # [E, gF]
    fc2_bias: torch.Tensor | None  # [E, H]

    @staticmethod
    def random(config, seed: int = 0, device="cpu") -> "ExpertParams":
        hidden = config.moe_latent_size or config.hidden_size  # the experts' row width
        ffn, experts = config.moe_ffn_hidden_size, config.num_moe_experts
        fc1_rows = (2 if config.gated_linear_unit else 1) * ffn
        gen = torch.Generator(device=device).manual_seed(seed)

        def rand(*shape, scale):
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(config.params_dtype)

        bias = config.add_bias_linear
        return ExpertParams(fc1=rand(experts, fc1_rows, hidden, scale=hidden ** -0.5),
                            fc2=rand(experts, hidden, ffn, scale=ffn ** -0.5),
                            fc1_bias=rand(experts, fc1_rows, scale=0.5) if bias else None,
                            fc2_bias=rand(experts, hidden, scale=0.5) if bias else None)

    def named(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in (("fc1", self.fc1), ("fc2", self.fc2), ("fc1_bias", self.fc1_bias),
                                  ("fc2_bias", self.fc2_bias)) if v is not None}


_SEQUENTIAL = {"fc1": ("linear_fc1", "weight"), "fc2": ("linear_fc2", "weight"),
               "fc1_bias": ("linear_fc1", "bias"), "fc2_bias": ("linear_fc2", "bias")}
_GROUPED = {"fc1": "fc1_weight", "fc2": "fc2_weight", "fc1_bias": "fc1_bias", "fc2_bias": "fc2_bias"}


def _local_tensors(experts_module) -> dict[str, list[torch.Tensor] | torch.Tensor]:
    """SequentialMLP: each name's per-expert parameters; the grouped experts: the parameters
    themselves (the biases flat, `stacked` shapes them)."""
    if hasattr(experts_module, "local_experts"):  # Megatron SequentialMLP
        found = {}
        for name, (linear, kind) in _SEQUENTIAL.items():
            tensors = [getattr(getattr(e, linear), kind) for e in experts_module.local_experts]
            if tensors[0] is not None:
                found[name] = tensors
        return found
    return {name: getattr(experts_module, attr) for name, attr in _GROUPED.items()
            if getattr(experts_module, attr) is not None}


@torch.no_grad()
def load_expert_params(experts_module, params: ExpertParams, first_expert: int = 0) -> None:
    """Copy experts [first_expert, first_expert + L) of `params` into SequentialMLP or the grouped experts."""
    source = params.named()
    local = _local_tensors(experts_module)
    assert sorted(local) == sorted(source), f"parameters {sorted(local)} != {sorted(source)}"
    for name, target in local.items():
        if isinstance(target, list):
            for i, tensor in enumerate(target):
                tensor.copy_(source[name][first_expert + i])
        else:
            rows = stacked(target, experts_module.num_local_experts)
            rows.copy_(source[name][first_expert:first_expert + rows.shape[0]])


def per_expert(experts_module, tensor_of) -> dict[str, torch.Tensor]:
    """`tensor_of(parameter)` (the parameter, its gradient, an optimizer state of it) for each
    parameter of SequentialMLP or the grouped experts, stacked in ExpertParams' layout."""
    found = {}
    for name, target in _local_tensors(experts_module).items():
        if isinstance(target, list):
            found[name] = torch.stack([tensor_of(t) for t in target])
        else:
            found[name] = stacked(tensor_of(target), experts_module.num_local_experts)
    return {k: v.detach().clone() for k, v in found.items()}


def expert_params_of(experts_module) -> dict[str, torch.Tensor]:
    """The local experts' parameters, stacked in ExpertParams' layout."""
    return per_expert(experts_module, lambda param: param)


def expert_param_grads(experts_module) -> dict[str, torch.Tensor]:
    """Gradients of the local experts' parameters, stacked in ExpertParams' layout (zeros where none)."""
    return per_expert(experts_module, lambda param: param.grad if param.grad is not None else torch.zeros_like(param))


def trainable_reference_config(config):
    """`config` for Megatron's reference experts, able to backpropagate through fc2's bias.

    megatron-core 0.19.2: at expert_model_parallel_size=1 (and TP 1) an expert's RowParallelLinear
    returns its output through the no-op TP reduce, and MLP.forward then adds the
    probability-weighted bias in place (`output += output_bias * per_token_scale`), which
    autograd forbids ("Output 0 of _ReduceFromModelParallelRegion is a view and is being
    modified inplace"). With expert_model_parallel_size=2 in the config the linear skips that
    no-op reduce; nothing else about the experts changes (their groups come from pg_collection).
    """
    if not config.add_bias_linear or config.expert_model_parallel_size > 1:
        return config
    import copy

    config = copy.deepcopy(config)
    config.expert_model_parallel_size = 2
    return config


def sequential_mlp(num_local_experts: int, config):
    """Megatron's SequentialMLP from the local GPT spec (trainable_reference_config)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import get_submodules

    layer_mlp = get_submodules(get_gpt_layer_local_submodules(num_experts=config.num_moe_experts).mlp)
    return SequentialMLP(num_local_experts, trainable_reference_config(config), get_submodules(layer_mlp.experts),
                         pg_collection=get_default_pg_collection())
