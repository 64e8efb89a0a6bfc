"""Two small contracts a mutation audit found unasserted: the layers' drop warning is given once
per process and not after the launcher's own notice; the experts pad only sizes torch's grouped
GEMM cannot take (16-byte rows)."""

import logging

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.moe import drop_notice
from megatron_ext.moe.expert_padding import GemmPadding


def _warnings(caplog):
    return [r for r in caplog.records if r.name == "megatron_ext" and "may drop routes" in r.getMessage()]


def test_the_drop_warning_is_given_once_and_not_after_the_launchers_notice(monkeypatch, caplog):
    config = MoEExtConfig(capacity_factor=1.0)
    assert drop_notice.drops_beyond_capacity(config, 2)
    monkeypatch.setattr(drop_notice, "_given", False)
    with caplog.at_level(logging.WARNING, logger="megatron_ext"):
        drop_notice.give_for_layer(config, 2)
        drop_notice.give_for_layer(config, 2)
    assert len(_warnings(caplog)) == 1
    caplog.clear()
    monkeypatch.setattr(drop_notice, "_given", False)
    drop_notice.mark_given()  # the launcher printed its notice
    with caplog.at_level(logging.WARNING, logger="megatron_ext"):
        drop_notice.give_for_layer(config, 2)
    assert _warnings(caplog) == []


@pytest.mark.parametrize("hidden, ffn, dtype, padded", [
    (12, 20, torch.float32, None),  # fp32: 4 values are 16 bytes
    (12, 20, torch.bfloat16, (16, 24)),  # bf16: 8 values
    (16, 24, torch.bfloat16, None),
    (16, 20, torch.float16, (16, 24)),
])
def test_only_sizes_off_16_bytes_are_padded(hidden, ffn, dtype, padded):
    padding = GemmPadding.needed(hidden, ffn, dtype, gated=True)
    assert (None if padding is None else (padding.hidden_padded, padding.ffn_padded)) == padded
