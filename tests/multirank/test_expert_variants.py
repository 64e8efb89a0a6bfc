"""DeviceOffsetGroupedMLP for every expert variant Megatron builds (issue 21), against Megatron's
SequentialMLP on the same weights: activations (gated or not, clamped, offset), fc1/fc2 biases,
probabilities on the input, bf16/fp16/fp32, odd hidden and FFN sizes; capacity tails poisoned;
under Megatron's alltoall dispatcher and the rowwise one at EP 1 and 2; checkpoints both ways;
and the refusals / fallback where a configuration still cannot run.
"""

import logging
import os
import tempfile

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
from megatron_ext.specs import moe_builder
from megatron_ext.testing.expert_variants import (ExpertParams, expert_param_grads, expert_params_of,
                                                  load_expert_params, per_expert, sequential_mlp, variant_config,
                                                  variants)
from megatron_ext.testing.megatron_moe import megatron_moe_layer, rank_tokens
from megatron_ext.testing.reference import MoEWeights, assert_close

RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
SHAPES = [(32, 16), (12, 5)]  # aligned; odd hidden and FFN sizes (padded internally)
POISON = {torch.float32: 1e30, torch.bfloat16: 1e30, torch.float16: 6e4}


def _run_module(module, x, counts, probs, grad_out, valid=None):
    """Forward+backward; returns (out, x grad, prob grad) on the valid rows and the parameter grads."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    if valid is None:
        out, bias = module(x, counts, probs)
        assert bias is None, "experts must add their fc2 bias themselves (MoELayer asserts mlp_bias is None)"
        valid = x.shape[0]
    else:
        out = module.forward_offsets(x, torch.cumsum(counts, 0).to(torch.int32), probs)
    out.backward(grad_out)
    if valid < x.shape[0] and not module.config.moe_apply_probs_on_input:
        assert torch.count_nonzero(probs.grad[valid:]) == 0, "tail rows got a probability gradient"
    return (out[:valid].detach().clone(), x.grad[:valid].clone(), probs.grad[:valid].clone()), \
        expert_param_grads(module)


def _module_rank(rank, world, dtype):
    torch.manual_seed(5)
    rtol, experts, counts = RTOL[dtype], 4, torch.tensor([7, 0, 12, 9])  # an empty expert
    valid, capacity = int(counts.sum()), 40
    checked = []
    for hidden, ffn in SHAPES:
        x = torch.randn(capacity, hidden).to(dtype)
        probs = torch.rand(capacity) + 0.1
        grad_out = torch.randn(capacity, hidden).to(dtype)
        for name in variants():
            config = variant_config(name, hidden=hidden, ffn=ffn, experts=experts, dtype=dtype)
            params = ExpertParams.random(config, seed=11)
            reference, grouped = sequential_mlp(experts, config), DeviceOffsetGroupedMLP(experts, config)
            load_expert_params(reference, params)
            load_expert_params(grouped, params)
            case = f"{name} {dtype} H={hidden} F={ffn}"
            assert {k: tuple(v.shape) for k, v in expert_params_of(grouped).items()} == \
                {k: tuple(v.shape) for k, v in params.named().items()}, f"{case}: padding reached the parameters"
            want, want_grads = _run_module(reference, x[:valid], counts, probs[:valid], grad_out[:valid])
            runs = []
            for tail in (float("nan"), POISON[dtype]):
                poisoned = [t.clone() for t in (x, probs, grad_out)]
                for t in poisoned:
                    t[valid:] = tail
                runs.append(_run_module(grouped, poisoned[0], counts, poisoned[1], poisoned[2], valid=valid))
            (got, got_grads), (again, again_grads) = runs
            for what, a, b, c in zip(("output", "input grad", "prob grad"), got, again, want):
                assert torch.isfinite(a.float()).all(), f"{case}: {what} picked up the NaN tail"
                assert torch.equal(a, b), f"{case}: {what} depends on capacity-tail contents"
                assert a.dtype == c.dtype, f"{case}: {what} is {a.dtype}, SequentialMLP's {c.dtype}"
                assert_close(a, c, rtol, f"{case}: {what} vs SequentialMLP")
            assert sorted(got_grads) == sorted(want_grads), case
            for what in want_grads:
                assert torch.isfinite(got_grads[what].float()).all(), f"{case}: {what} grad picked up the NaN tail"
                assert torch.equal(got_grads[what], again_grads[what]), f"{case}: {what} grad depends on the tail"
                assert got_grads[what].dtype == want_grads[what].dtype, f"{case}: {what} grad dtype"
                assert_close(got_grads[what], want_grads[what], 2 * rtol, f"{case}: {what} grad vs SequentialMLP")
                assert torch.count_nonzero(got_grads[what][1]) == 0, f"{case}: the empty expert got a {what} grad"
            checked.append((name, hidden, grouped.fast_path))
    return checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_variant_matches_sequential_mlp_on_capacity_buffers(dtype):
    checked = run_on_ranks(_module_rank, 1, dtype, sizes=ParallelSizes())[0]
    assert len(checked) == len(variants()) * len(SHAPES)
    # The fast path (the original three kernels) is taken exactly for SwiGLU without biases at aligned sizes
    # (a clamp under bias_activation_fusion is not applied, as Megatron's fused kernel has none).
    assert [c for c in checked if c[2]] == [("swiglu", 32, True), ("swiglu_clamped_fused", 32, True)]


def _layers(config):
    """(Megatron's MoELayer with SequentialMLP, the same with the grouped experts, the rowwise layer)."""
    reference = megatron_moe_layer(config)
    reference.experts = sequential_mlp(reference.num_local_experts, config)  # trainable_reference_config
    swapped = megatron_moe_layer(config, experts_builder=DeviceOffsetGroupedMLP)
    rowwise = moe_builder(MoEExtConfig(transport="torch", dropless=True))(config=config)
    return reference, swapped, rowwise


def _layer_rank(rank, world, dtype, names):
    from megatron.core import parallel_state

    rtol, experts, tokens = 2 * RTOL[dtype], 8, 10
    ep = parallel_state.get_expert_model_parallel_world_size()
    for hidden, ffn in SHAPES:
        x, grad_out = rank_tokens(rank, tokens, hidden, dtype)
        for name in names:
            config = variant_config(name, hidden=hidden, ffn=ffn, experts=experts, ep=ep, dtype=dtype)
            params = ExpertParams.random(config, seed=21)
            router = MoEWeights.random(experts, hidden, ffn, seed=22, dtype=dtype).router
            results, layers = [], _layers(config)
            with torch.no_grad():
                layers[0].router.weight.copy_(router)
            for layer in layers:
                layer.router.load_state_dict(layers[0].router.state_dict())  # with add_bias_linear, its bias too
                load_expert_params(layer.experts, params, layer.local_expert_indices[0])
                x_in = x.clone().view(tokens, 1, hidden).requires_grad_(True)
                out, _ = layer(x_in)
                out.backward(grad_out.view_as(out))
                results.append(dict(output=out.detach().view(tokens, hidden), input_grad=x_in.grad.view(tokens, hidden),
                                    router_grad=layer.router.weight.grad, **expert_param_grads(layer.experts)))
            reference, swapped, rowwise = results
            for label, got in (("alltoall + grouped experts", swapped), ("rowwise", rowwise)):
                assert sorted(got) == sorted(reference)
                for what, want in reference.items():
                    assert_close(got[what], want, rtol, f"rank {rank} EP {ep} {name} {dtype} H={hidden} F={ffn}: "
                                                        f"{label} {what} vs Megatron's SequentialMLP layer")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2])
def test_layers_match_megatrons_for_every_variant(world, dtype):
    run_on_ranks(_layer_rank, world, dtype, list(variants()), sizes=ParallelSizes(ep=world))


CHECKPOINT_VARIANTS = ["swiglu_bias", "gelu", "gelu_bias", "squared_relu", "geglu_bias", "quick_geglu_clamped"]


def _checkpoint_rank(rank, world, ckpt_root, direction):
    from megatron.core import dist_checkpointing

    experts_total, local = 4, 4 // world
    for name in CHECKPOINT_VARIANTS:
        for hidden, ffn in SHAPES:
            config = variant_config(name, hidden=hidden, ffn=ffn, experts=experts_total, ep=world)
            reference, grouped = sequential_mlp(local, config), DeviceOffsetGroupedMLP(local, config)
            params = ExpertParams.random(config, seed=31)
            source, target = (reference, grouped) if direction == "sequential_to_grouped" else (grouped, reference)
            load_expert_params(source, params, rank * local)
            with torch.no_grad():
                for p in target.parameters():
                    p.fill_(0.123)
            ckpt_dir = os.path.join(ckpt_root, f"{name}_{hidden}")
            if rank == 0:
                os.makedirs(ckpt_dir)
            torch.distributed.barrier()
            dist_checkpointing.save(source.sharded_state_dict(prefix="mlp.experts."), ckpt_dir)
            loaded = dist_checkpointing.load(target.sharded_state_dict(prefix="mlp.experts."), ckpt_dir)
            target.load_state_dict({k[len("mlp.experts."):]: v for k, v in loaded.items()})
            for what, tensor in expert_params_of(target).items():
                want = params.named()[what][rank * local:(rank + 1) * local]
                assert torch.equal(tensor, want), f"rank {rank} {name} {direction}: {what} not restored"
            x = torch.randn(10, hidden, generator=torch.Generator().manual_seed(rank))
            counts, probs = torch.tensor([4, 6] if local == 2 else [2, 3, 1, 4]), torch.rand(10)
            assert_close(grouped(x, counts, probs)[0], reference(x, counts, probs)[0], 1e-5,
                         f"rank {rank} {name} {direction} output")


@pytest.mark.parametrize("direction", ["sequential_to_grouped", "grouped_to_sequential"])
@pytest.mark.parametrize("world", [1, 2])
def test_checkpoints_of_every_variant_interchange_with_sequential_mlp(world, direction):
    with tempfile.TemporaryDirectory() as ckpt_root:
        run_on_ranks(_checkpoint_rank, world, ckpt_root, direction, sizes=ParallelSizes(ep=world))


def _adam_after_a_step(module, seed):
    """Adam over `module` after one step on gradients drawn from `seed` (with seed None: zero
    gradients, which leaves the parameters as they are and the states zero, as an optimizer that
    is about to load a checkpoint is set up)."""
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed or 0)
    for param in module.parameters():
        param.grad = torch.zeros_like(param) if seed is None else torch.randn(param.shape, generator=gen)
    optimizer.step()
    return optimizer


def _optimizer_checkpoint_rank(rank, world, ckpt_root, direction):
    """Optimizer state through Megatron's distributed checkpoint, as its non-distributed optimizers
    save it (dist_checkpointing/optimizer.py: each state found by its parameter's model entry):
    the flat biases' states save as SequentialMLP's [L, rows] and load into either module."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                           optim_state_to_sharding_state)

    def sharded(module, optimizer):
        model = module.sharded_state_dict(prefix="mlp.experts.")
        state = optimizer.state_dict()
        optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model, list(module.parameters())),
                                      exclude_keys=("step",))
        return {"model": model, "optimizer": state}

    experts_total, local = 4, 4 // world
    config = variant_config("gelu_bias", hidden=12, ffn=5, experts=experts_total, ep=world)
    reference, grouped = sequential_mlp(local, config), DeviceOffsetGroupedMLP(local, config)
    source, target = (reference, grouped) if direction == "sequential_to_grouped" else (grouped, reference)
    params = ExpertParams.random(config, seed=51)
    load_expert_params(source, params, rank * local)
    load_expert_params(target, params, rank * local)
    # the same gradients per expert in both modules, so the source's states are known per expert
    source_optimizer = _adam_after_a_step(source, seed=7 + rank)
    target_optimizer = _adam_after_a_step(target, seed=None)
    want = per_expert(source, lambda param: source_optimizer.state[param]["exp_avg_sq"])
    assert all(t.abs().sum() > 0 for t in want.values())
    ckpt_dir = os.path.join(ckpt_root, "optimizer")
    if rank == 0:
        os.makedirs(ckpt_dir)
    torch.distributed.barrier()
    dist_checkpointing.save(sharded(source, source_optimizer), ckpt_dir)
    loaded = dist_checkpointing.load(sharded(target, target_optimizer), ckpt_dir)
    for index, state in loaded["optimizer"]["state"].items():  # 'step' is not saved per parameter
        state["step"] = target_optimizer.state_dict()["state"][index]["step"]
    target_optimizer.load_state_dict(loaded["optimizer"])
    for param in target.parameters():  # e.g. a flat bias's state loaded as [L, rows] would break Adam's next step
        for key in ("exp_avg", "exp_avg_sq"):
            assert target_optimizer.state[param][key].shape == param.shape, f"rank {rank} {direction}: {key} shape"
    got = per_expert(target, lambda param: target_optimizer.state[param]["exp_avg_sq"])
    for name in want:
        assert torch.equal(got[name], want[name]), f"rank {rank} {direction}: {name}'s Adam state not restored"


@pytest.mark.parametrize("direction", ["sequential_to_grouped", "grouped_to_sequential"])
@pytest.mark.parametrize("world", [1, 2])
def test_optimizer_state_checkpoints_interchange_with_sequential_mlp(world, direction):
    with tempfile.TemporaryDirectory() as ckpt_root:
        run_on_ranks(_optimizer_checkpoint_rank, world, ckpt_root, direction, sizes=ParallelSizes(ep=world))


def _plain_state_dict_rank(rank, world):
    # The last case: moe_latent_size, where Megatron's experts read and write latent-size rows.
    for name, width, extra in (("gelu_bias", 12, {}), ("quick_geglu_clamped", 12, {}),
                               ("geglu_bias", 24, dict(moe_latent_size=24))):
        config = variant_config(name, hidden=12, ffn=5, experts=2, **extra)
        reference, grouped = sequential_mlp(2, config), DeviceOffsetGroupedMLP(2, config)
        load_expert_params(reference, ExpertParams.random(config, seed=41))
        grouped.load_state_dict(reference.state_dict())
        x, counts, probs = torch.randn(6, width), torch.tensor([2, 4]), torch.rand(6)
        assert_close(grouped(x, counts, probs)[0], reference(x, counts, probs)[0], 1e-5, f"{name} torch-format load")
        # this module's own state dicts from before its biases were stored flat ([L, rows])
        stacked = {k: v.view(2, -1) if k.endswith("_bias") else v for k, v in grouped.state_dict().items()}
        assert all(stacked[k].dim() == 2 for k in ("fc1_bias", "fc2_bias"))
        earlier = DeviceOffsetGroupedMLP(2, config)
        earlier.load_state_dict(stacked)
        assert torch.equal(earlier(x, counts, probs)[0], grouped(x, counts, probs)[0]), f"{name} [L, rows] biases"
    # TEGroupedMLP's torch-format keys (TE's GroupedLinear: weight0, bias0, ...): refused, saying what to do
    te_style = {f"linear_fc{fc}.{kind}{i}": torch.zeros(1)
                for fc in (1, 2) for kind in ("weight", "bias") for i in (0, 1)}
    with pytest.raises(ValueError, match=r"linear_fc1.weight0 \.\.\.: a plain torch state dict of Megatron's "
                                         r"TEGroupedMLP .* save a distributed checkpoint"):
        DeviceOffsetGroupedMLP(2, config).load_state_dict(te_style)


def test_loads_plain_sequential_mlp_state_dicts_with_biases():
    run_on_ranks(_plain_state_dict_rank, 1, sizes=ParallelSizes())


def _fallback_rank(rank, world):
    from megatron.core.transformer.moe.experts import SequentialMLP

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_ext.specs").addHandler(handler)
    interleaved = variant_config("swiglu", experts=4, moe_mlp_glu_interleave_size=8)
    for _ in range(2):  # one logged line, however many layers fall back
        layer = moe_builder(MoEExtConfig(dispatcher="megatron"))(config=interleaved)
        assert isinstance(layer.experts, SequentialMLP), type(layer.experts)
    assert len(records) == 1 and "moe_mlp_glu_interleave_size=8" in records[0].getMessage(), \
        [r.getMessage() for r in records]
    layer = moe_builder(MoEExtConfig(dispatcher="megatron"))(config=variant_config("gelu_bias", experts=4))
    assert isinstance(layer.experts, DeviceOffsetGroupedMLP), "a supported variant must keep the grouped experts"
    with pytest.raises(ValueError, match=r"moe_mlp_glu_interleave_size=8 \(--moe-mlp-glu-interleave-size 8\).*drop it"):
        moe_builder(MoEExtConfig(transport="torch"))(config=interleaved)


def test_megatron_dispatcher_falls_back_to_megatrons_experts_with_one_line():
    run_on_ranks(_fallback_rank, 1, sizes=ParallelSizes())


def _etp_fallback_rank(rank, world):
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = variant_config("gelu", experts=4, etp=2)
    assert isinstance(moe_builder(MoEExtConfig(dispatcher="megatron"))(config=config).experts, SequentialMLP)
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 1"):
        moe_builder(MoEExtConfig(transport="torch"))(config=config)


def test_expert_tensor_parallelism_falls_back_under_megatrons_dispatcher():
    run_on_ranks(_etp_fallback_rank, 2, sizes=ParallelSizes(etp=2))


def _mxfp8_rank(rank, world):
    """MXFP8 dispatch payloads feed every variant's fc1 (odd FFN size: padded weights) like BF16 rows."""
    experts, tokens, hidden = 8, 24, 64
    x, grad_out = rank_tokens(rank, tokens, hidden)
    for name in ("gelu_bias", "geglu_bias", "squared_relu"):  # (a clamp turns quantization noise into kinks)
        config = variant_config(name, hidden=hidden, ffn=21, experts=experts, ep=world)
        params = ExpertParams.random(config, seed=51)
        results = []
        for mxfp8_dispatch in (False, True):
            layer = moe_builder(MoEExtConfig(transport="torch", mxfp8_dispatch=mxfp8_dispatch))(config=config)
            with torch.no_grad():
                layer.router.weight.copy_(MoEWeights.random(experts, hidden, 21, seed=52).router)
                if layer.router.bias is not None:
                    layer.router.bias.zero_()
            load_expert_params(layer.experts, params, layer.local_expert_indices[0])
            x_in = x.clone().view(tokens, 1, hidden).requires_grad_(True)
            out, _ = layer(x_in)
            out.backward(grad_out.view_as(out))
            results.append(dict(output=out.detach(), input_grad=x_in.grad, **expert_param_grads(layer.experts)))
        assert not torch.equal(results[0]["output"], results[1]["output"]), "the quantizer did not run"
        for what, want in results[0].items():  # the format's error bound (tests/multirank/test_mxfp8_dispatch.py)
            assert_close(results[1][what], want, 0.08, f"rank {rank} {name} MXFP8 vs BF16 {what}")


def test_mxfp8_dispatch_feeds_every_variant():
    run_on_ranks(_mxfp8_rank, 2, sizes=ParallelSizes(ep=2))


RECOMPUTE_ACT = dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True)


def _main_grad_rank(rank, world):
    """Each variant's weight gradients added to main_grad in the GEMM (moe/expert_wgrad.py, CPU
    reference sum) against the same module's plain gradients that DDP would add: bf16, aligned
    sizes, activation kept and recomputed, an MXFP8 payload for fc1; biases keep DDP's add."""
    from megatron_ext.formats import mxfp8
    from megatron_ext.moe.mxfp8_dispatch import MXFP8Payload
    from megatron_ext.testing.ddp_main_grads import attach_main_grads

    torch.manual_seed(6)
    experts, counts, hidden, ffn = 4, torch.tensor([7, 0, 12, 9]), 32, 16
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(counts.sum()), hidden).bfloat16()
    probs, grad_out = torch.rand(x.shape[0]) + 0.1, torch.randn(x.shape).bfloat16()
    packed = mxfp8.pack_rows(mxfp8.quantize_rows(x))
    checked = []
    for name in variants():
        for extra, payload in (({}, None), (RECOMPUTE_ACT, None), ({}, MXFP8Payload(packed, hidden, x.dtype))):
            config = variant_config(name, hidden=hidden, ffn=ffn, experts=experts, dtype=torch.bfloat16, **extra)
            if payload is not None and config.moe_apply_probs_on_input:
                continue  # MXFP8 dispatch carries the token rows; probabilities on the input change them first
            params = ExpertParams.random(config, seed=11)
            grads = {}
            for fuse in (False, True):
                module = DeviceOffsetGroupedMLP(experts, config, wgrad_fusion=fuse)
                load_expert_params(module, params)
                weights = [module.fc1_weight, module.fc2_weight]
                attach_main_grads(module.parameters())
                rows = x.clone().requires_grad_(True)
                module.forward_offsets(rows, offsets, probs.clone(), payload).backward(grad_out)
                assert [w.grad_added_to_main_grad for w in weights] == [fuse, fuse], (name, extra, fuse)
                biases = [b for b in (module.fc1_bias, module.fc2_bias) if b is not None]
                assert not any(b.grad_added_to_main_grad for b in biases), "biases keep DDP's add"
                grads[fuse] = [p.main_grad.clone() for p in module.parameters()] + [rows.grad.clone()]
            case = f"{name} {'recompute ' if extra else ''}{'mxfp8' if payload is not None else ''}"
            for plain, fused in zip(grads[False], grads[True]):
                relative = ((fused - plain).float().norm() / plain.float().norm().clamp_min(1e-12)).item()
                assert relative < 1e-2, f"{case}: fused main_grad off by {relative:.2e} from DDP's add"
            checked.append(case)
    return checked


def test_every_variant_adds_its_weight_gradients_to_main_grad():
    checked = run_on_ranks(_main_grad_rank, 1, sizes=ParallelSizes())[0]
    on_input = sum(bool(v.get("moe_apply_probs_on_input")) for v in variants().values())  # no MXFP8 case
    assert len(checked) == 3 * len(variants()) - on_input, checked


def _optimizer_rules_rank(rank, world):
    """Megatron's optimizer rules (0.19.2: optimizer/__init__.py's standard and MuP overrides,
    emerging_optimizers' routing of non-matrix parameters to Adam) give each grouped parameter
    what they give the SequentialMLP parameters it stands for."""
    from megatron.core.optimizer import OptimizerConfig, get_mup_config_overrides, get_standard_config_overrides
    from megatron.core.optimizer.emerging_optimizers import _is_nonlinear_or_embedding

    config = variant_config("gelu_bias", hidden=12, ffn=5, experts=2)
    optimizer = OptimizerConfig(lr=1e-3, min_lr=1e-5, weight_decay=0.1)
    rules = {**get_standard_config_overrides(optimizer), **get_mup_config_overrides(optimizer, 4.0)}

    def treatment(module):
        """name (ExpertParams' names) -> (the overrides that match it, routed to Adam under Muon)"""
        found = {}
        for param_name, param in module.named_parameters():
            name = next(n for n, (linear, kind) in _GROUPED_NAMES.items()
                        if param_name.endswith(f"{linear}.{kind}") or param_name == n)
            matched = [dict(override) for key, override in rules.items() if key.matches(param, param_name)]
            found.setdefault(name, set()).add((repr(matched), _is_nonlinear_or_embedding(param)))
        return found

    grouped = treatment(DeviceOffsetGroupedMLP(2, config))
    sequential = treatment(sequential_mlp(2, config))
    assert sorted(grouped) == sorted(sequential) == ["fc1_bias", "fc1_weight", "fc2_bias", "fc2_weight"]
    for name in ("fc1_bias", "fc2_bias"):  # no weight decay, MuP's vector treatment, Adam under Muon
        assert grouped[name] == sequential[name], (name, grouped[name], sequential[name])
        (matched, to_adam), = grouped[name]
        assert "'wd_mult': 0.0" in matched and to_adam, grouped[name]
    for name in ("fc1_weight", "fc2_weight"):
        (matched, to_adam), = grouped[name]
        (want_matched, want_to_adam), = sequential[name]
        assert matched == want_matched and "wd_mult" not in matched, (name, matched, want_matched)
        # Muon and SOAP would train the stacked [L, out, in] weights with Adam: the launcher refuses them
        assert to_adam and not want_to_adam, name
    return True


_GROUPED_NAMES = {"fc1_weight": ("linear_fc1", "weight"), "fc1_bias": ("linear_fc1", "bias"),
                  "fc2_weight": ("linear_fc2", "weight"), "fc2_bias": ("linear_fc2", "bias")}


def test_megatrons_optimizer_rules_treat_grouped_parameters_as_sequential_mlps():
    assert run_on_ranks(_optimizer_rules_rank, 1, sizes=ParallelSizes())[0]


def _te_grouped_clamp_order_rank(rank, world):
    """The clamped quick-GEGLU with biases under bias_activation_fusion, where Megatron would build
    TEGroupedMLP (Transformer Engine stood in: only its presence is asked): fc1's bias goes in the
    grouped GEMM and the fused kernel gets none, so clamp(x + b), the unfused formula."""
    from megatron.core.extensions import transformer_engine_spec_provider as te_provider

    from megatron_ext.moe.expert_activation import ExpertActivation, megatron_builds_te_grouped_experts

    counts = torch.tensor([5, 0, 9, 6])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 32, generator=torch.Generator().manual_seed(3))
    probs = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(4)) + 0.1
    grouped = dict(moe_grouped_gemm=True, transformer_impl="transformer_engine")
    outs = {}
    for name, extra, te_installed in (("quick_geglu_clamped", {}, False),
                                      ("quick_geglu_clamped_fused", grouped, True),
                                      ("quick_geglu_clamped_fused", grouped, False),  # Megatron: SequentialMLP
                                      ("quick_geglu_clamped_fused", {}, True)):
        te_provider.TEColumnParallelGroupedLinear = object if te_installed else None
        config = variant_config(name, hidden=32, ffn=16, experts=4, **extra)
        module = DeviceOffsetGroupedMLP(4, config)
        load_expert_params(module, ExpertParams.random(config, seed=61))
        outs[(name, bool(extra), te_installed)] = (megatron_builds_te_grouped_experts(config),
                                                   ExpertActivation.from_config(config).clamps_before_bias,
                                                   module.forward_offsets(x, offsets, probs).detach())
    return outs


def test_clamp_order_follows_the_experts_class_megatron_would_build():
    """SequentialMLP's fused kernel clamps before fc1's bias, TEGroupedMLP's after (megatron-core
    0.19.2 builds its fc1 with skip_bias_add=False); the grouped experts follow the class Megatron's
    spec would build (a review found TEGroupedMLP's order missing)."""
    import inspect

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    assert "skip_bias_add=False" in inspect.getsource(TEGroupedMLP.__init__).split("linear_fc2")[0]
    outs = run_on_ranks(_te_grouped_clamp_order_rank, 1, sizes=ParallelSizes())[0]
    unfused = outs[("quick_geglu_clamped", False, False)]
    te_grouped = outs[("quick_geglu_clamped_fused", True, True)]
    sequential = [outs[("quick_geglu_clamped_fused", True, False)], outs[("quick_geglu_clamped_fused", False, True)]]
    assert te_grouped[:2] == (True, False) and torch.equal(te_grouped[2], unfused[2])
    for builds_te, clamps_first, out in sequential:
        assert (builds_te, clamps_first) == (False, True)
        assert not torch.allclose(out, unfused[2], rtol=1e-3, atol=1e-3), "the clamp must bite in this case"


def _said_by(logger_name: str) -> list[str]:
    """The messages `logger_name` logs from now on, with warn_once's memory cleared."""
    from megatron_ext import quiet

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(logger_name).addHandler(handler)
    quiet._WARNED.clear()
    return said


def _te_activation_rank(rank, world):
    said = _said_by("megatron_ext.moe.experts")
    for use_te in (False, True):
        DeviceOffsetGroupedMLP(4, variant_config("swiglu", hidden=32, ffn=16, experts=4, use_te_activation_func=use_te))
    return said


def test_te_activation_modules_are_said_to_be_ignored():
    said = run_on_ranks(_te_activation_rank, 1, sizes=ParallelSizes())[0]
    assert len(said) == 1 and "use_te_activation_func is ignored by the grouped experts" in said[0], said


def _swiglu_clamp_fusion_rank(rank, world):
    said = _said_by("megatron_ext.moe.expert_activation")
    counts = torch.tensor([6, 3, 0, 7])
    x = torch.randn(int(counts.sum()), 32, generator=torch.Generator().manual_seed(8))
    outs = {}
    for fusion in (False, True):
        config = variant_config("swiglu_clamped_fused", hidden=32, ffn=16, experts=4, bias_activation_fusion=fusion)
        module = DeviceOffsetGroupedMLP(4, config)
        load_expert_params(module, ExpertParams.random(config, seed=63))
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        outs[fusion] = module.forward_offsets(x, offsets, torch.ones(x.shape[0])).detach()
    return said, outs


def test_swiglu_clamp_under_fusion_is_said_not_to_apply():
    """Megatron's fused SwiGLU kernels have no clamp (megatron-core 0.19.2); the experts follow and say so
    once, naming the flag that applies it. Without fusion the clamp applies (and bites in this case)."""
    said, outs = run_on_ranks(_swiglu_clamp_fusion_rank, 1, sizes=ParallelSizes())[0]
    assert len(said) == 1 and "activation_func_clamp_value=0.5 is not applied" in said[0], said
    assert "--no-bias-swiglu-fusion" in said[0], said
    assert not torch.allclose(outs[True], outs[False], rtol=1e-3, atol=1e-3), "the clamp must bite in this case"


def _refused_fusion_rank(rank, world):
    counts = torch.tensor([4, 5, 0, 3])
    x = torch.randn(int(counts.sum()), 32, generator=torch.Generator().manual_seed(9))
    probs = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(10)) + 0.1
    results = {}
    for name in ("gelu_bias", "geglu_bias", "swiglu_bias"):
        outs, refused = {}, None
        for fusion in (False, True):
            config = variant_config(name, hidden=32, ffn=16, experts=4, bias_activation_fusion=fusion)
            params = ExpertParams.random(config, seed=64)
            grouped, reference = DeviceOffsetGroupedMLP(4, config), sequential_mlp(4, config)
            load_expert_params(grouped, params)
            load_expert_params(reference, params)
            outs[fusion] = grouped(x, counts, probs)[0].detach()
            try:
                outs[("megatron", fusion)] = reference(x, counts, probs)[0].detach()
            except (ValueError, NotImplementedError) as error:
                refused = f"{type(error).__name__}: {error}"
        results[name] = (outs, refused)
    return results


def test_fusions_megatrons_experts_refuse_run_the_unfused_formula():
    """GELU / GEGLU (megatron.training fuses them by default when the linears have biases) and SwiGLU
    with biases under bias_activation_fusion: megatron-core 0.19.2's experts refuse them at the first
    forward; the grouped experts compute the config's unfused formula, which equals SequentialMLP unfused."""
    for name, (outs, refused) in run_on_ranks(_refused_fusion_rank, 1, sizes=ParallelSizes())[0].items():
        assert refused is not None and ("fusion" in refused or "Bias is not supported" in refused), (name, refused)
        assert torch.equal(outs[True], outs[False]), f"{name}: fusion changed the grouped experts' output"
        assert_close(outs[True], outs[("megatron", False)], 1e-5, f"{name} vs SequentialMLP unfused")
