"""What the encoder does about padding: masks it out of attention (`attention_bias`), or packs the real tokens of a
padded [B, L] batch into [T] so that nothing is computed on it (`Packed`, ModelConfig.unpadded); and the band of
sliding-window (local) attention, combined with either (`window_mask`). Shapes as in `pretrain.model.encoder`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    -> [B, 1, Lq, L]. A query row with no allowed key attends uniformly (finfo.min, not -inf: no NaN).

    Under autocast the bias is made in autocast's dtype, which SDPA casts it to: fp32's finfo.min is -inf in bf16."""
    if attention_mask is None:
        return None
    if torch.is_autocast_enabled(attention_mask.device.type):
        dtype = torch.get_autocast_dtype(attention_mask.device.type)
    bias = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    bias.masked_fill_(~attention_mask.bool(), torch.finfo(dtype).min)
    return bias[:, None, None, :] if attention_mask.dim() == 2 else bias[:, None]


def band(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """ModernBERT's local attention: a query sees the keys at most window // 2 positions away on either side (itself
    included; transformers' `sliding_window` is that half). query_pos [..., Lq], key_pos [L] -> bool [..., Lq, L]."""
    return (query_pos[..., :, None] - key_pos).abs() <= window // 2


def masks_nothing(window: int, length: int) -> bool:
    """Whether a window sees every key of a sequence of `length` from every query (then a layer attends globally)."""
    return window // 2 >= length - 1


def window_mask(
    attention_mask: torch.Tensor | None,
    window: int,
    length: int,
    device: torch.device,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean SDPA mask (True = may attend, broadcast over heads) of a local layer: the band over `length` key
    positions, and the key mask [B, L] / per-query mask [B, Lq, L] when there is one. Rows are the positions
    0..length-1, or `query_positions` [B, Lq] (a query stream). -> [1 or B, 1, Lq, L], on `device` (the
    activations'), also where there is no mask to take it from.

    Boolean, unlike `attention_bias`: a padding query further than the window from every real token has no key at
    all, and SDPA (torch >= 2.5) gives such a row zeros, as transformers' ModernBERT does, where an additive finfo.min
    row would average every key (padding, and under a per-query mask the keys it must not see)."""
    keys = torch.arange(length, device=device)
    allowed = band(keys if query_positions is None else query_positions, keys, window)  # [Lq, L] or [B, Lq, L]
    if attention_mask is not None:
        # [B, L] -> [B, 1, L]: every query the same keys; [B, Lq, L] as it is
        mask = attention_mask.bool()
        allowed = allowed & (mask[:, None, :] if mask.dim() == 2 else mask)
    return allowed[None, None] if allowed.dim() == 2 else allowed[:, None]


@dataclass
class Banded:
    """A local layer's attention computed by blocks: queries in blocks of c = window // 2 positions, each against the
    3c keys its band can reach (the block before, its own, the one after), so the work is L x 3c instead of L x L.
    Softmax runs over exactly the keys the dense `window_mask` allows (the rest of the 3c are masked): the same
    function. Measured in benchmarks/local_attention.py."""

    half: int
    """c = window // 2: the block length, and what a token sees on each side."""
    mask: torch.Tensor
    """[B * nb, 1, c, 3c] bool: block i's query a may see its key b (nb = ceil(L / c) blocks)."""

    @staticmethod
    def build(key_mask: torch.Tensor | None, window: int, length: int, batch: int, device: torch.device) -> Banded:
        """From a [B, L] key mask (None: all real)."""
        c = window // 2
        nb = -(-length // c)
        real = torch.ones(batch, length, dtype=torch.bool, device=device) if key_mask is None else key_mask.bool()
        keys = F.pad(real, (c, nb * c - length + c)).unfold(1, 3 * c, c)  # [B, nb, 3c]: False outside 0..L-1
        # Query a of block i is at i*c + a, key b of its window at (i-1)*c + b: their distance is b - c - a.
        near = (torch.arange(3 * c, device=device) - c - torch.arange(c, device=device)[:, None]).abs() <= c
        return Banded(c, (keys[:, :, None, :] & near).reshape(batch * nb, 1, c, 3 * c))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """q, k, v [B, N, L, D] -> [B, N, L, D]."""
        B, N, L, D = q.shape
        c = self.half
        nb = self.mask.shape[0] // B

        def blocks(t: torch.Tensor, size: int) -> torch.Tensor:
            # [B, N, nb, size, D] -> [B * nb, N, size, D]: one SDPA batch entry per (row, block)
            return t.transpose(1, 2).reshape(B * nb, N, size, D)

        qb = blocks(F.pad(q, (0, 0, 0, nb * c - L)).view(B, N, nb, c, D), c)
        # keys / values with a block of zeros before and after, as overlapping windows of 3 blocks
        kb, vb = (
            blocks(F.pad(t, (0, 0, c, nb * c - L + c)).unfold(2, 3 * c, c).transpose(-1, -2), 3 * c) for t in (k, v)
        )
        y = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=self.mask, dropout_p=dropout_p)  # [B * nb, N, c, D]
        return y.view(B, nb, N, c, D).transpose(1, 2).reshape(B, N, nb * c, D)[:, :, :L]


def local_mask(
    key_mask: torch.Tensor | None, window: int, length: int, batch: int, device: torch.device
) -> Banded | torch.Tensor:
    """What a local layer attends with under a [B, L] key mask (or none): by blocks where they save work (3 blocks of
    window // 2 are fewer keys than the sequence), else the dense boolean `window_mask`."""
    if 3 * (window // 2) < length:
        return Banded.build(key_mask, window, length, batch, device)
    return window_mask(key_mask, window, length, device)


@dataclass
class Packed:
    """The real tokens of a padded [B, L] batch, packed row-major into [T].

    Everything but attention runs on [T, ...]. On a CUDA GPU, in half precision, attention runs on [T] too: flash
    attention's variable-length kernel (`varlen_attention`), each row one sequence, a local layer's band as its
    window, attention dropout in the kernel. Elsewhere attention re-pads q, k, v to [B, Lp] (Lp = the last
    column holding a real token, <= L) and runs SDPA with a key mask, then keeps the T real rows. Measured on this
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
    """[B, 1, 1, Lp] additive key mask of the attention grid (what global layers attend with)."""
    attn_mask: torch.Tensor
    """[B, Lp] bool, True at real tokens of the attention grid (local layers' masks are built from it)."""
    cu_seqlens: torch.Tensor
    """[B + 1] int32: where each row's real tokens start in [T] (and T at the end), for variable-length attention
    (`varlen_attention`). Rows are right-padded, as the collator makes them."""

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
        grid = real[:, :attn_length]
        cu_seqlens = F.pad(real.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
        return Packed(indices, attn_indices, B, L, attn_length, attention_bias(grid, dtype), grid, cu_seqlens)

    def window_mask(self, window: int) -> Banded | torch.Tensor | None:
        """What a local layer attends with on the attention grid (`local_mask`); the global `attn_bias` where the
        window covers the whole grid."""
        if masks_nothing(window, self.attn_length):
            return self.attn_bias
        return local_mask(self.attn_mask, window, self.attn_length, self.batch, self.attn_mask.device)

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


try:
    from torch.nn.attention.varlen import varlen_attn as _VARLEN_ATTN

    if "window_size" not in inspect.signature(_VARLEN_ATTN).parameters:  # a torch before local windows
        _VARLEN_ATTN = None
except ImportError:  # an older torch
    _VARLEN_ATTN = None
# aten's flash forward under torch's varlen_attn, which fixes dropout at 0: with dropout it is what runs, its backward
# replaying the forward's dropout mask from the philox state the forward returns
_FLASH_FORWARD = getattr(torch.ops.aten, "_flash_attention_forward", None) if _VARLEN_ATTN is not None else None
if _FLASH_FORWARD is not None and "window_size_left" not in str(_FLASH_FORWARD.default._schema):
    _FLASH_FORWARD = None


def _varlen_attn():
    """torch's flash varlen attention, or None (a seam the CPU tests replace with a reference of its contract)."""
    return _VARLEN_ATTN


def _flash_forward():
    """aten's flash forward, which takes dropout, or None (a seam the CPU tests replace, as `_varlen_attn`)."""
    return _FLASH_FORWARD


def varlen_usable(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether `varlen_attention` can run q [T, N, D]: flash attention's kernel is CUDA-only, half precision, head
    dim a multiple of 8 up to 256."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and (_varlen_attn() if dropout_p == 0.0 else _flash_forward()) is not None
    )


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed, window: int, dropout_p: float = 0.0
) -> torch.Tensor:
    """Attention of the packed tokens q, k, v [T, N, D] -> [T, N, D], each row of the batch one sequence
    (`Packed.cu_seqlens`); a local layer sees window // 2 positions on either side (flash's window, inclusive), as
    `band`; `dropout_p` on the attention probabilities, as SDPA's. The same function as the re-padded SDPA path for
    right-padded rows."""
    half = window // 2 if window else -1
    cu, length = packed.cu_seqlens, packed.length
    if dropout_p == 0.0:
        return _varlen_attn()(q, k, v, cu, cu, length, length, window_size=(half, half))
    out = _flash_forward()(
        q, k, v, cu, cu, length, length, dropout_p, False, False, window_size_left=half, window_size_right=half
    )
    return out[0]  # (output, logsumexp, philox state, -, debug mask)
