"""What the encoder does about padding: masks it out of attention (`attention_bias`), or packs the real tokens of a
padded [B, L] batch into [T] so that nothing is computed on it (`Packed`, ModelConfig.unpadded). Shapes as in
`pretrain.model.encoder`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class _TakeRows(torch.autograd.Function):
    """rows = src[indices] for UNIQUE indices. Autograd's own backward of index_select accumulates with
    scatter_add, which on CPU took ~140 ms per [2500, 256] call here (vs < 1 ms for this): with unique
    indices nothing collides, so the gradient is a plain index_copy into zeros."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.rows = src.shape[0]
        return src.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad.new_zeros((ctx.rows, *grad.shape[1:])).index_copy_(0, indices, grad), None


def attention_bias(attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive bias for SDPA (broadcast over heads); None when nothing is masked. Accepts a key mask
    [B, L] (1 = real token) -> [B, 1, 1, L], or a per-query mask [B, Lq, L] (True = query may attend key)
    -> [B, 1, Lq, L]. A query row with no allowed key attends uniformly (finfo.min, not -inf: no NaN)."""
    if attention_mask is None:
        return None
    bias = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    bias.masked_fill_(~attention_mask.bool(), torch.finfo(dtype).min)
    return bias[:, None, None, :] if attention_mask.dim() == 2 else bias[:, None]


@dataclass
class Packed:
    """The real tokens of a padded [B, L] batch, packed row-major into [T].

    Everything but attention runs on [T, ...]. Attention re-pads q, k, v to [B, Lp] (Lp = the last column
    holding a real token, <= L) and runs SDPA with a key mask, then keeps the T real rows. Measured on this
    CPU (torch 2.13, B=32, L=128, 37% padding, fwd+bwd of attention alone): that costs about as much as padded
    SDPA (the scatter/gather is small), while the varlen alternatives were slower: nested jagged tensors ~4x
    (SDPA on CPU runs them one sequence at a time), a Python loop of per-sequence SDPA ~2.5x, length buckets
    ~1.6x. Attention is the small part of the FLOPs at BERT lengths; the projections and the FFN, which carry
    most of them, do no work on padding."""

    indices: torch.Tensor
    """[T] flat position b * L + l of each real token in the [B, L] batch."""
    attn_indices: torch.Tensor
    """[T] its flat position b * Lp + l in attention's [B, Lp] grid."""
    batch: int
    length: int
    attn_length: int
    attn_bias: torch.Tensor | None
    """[B, 1, 1, Lp] additive key mask of the attention grid."""

    @staticmethod
    def from_mask(attention_mask: torch.Tensor, dtype: torch.dtype, num_tokens: int | None = None) -> Packed:
        """From a [B, L] key mask. With `num_tokens` (T, known on the host from the collator) nothing is read back
        from the device: rows padded to the longest one fill the last column, so the attention grid is all of L."""
        real = attention_mask.bool()  # [B, L]
        B, L = real.shape
        if num_tokens is not None:
            indices = real.flatten().nonzero_static(size=num_tokens).squeeze(1)  # [T]
            attn_length = L
        else:
            indices = real.flatten().nonzero().squeeze(1)  # [T]
            attn_length = int(real.any(0).nonzero().max()) + 1 if indices.numel() else 1
        attn_indices = indices // L * attn_length + indices % L
        return Packed(indices, attn_indices, B, L, attn_length, attention_bias(real[:, :attn_length], dtype))

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> [T, ...] (the real tokens)."""
        return _TakeRows.apply(t.reshape(self.batch * self.length, *t.shape[2:]), self.indices)

    def to_attention(self, t: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, Lp, ...], zeros at padding."""
        grid = t.new_zeros((self.batch * self.attn_length, *t.shape[1:])).index_copy(0, self.attn_indices, t)
        return grid.view(self.batch, self.attn_length, *t.shape[1:])

    def from_attention(self, t: torch.Tensor) -> torch.Tensor:
        """[B, Lp, ...] -> [T, ...]."""
        return _TakeRows.apply(t.reshape(self.batch * self.attn_length, *t.shape[2:]), self.attn_indices)

    def repad(self, t: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, L, ...], zeros at padding: what the objectives' loss(batch, hidden [B, L, H]) takes.
        One write of B*L*H (its backward one gather): small next to a layer."""
        full = t.new_zeros((self.batch * self.length, *t.shape[1:])).index_copy(0, self.indices, t)
        return full.view(self.batch, self.length, *t.shape[1:])
