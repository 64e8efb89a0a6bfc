"""Megatron settings the grouped experts or the rowwise layer cannot honor are refused by name, by
the launcher (Megatron's args) and the Python API (a TransformerConfig) alike; the one they apply
differently (gradient accumulation fusion) is said once in the log."""

import logging
import re
from argparse import Namespace

import pytest
import torch

from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
from megatron_ext.rules import EXPERT_REFUSED, ExpertSettings, expert_problems, rowwise_problems
from megatron_ext.testing.megatron_moe import moe_config

VALUES = {"fp8": "e4m3", "fp4": "e2m1"}  # the rest are switches


@pytest.mark.parametrize("rule", EXPERT_REFUSED, ids=[rule.field for rule in EXPERT_REFUSED])
def test_each_refused_setting_is_named_with_its_flag_and_the_fix(rule):
    value = VALUES.get(rule.field, True)
    problems = expert_problems(ExpertSettings.from_args(Namespace(**{rule.field: value})))
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{rule.field}={value!r} ({rule.flag}") and rule.fix in problems[0], problems
    assert expert_problems(ExpertSettings.from_args(Namespace(**{rule.field: None}))) == []


# Megatron's expert settings the grouped experts cannot honor, written out here (not read from
# rules.EXPERT_REFUSED, which the test above walks: a rule dropped from there would drop its case).
REFUSED_BY_NAME = [("fp8", "e4m3", "--fp8-format e4m3"), ("fp4", "e2m1", "--fp4-format e2m1"),
                   ("activation_func_fp8_input_store", True, "activation_func_fp8_input_store (TransformerConfig)"),
                   ("overlap_dispatch_backward_with_experts_wgrad", True,
                    "--overlap-dispatch-backward-with-experts-wgrad"),
                   ("moe_ncclep_zero_copy", True, "--moe-ncclep-zero-copy"),
                   ("moe_paged_stash", True, "--moe-paged-stash")]


@pytest.mark.parametrize("field,value,flag", REFUSED_BY_NAME, ids=[case[0] for case in REFUSED_BY_NAME])
def test_every_setting_the_experts_cannot_honor_is_refused_from_args_and_config(field, value, flag):
    named = re.escape(f"{field}={value!r} ({flag})")
    (problem,) = expert_problems(ExpertSettings.from_args(Namespace(**{field: value})))
    assert re.match(named, problem), problem
    config = moe_config()
    setattr(config, field, value)  # set after __post_init__: some need Transformer Engine to validate
    with pytest.raises(ValueError, match=named):
        DeviceOffsetGroupedMLP._check_config(config)


def test_the_experts_refuse_a_transformer_config_with_one():
    config = moe_config(activation_func_fp8_input_store=True)
    with pytest.raises(ValueError, match=r"activation_func_fp8_input_store=True .*recompute-modules moe_act"):
        DeviceOffsetGroupedMLP._check_config(config)


def test_inference_optimized_transformer_impl_is_refused_by_the_rowwise_layer():
    problems = rowwise_problems(Namespace(transformer_impl="inference_optimized"))
    assert len(problems) == 1 and "--transformer-impl inference_optimized" in problems[0], problems
    assert rowwise_problems(Namespace(transformer_impl="transformer_engine")) == []


def _warnings_when_built(rank, world, fusion, dtype, wgrad_fusion, overrides):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_ext.moe.experts").addHandler(handler)
    DeviceOffsetGroupedMLP(4, moe_config(gradient_accumulation_fusion=fusion, dtype=dtype, **overrides),
                           wgrad_fusion=wgrad_fusion)
    return [record.getMessage() for record in records]


@pytest.mark.parametrize("fusion,dtype,wgrad_fusion,overrides,said", [
    (True, torch.bfloat16, True, {}, False),  # the fast path adds to main_grad in its GEMM (moe/expert_wgrad.py)
    (True, torch.bfloat16, False, {}, True),  # --moe-ext-no-expert-wgrad-fusion
    (True, torch.bfloat16, True, {"add_bias_linear": True}, False),  # the general paths fuse too
    (True, torch.bfloat16, True, {"ffn": 12}, True),  # sizes off 16 bytes: GEMMs on zero-padded weight copies
    (False, torch.bfloat16, False, {}, False), (True, torch.float32, False, {}, False)])
def test_gradient_accumulation_fusion_is_said_once_where_it_changes_rounding(fusion, dtype, wgrad_fusion, overrides,
                                                                               said):
    messages = run_on_ranks(_warnings_when_built, 1, fusion, dtype, wgrad_fusion, overrides, sizes=ParallelSizes())[0]
    assert len([m for m in messages if "gradient_accumulation_fusion" in m]) == int(said), messages


def test_cpu_offloading_is_refused_from_megatrons_args_and_from_a_config():
    # On the launcher's args only --cpu-offloading-num-layers exists yet (validate_args sets cpu_offloading later).
    for settings in (Namespace(cpu_offloading_num_layers=2),
                     Namespace(cpu_offloading=True, cpu_offloading_num_layers=0)):
        problems = expert_problems(ExpertSettings.from_args(settings))
        assert len(problems) == 1 and problems[0].startswith("cpu_offloading (--cpu-offloading-num-layers"), problems
    assert expert_problems(ExpertSettings.from_args(Namespace(cpu_offloading_num_layers=0))) == []


def _mxfp8_probs_on_input_rank(rank, world):
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.specs import moe_builder

    config = moe_config(hidden=32, ffn=16, experts=4, topk=1, ep=1, moe_apply_probs_on_input=True,
                        moe_router_pre_softmax=True)
    moe_builder(MoEExtConfig(transport="torch"))(config=config)  # without MXFP8: built
    try:
        moe_builder(MoEExtConfig(transport="torch", mxfp8_dispatch=True))(config=config)
    except ValueError as error:
        return str(error)
    return None


def test_probabilities_on_the_input_with_mxfp8_payloads_are_refused():
    """fc1 reads the MXFP8 payload, not the probability-scaled copy of the rows: a review saw the
    probabilities dropped (output unscaled, the router's gradient from the experts zero)."""
    from megatron_ext.rules import MXFP8_PROBS_ON_INPUT

    (message,) = run_on_ranks(_mxfp8_probs_on_input_rank, 1, sizes=ParallelSizes())
    assert message == MXFP8_PROBS_ON_INPUT
    assert "--moe-apply-probs-on-input" in message and "--moe-ext-mxfp8-dispatch" in message
