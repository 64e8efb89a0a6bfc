"""Zero padding that lets `torch._grouped_mm` serve any hidden and FFN size.

`torch._grouped_mm` needs every row stride to be a multiple of 16 bytes (8 bf16/fp16 values,
4 fp32 values): the hidden size H (input rows, fc2 output rows) and the FFN size F (fc1 output
and fc2 input rows). Otherwise it raises "strides should be multiple of 16 bytes" from inside
the forward. For other sizes the experts pad, per forward and inside autograd: the input rows
to H' columns, fc1 to [L, g*F', H'] (gate and up halves padded separately when gated), fc2 to
[L, H', F'], the biases likewise, and return the first H output columns. The padded weight
columns are zero, so the padded FFN channels contribute nothing and the gradients of the real
weights are exact; the gradients of the padding are dropped by the pad's backward.

Parameters and checkpoints keep Megatron's layout and sizes: padding never reaches them.
Cost accepted (odd sizes only): one copy of the input rows, the weights and the output per
forward. Aligned sizes (every production shape) take none of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def grouped_mm_alignment(dtype: torch.dtype) -> int:
    """Values per 16 bytes: row sizes `torch._grouped_mm` accepts are multiples of this."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class GemmPadding:
    hidden: int
    ffn: int
    hidden_padded: int
    ffn_padded: int
    gated: bool

    @staticmethod
    def needed(hidden: int, ffn: int, dtype: torch.dtype, gated: bool) -> "GemmPadding | None":
        """The padding for these sizes, or None when they are aligned already."""
        align = grouped_mm_alignment(dtype)
        padded = (_round_up(hidden, align), _round_up(ffn, align))
        if padded == (hidden, ffn):
            return None
        return GemmPadding(hidden, ffn, padded[0], padded[1], gated)

    def pad(self, hidden_rows, fc1, fc2, fc1_bias, fc2_bias):
        """(rows [C, H'], fc1 [L, g*F', H'], fc2 [L, H', F'], fc1 bias [L, g*F'] | None, fc2 bias [L, H'] | None)."""
        dh, df = self.hidden_padded - self.hidden, self.ffn_padded - self.ffn
        rows = F.pad(hidden_rows, (0, dh)) if dh else hidden_rows
        fc1 = self._pad_ffn_rows(fc1, (0, dh, 0, df))
        fc2 = F.pad(fc2, (0, df, 0, dh))
        if fc1_bias is not None:
            fc1_bias = self._pad_ffn_rows(fc1_bias, (0, df))
        if fc2_bias is not None:
            fc2_bias = F.pad(fc2_bias, (0, dh))
        return rows, fc1, fc2, fc1_bias, fc2_bias

    def _pad_ffn_rows(self, tensor, pad):
        """Pad fc1's weight [L, g*F, H] or bias [L, g*F]: each of the g halves to F' rows."""
        if not self.gated:
            return F.pad(tensor, pad)
        halves = tensor.unflatten(1, (2, self.ffn))  # [L, 2, F, ...]: gate rows, then up rows
        return F.pad(halves, pad).flatten(1, 2)

    def unpad_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The first H columns of the padded output [C, H'], contiguous."""
        return out[:, :self.hidden].contiguous()
