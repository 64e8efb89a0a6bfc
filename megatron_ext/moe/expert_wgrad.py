"""The grouped experts' weight gradients, straight into Megatron's main_grad where DDP holds one.

Megatron's DDP (megatron-core 0.19.2, `DistributedDataParallel._make_backward_post_hook`) gives
each parameter an fp32 (or 16-bit) `main_grad` and a flag `grad_added_to_main_grad`; its hook
adds `param.grad` to `main_grad` unless a layer set the flag, which Megatron's own linear layers
do under `gradient_accumulation_fusion` after their GEMM accumulated into `main_grad` itself. The
grouped experts follow the same contract (`MoEExtConfig.expert_wgrad_fusion`): the weight
gradient is summed in fp32 by kernels/grouped_wgrad.py and added to `main_grad` in that kernel's
epilogue; autograd gets an unwritten placeholder, which the hook drops. Cost removed and cost
accepted: see that kernel. Where the weight has no such `main_grad` (no Megatron DDP; Megatron-FSDP,
whose main_grad is a per-microbatch bucket it manages itself) or the rows are fp32 (Triton's dot
would round them to TF32) the gradient is the plain grouped GEMM's. The DDP internals used are
checked by tests/unit/test_expert_wgrad.py.

`grouped_linear` is the experts' other GEMMs (fc1 of the general paths, fc2 outside the fast
path's node) as one autograd node with that weight gradient, in the weight's own layout.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from megatron_ext.kernels.grouped_wgrad import accumulate_grouped_wgrad, accumulate_grouped_wgrad_reference

FUSED_ROW_DTYPES = (torch.bfloat16, torch.float16)


def fuses_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether Megatron's DDP holds a main_grad for `weight` that the kernel can add to in place."""
    main_grad = getattr(weight, "main_grad", None)
    return (main_grad is not None and hasattr(weight, "grad_added_to_main_grad")
            and not hasattr(weight, "__fsdp_param__")
            and main_grad.shape == weight.shape and main_grad.is_contiguous()
            and main_grad.dtype in (torch.float32, torch.bfloat16))


def expert_weight_grad(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, offsets: torch.Tensor,
                       fuse: bool) -> torch.Tensor:
    """The gradient of `weight` [L, M, N] for autograd: left^T @ right per expert (rows by the int32
    end `offsets`). With `fuse`, 16-bit rows and a DDP main_grad on the weight, the sum goes into
    main_grad and what autograd gets is the placeholder Megatron's linear layers hand it."""
    if not (fuse and left.dtype in FUSED_ROW_DTYPES and fuses_into_main_grad(weight)):
        return torch._grouped_mm(left.t(), right, offs=offsets)
    accumulate = accumulate_grouped_wgrad if left.is_cuda else accumulate_grouped_wgrad_reference
    accumulate(left, right, offsets, weight.main_grad)
    weight.grad_added_to_main_grad = True
    # DDP's hook still adds param.grad when zero_out_wgrad is set: that placeholder must be zeros.
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


def grouped_linear_grads(param: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, grad_out: torch.Tensor,
                         rows, fuse: bool, needs: tuple[bool, bool]):
    """The gradients of rows @ weight[e]^T per expert, each only where `needs` (rows, weight) asks:
    (grad of the rows, grad of `param` for autograd, expert_weight_grad). `rows` is the saved input
    or a function that makes it (called only for the weight's gradient; the weight's gradient comes
    first, so such a transient is freed before the rows' gradient is allocated)."""
    need_rows, need_weight = needs
    grad_out = grad_out.contiguous()
    grad_weight = None
    if need_weight:  # a frozen weight (main_grad or not) gets nothing added and no flag set
        grad_weight = expert_weight_grad(param, grad_out, rows() if callable(rows) else rows, offsets, fuse)
    grad_rows = torch._grouped_mm(grad_out, weight, offs=offsets) if need_rows else None
    return grad_rows, grad_weight


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, offsets, fuse: bool):
        ctx.save_for_backward(rows, weight, offsets)
        ctx.weight, ctx.fuse = weight, fuse  # the parameter itself, with DDP's main_grad
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        rows, weight, offsets = ctx.saved_tensors
        grads = grouped_linear_grads(ctx.weight, weight, offsets, grad_out, rows, ctx.fuse, ctx.needs_input_grad[:2])
        return *grads, None, None


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, fuse: bool) -> torch.Tensor:
    """rows [R, N] @ weight[e]^T per expert -> [R, M] (weight [L, M, N], int32 end offsets; rows past
    the last offset are not read), as torch's autograd of `torch._grouped_mm` would compute it but
    with the weight gradient formed in the weight's layout (no strided copy into the parameter) and,
    with `fuse`, added to DDP's main_grad (expert_weight_grad)."""
    # grouped_mm's backward wants row-major operands; a transposed view would fail only there, on the GPU.
    return _GroupedLinear.apply(rows.contiguous(), weight, offsets, fuse)
