"""MoEExtConfig validation: every bad setting is a clear error."""

import pytest

from megatron_ext.config import MoEExtConfig


@pytest.mark.parametrize("kwargs,match", [
    (dict(transport="nvlink"), "unknown row transport 'nvlink'"),
    (dict(dispatcher="flex"), "unknown MoE dispatcher"),
    (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
    (dict(capacity_factor=-1.0), "capacity_factor must be > 0"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank must be >= 1"),
    (dict(metrics_interval=-1), "metrics_interval"),
    (dict(lease_slots=0), "lease_slots"),
    (dict(dispatcher="megatron", mxfp8_dispatch=True), "mxfp8_dispatch needs dispatcher='rowwise'"),
    (dict(dispatcher="megatron", cuda_graphs=True), "cuda_graphs"),
])
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEExtConfig(**kwargs)


def test_defaults_are_valid():
    config = MoEExtConfig()
    assert (config.dispatcher, config.transport, config.capacity_factor) == ("rowwise", "auto", 1.25)
    assert "capacity_factor" in MoEExtConfig.field_names()
