"""Float8 matrix products for training (train.precision=fp8), on torch's own `torch._scaled_mm`.

The recipe is the one torchao and Transformer Engine train with on Hopper GPUs, with dynamic per-tensor scales:
each product quantizes its operands right before it, inputs and weights to e4m3 (more mantissa) and output
gradients to e5m2 (more range), each scaled so that its largest magnitude lands on the format's maximum. The three
products of a Linear (forward y = x w^T, backward dx = dy w, dw = dy^T x) run in fp8 with fp32 accumulation; their
results, the weights, the optimizer and everything outside the encoder's Linears stay as in bf16. The quantized
input and weight are what the backward keeps: half the memory of bf16 activations.

Only the encoder layers' projections are converted (`use_float8`): attention's q/k/v and output, and the FFN. The
embeddings, the LM head (tied to the word embeddings, whose softmax is sensitive to its scale), the other heads and
the norms keep bf16, as in torchao's recipe. A Linear whose widths are not multiples of 16 (what the fp8 kernels
need) stays bf16. Rows are padded to a multiple of 16 where a batch's token count is not one (unpadded batches):
zero rows change neither a scale nor a gradient.

Converted Linears are `Float8Linear`s: the same parameters under the same names, so checkpoints, exports and a later
bf16 run read them unchanged. fp8 kernels need compute capability 8.9 or newer (H100, L40S, RTX 4090); a CPU runs
torch's reference kernel (correct and slow: for tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALIGN = 16  # the fp8 kernels' granularity on every dimension of a product


def float8_problem(device: torch.device) -> str | None:
    """Why `device` cannot train in fp8, or None where it can."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            return f"{name} has compute capability {major}.{minor}; fp8 matrix products need 8.9 or newer (H100, L40S)"
        return None
    if device.type == "cpu":
        return None
    return f"fp8 matrix products are not available on {device.type} devices"


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in `dtype`, scaled so that its largest magnitude is the format's maximum; the fp32 factor [] that turns it
    back, what `torch._scaled_mm` takes). On the device: no host read."""
    top = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float()
    scale = top / amax.clamp(min=1e-12)
    # row-major whatever t's strides: `_scaled_mm` takes its first operand row-major
    return (t.float() * scale).clamp(-top, top).to(dtype).contiguous(), scale.reciprocal()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major, as `_scaled_mm` needs its second operand."""
    return t.t().contiguous().t()


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    extra = -t.shape[0] % ALIGN
    # Compiled, always pad (by zero rows where none are needed; fused into the quantization): testing `extra` there
    # would guard a graph dynamic in the rows (unpadded: the real tokens) on rows % 16, and compile it again.
    return F.pad(t, (0, 0, 0, extra)) if torch.compiler.is_compiling() or extra else t


class _Float8Matmul(torch.autograd.Function):
    """x [N, in] @ weight[out, in]^T -> [N, out] in `out_dtype`, its three products in fp8 (N a multiple of 16)."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype):
        x8, x_inv = quantize(x, E4M3)  # [N, in]
        w8, w_inv = quantize(weight, E4M3)  # [out, in]
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.dtypes = x.dtype, weight.dtype
        return torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g8, g_inv = quantize(grad, E5M2)  # [N, out]
        grad_x = torch._scaled_mm(g8, _column_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=x_dtype)
        grad_w = torch._scaled_mm(
            g8.t().contiguous(), _column_major(x8), scale_a=g_inv, scale_b=x_inv, out_dtype=w_dtype
        )  # [out, in]
        return grad_x, grad_w, None


class Float8Linear(nn.Linear):
    """An nn.Linear whose product runs in fp8 (see the module doc); parameters and their names unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out], in autocast's dtype where autocast is on (as F.linear would give), else x's
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        y = _Float8Matmul.apply(_pad_rows(rows), self.weight, out_dtype)[: rows.shape[0]]  # [N, out]
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def use_float8(encoder: nn.Module) -> list[str]:
    """Turn the Linears of the encoder's layers into `Float8Linear`s in place (same parameters, same names); returns
    the names of those converted. Widths that are not multiples of 16 stay as they are."""
    converted = []
    for name, module in encoder.named_modules():
        in_a_layer = name.startswith(("layers.", "shared_layer."))  # BertEncoder's (ALBERT: one shared layer)
        plain = type(module) is nn.Linear  # not a subclass (nor an already converted one)
        if in_a_layer and plain and module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0:
            module.__class__ = Float8Linear
            converted.append(name)
    return converted
