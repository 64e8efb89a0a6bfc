"""Spec builders: Megatron's GPT specs with megatron_ext's MoE parts, and a swap for any spec tree.

Composition only: the MLP slot of each MoE layer becomes
`partial(RowwiseMoELayer, submodules=MoESubmodules(experts=DeviceOffsetGroupedMLP,
router=FusedTopKRouter, ...), ext_config=...)`, or Megatron's MoELayer with only the experts
swapped for dispatcher="megatron" (there a config the grouped experts cannot serve gets the
original spec's experts, with one logged line). Shared-expert builders, and router builders
other than Megatron's TopKRouter (or all of them with `fused_router=False`), are kept from the
original spec. Usable from the command line as
`--spec megatron_ext.specs gpt_block_spec`. Written against megatron-core 0.19.2, where the
MLP slot is a builder callable (functools.partial of MoELayer).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules  # noqa: F401
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.config import MoEExtConfig
from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
from megatron_ext.moe.fused_router import FusedTopKRouter
from megatron_ext.moe.layer import RowwiseMoELayer
from megatron_ext.quiet import warn_once

_default_ext_config: MoEExtConfig | None = None
logger = logging.getLogger(__name__)


def set_default_ext_config(ext_config: MoEExtConfig) -> None:
    """Config used by spec builders called without one (the launcher sets it from the flags)."""
    global _default_ext_config
    _default_ext_config = ext_config


def default_ext_config() -> MoEExtConfig:
    return _default_ext_config or MoEExtConfig()


def _is_moe_builder(builder) -> bool:
    module = builder.func if isinstance(builder, functools.partial) else getattr(builder, "module", builder)
    return isinstance(module, type) and issubclass(module, MoELayer)


def _moe_submodules_of(builder) -> MoESubmodules:
    if isinstance(builder, functools.partial):
        return builder.keywords.get("submodules")
    return builder.submodules


def moe_builder(ext_config: MoEExtConfig | None = None, base: MoESubmodules | None = None):
    """The MLP-slot builder for one MoE layer, keeping `base`'s shared experts (and its router,
    unless that is Megatron's TopKRouter and `fused_router` is on)."""
    ext_config = ext_config or default_ext_config()
    if ext_config.ddp_buckets:  # a model-wrapping setting: no layer can honour it, so never drop it silently
        raise ValueError("ddp_buckets=True is not applied by the MoE layers (under megatron.training, "
                         "--moe-ext-ddp-buckets applies it to the model's DDP): wrap your DistributedDataParallel with "
                         "megatron_ext.ddp.megatron_hook.install_folding_ddp(ddp, groups) (or build "
                         "FoldingDistributedDataParallel) and leave ddp_buckets False")
    if base is None:  # Megatron's local MoE parts (router, shared-expert MLP)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
        from megatron.core.transformer.spec_utils import get_submodules

        base = get_submodules(get_gpt_layer_local_submodules(num_experts=2).mlp)
    experts = DeviceOffsetGroupedMLP
    options = {}
    if ext_config.debug_checks:  # the experts validate their offsets (a host read per forward)
        options["debug_checks"] = True
    if not ext_config.expert_wgrad_fusion:  # their weight gradients reach main_grad through DDP's add
        options["wgrad_fusion"] = False
    if options:
        experts = functools.partial(DeviceOffsetGroupedMLP, **options)
    if ext_config.dispatcher == "megatron":
        experts = functools.partial(grouped_or_megatron_experts, megatron_experts=base.experts, **options)
        return functools.partial(MoELayer, submodules=dataclasses.replace(base, experts=experts))
    submodules = dataclasses.replace(base, experts=experts)
    # The fused router hands the fused route map its selection, so it needs that on too; a user's
    # own router class is kept.
    if ext_config.fused_router and ext_config.fused_route_map and base.router is TopKRouter:
        submodules = dataclasses.replace(submodules, router=FusedTopKRouter)
    return functools.partial(RowwiseMoELayer, submodules=submodules, ext_config=ext_config)


def grouped_or_megatron_experts(num_local_experts, config, pg_collection=None, name=None, *,
                                megatron_experts=None, debug_checks: bool = False, wgrad_fusion: bool = True):
    """The experts builder of dispatcher="megatron": DeviceOffsetGroupedMLP, or Megatron's own
    experts from the original spec (SequentialMLP in the local spec) for a config the grouped
    experts cannot serve (DeviceOffsetGroupedMLP.unsupported), with one logged line per reason."""
    reasons = DeviceOffsetGroupedMLP.unsupported(config)
    if not reasons or megatron_experts is None:  # nothing to fall back to: the grouped experts refuse
        return DeviceOffsetGroupedMLP(num_local_experts, config, pg_collection=pg_collection, name=name,
                                      debug_checks=debug_checks, wgrad_fusion=wgrad_fusion)
    line = "; ".join(reasons)
    warn_once(logger, f"megatron_ext: MoE layers use Megatron's own experts, not the grouped experts: {line}")
    if isinstance(megatron_experts, ModuleSpec):
        from megatron.core.transformer.spec_utils import build_module

        return build_module(megatron_experts, num_local_experts, config, pg_collection=pg_collection, name=name)
    return megatron_experts(num_local_experts, config, pg_collection=pg_collection, name=name)


def swap_moe_parts(spec, ext_config: MoEExtConfig | None = None, require_moe: bool = True):
    """Return a copy of any layer/block spec tree with every MoE MLP slot replaced.

    Walks ModuleSpecs, dataclass submodules (TransformerLayerSubmodules,
    TransformerBlockSubmodules) and lists of layer specs. With `require_moe`, raises if no MoE
    slot was found, so a spec that silently stays dense does not go unnoticed; a pipeline stage
    of a MoE model may hold dense layers only (dense first layers), so block specs pass False.
    """
    found = []

    def visit(node):
        if isinstance(node, list):
            return [visit(item) for item in node]
        if isinstance(node, ModuleSpec):
            return dataclasses.replace(node, submodules=visit(node.submodules))
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            changes = {}
            for field in dataclasses.fields(node):
                value = getattr(node, field.name)
                if field.name == "mlp" and _is_moe_builder(value):
                    found.append(field.name)
                    changes["mlp"] = moe_builder(ext_config, _moe_submodules_of(value))
                elif isinstance(value, (list, ModuleSpec)) or (dataclasses.is_dataclass(value)
                                                               and not isinstance(value, type)):
                    changes[field.name] = visit(value)
            return dataclasses.replace(node, **changes) if changes else node
        return node

    swapped = visit(spec)
    if not found and require_moe:
        raise ValueError("swap_moe_parts found no MoE layer in the spec; build it with num_experts set "
                         "(e.g. get_gpt_layer_local_spec(num_experts=...))")
    return swapped


def transformer_engine_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def require_transformer_engine(what: str, instead: str) -> None:
    """Megatron's TE specs fail deep inside (`'NoneType' object is not callable`) without Transformer
    Engine; say so up front. TransformerConfig.transformer_impl defaults to 'transformer_engine'."""
    if not transformer_engine_available():
        raise ImportError(f"{what} builds Transformer Engine layers, but transformer_engine is not installed; "
                          f"use {instead}, or install megatron-ext[te]")


def gpt_layer_spec(num_experts: int, ext_config: MoEExtConfig | None = None, use_te: bool = False, **kwargs):
    """Megatron's GPT layer spec (local or TE flavour) with megatron_ext's MoE parts."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        require_transformer_engine("gpt_layer_spec(..., use_te=True)", "use_te=False")
        base = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, **kwargs)
    else:
        base = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, **kwargs)
    return swap_moe_parts(base, ext_config)


def gpt_block_spec(config, use_transformer_engine: bool | None = None, ext_config: MoEExtConfig | None = None,
                   vp_stage: int | None = None, pp_rank: int | None = None, **kwargs):
    """Megatron's GPT decoder-block spec (honours moe_layer_freq) with megatron_ext's MoE parts.

    Also the `--spec megatron_ext.specs gpt_block_spec` hook: megatron.training 0.19.2's
    GPTModelBuilder calls it as `gpt_block_spec(gpt_model_config, vp_stage=...)` with a
    GPTModelConfig (which wraps the TransformerConfig in `.transformer`). Defaults follow
    Megatron's own MoE default (`default_layer_spec`): Transformer Engine layers when
    `transformer_impl == "transformer_engine"`, the config's normalization and qk_l2_norm.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    transformer = getattr(config, "transformer", None)
    if isinstance(transformer, TransformerConfig):  # megatron.training's GPTModelConfig
        config = transformer
    if use_transformer_engine is None:
        use_transformer_engine = config.transformer_impl == "transformer_engine"
    if use_transformer_engine:
        require_transformer_engine(f"gpt_block_spec with transformer_impl={config.transformer_impl!r}",
                                   "TransformerConfig(transformer_impl='local') (--transformer-impl local) or "
                                   "use_transformer_engine=False")
    kwargs.setdefault("normalization", config.normalization)
    kwargs.setdefault("qk_l2_norm", config.qk_l2_norm)
    base = get_gpt_decoder_block_spec(config, use_transformer_engine, vp_stage=vp_stage, pp_rank=pp_rank, **kwargs)
    # A stage of a MoE model may hold only dense layers (e.g. --moe-layer-freq [0]*1+[1]*3 with the
    # first layer alone on pipeline stage 0): Megatron's dense layers there, as Megatron builds them
    return swap_moe_parts(base, ext_config, require_moe=config.num_moe_experts is None)
