"""A BERT encoder on PyTorch SDPA with fused qkv, and the options of its successors (ModernBERT, ALBERT).

Shapes: B = batch, L = sequence length, H = hidden size, N = heads, D = H / N, I = intermediate size,
E = embedding width (= H unless ALBERT-factorized), T = real (non-padding) tokens of a batch, V = vocabulary.
Weight names are ours (fused qkv projection); `pretrain.hf.interop` maps them to each HF architecture.

The defaults are BERT: post-LN, learned absolute positions, GELU, biases, E = H, one set of weights per layer,
and run exactly the ops (so the bits) they always ran. Each ModelConfig option changes one thing and they
compose freely, because each lives in one place:
- norm_placement=pre    EncoderLayer: LN before attention and FFN, residuals un-normalised; a final LN
                        (`encoder.final_norm`). The embedding LN stays (ModernBERT's `embeddings.norm`), so the
                        first layer's attn_norm is an Identity (ModernBERT's too) except where its input is not
                        that LN's output: shared layers (one module for every depth) and E != H (projected).
- position_embedding=rope  SelfAttention rotates q and k per head (HF's rotate-half convention, as ModernBERT);
                        no position table. cos/sin come from a cache of the longest length asked (`rope_tables`).
- activation=geglu      EncoderLayer: ffn_in projects to 2I; gelu(first half) * second half (ModernBERT's order,
                        so its Wi maps unchanged).
- use_bias=False        every Linear and LayerNorm of the encoder (and of the objectives' LM heads) without bias.
- embedding_size=E      Embeddings: word/position/type tables of width E, LN(E), then `embeddings.projection` E -> H.
- share_layers          BertEncoder: one `shared_layer` (in the state dict once); `layers` is that module N times.
- local_attention=W     SelfAttention(window=W) in every layer but each global_every-th (`layer_windows`, ModernBERT's
                        layer_types): a token sees the keys within W/2 positions on each side, and with RoPE its q/k
                        turn by local_rope_theta. The layers' masks are built once per forward per distinct window
                        (`LayerInputs`), a boolean band AND the key mask (`padding.window_mask`), so SDPA runs as for
                        global layers; a window that covers the whole sequence takes the global bias (same bits).
                        Positions are columns, so documents packed in one row share a band as they share global
                        attention; global layers run exactly as without the option.
- unpadded              BertEncoder: real tokens packed to [T, H] for embeddings, projections, FFN and LN;
                        attention runs flash's variable-length kernel on [T] where it can (CUDA, half precision,
                        with or without attention dropout: `padding.varlen_usable`), else re-pads q/k/v only (see
                        `Packed`).
- compile               torch.compile of plain functions over the modules (state-dict names unchanged): the
                        embeddings (`_embed`) and the layer stack (`layer_stack`), as the objectives' heads and
                        losses are; how, in `pretrain.model.compiling` (model.compile_mode).
- activation_checkpointing  each layer under torch.utils.checkpoint (non-reentrant, RNG state preserved).

A second stream (`EncoderStream`, the extension point of objectives that need one): besides the content stream
h [B, L, H], the encoder can carry a stream g [B, Lq, H] through the SAME layers, the stream running each layer
through its parts so the layers keep one signature. `QueryStream` is XLNet's (objectives.plm builds it): at each
layer g's queries attend to the content stream's keys/values at that layer's input, under a per-query mask; g never
attends to g. Without a stream nothing changes: same ops, same bits, compiled and unpadded paths included. With
one the encoder always runs padded (its masks are per query, [B, Lq, L]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretrain.core.config import ModelConfig
from pretrain.model.compiling import compiled
from pretrain.model.padding import (
    Banded,
    Packed,
    attention_bias,
    local_mask,
    masks_nothing,
    varlen_attention,
    varlen_usable,
    window_mask,
)


def _linear(cfg: ModelConfig, n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=cfg.use_bias)


def make_norm(cfg: ModelConfig, width: int) -> nn.LayerNorm:
    return nn.LayerNorm(width, eps=cfg.layer_norm_eps, bias=cfg.use_bias)


def _embedding_size(cfg: ModelConfig) -> int:
    return cfg.embedding_size or cfg.hidden_size


# ----------------------------------------------------------------------------------------------
# Rotary position embeddings

_ROPE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (D, theta, device, dtype) -> the longest cos, sin


def rope_tables(
    length: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, D] of positions 0..length-1 (computed in fp32, then cast, as HF does). Cached: every
    layer of every step asks for the same table. One table per head size, theta, device and dtype, of the longest
    length asked: a shorter length's is its first rows, bit for bit (each row is its position's alone). A table per
    length grew without bound where batches vary in width (doc-bounded packing, segment pairs): to gigabytes of device
    memory at 8192 positions. Under torch.compile they are computed in the graph instead (a dict of tensors would be
    a guard per entry; inductor folds the arithmetic)."""
    key = (head_dim, theta, device, dtype)
    caching = not torch.compiler.is_compiling()
    cached = _ROPE_CACHE.get(key) if caching else None
    if cached is not None and cached[0].shape[0] >= length:
        return cached[0][:length], cached[1][:length]
    # A cached table made under torch.inference_mode (an evaluation pass) would be an inference tensor, which no
    # later training step could save for backward: cached tables are made outside it.
    with torch.inference_mode(False) if caching else contextlib.nullcontext():
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # [D/2]
        angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)  # [L, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [L, D]: rotate-half pairs dims i and i + D/2
        tables = (angles.cos().to(dtype), angles.sin().to(dtype))
    if caching:
        _ROPE_CACHE[key] = tables
    return tables


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last dim: x [..., D], cos / sin broadcastable to x. Pairs (i, i + D/2) turn by angle_i."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ----------------------------------------------------------------------------------------------
# Modules


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = _embedding_size(cfg)
        self.word_embeddings = nn.Embedding(cfg.vocab_size, E, padding_idx=cfg.pad_token_id)
        # RoPE encodes positions in attention: no table (and nothing to export for it).
        self.position_embeddings = (
            nn.Embedding(cfg.max_position_embeddings, E) if cfg.position_embedding == "learned" else None
        )
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, E)
        self.layer_norm = make_norm(cfg, E)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        # ALBERT: the tables are E wide and LN-ed there; one matmul lifts them to H (only when E != H, so the
        # default model has no such weight).
        self.projection = _linear(cfg, E, cfg.hidden_size) if E != cfg.hidden_size else None

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """input_ids, token_type_ids [B, L] -> [B, L, H]. Packed: input_ids, token_type_ids, position_ids [T] ->
        [T, H]. position_ids defaults to 0..L-1 for every row. project=False: the E-wide normalised embeddings,
        before the E -> H projection (what ELECTRA's generator reads through its own projection)."""
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)
                x = x + self.position_embeddings(positions)[None]
            else:
                x = x + self.position_embeddings(position_ids)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.dropout(self.layer_norm(x))
        return x if self.projection is None or not project else self.projection(x)

    def query_stream(self, word: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """Initial query stream: a content-free vector `word` [H] in place of the word embedding, plus the
        position and type embeddings of `positions`, normalised like the content embeddings. With RoPE the
        position enters in attention instead (BertEncoder's `query_positions`).
        word [H], positions / token_type_ids [B, Lq] -> [B, Lq, H]."""
        if self.projection is not None:
            raise ValueError("the PLM query stream needs embedding_size == hidden_size (its w is H wide)")
        if self.position_embeddings is None:
            x = word + self.token_type_embeddings(token_type_ids)
        else:
            x = word + self.position_embeddings(positions) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.layer_norm(x))


def layer_windows(cfg: ModelConfig) -> list[int]:
    """Each layer's attention window, 0 = global: with model.local_attention, layer i is global when
    i % global_every == 0 and local otherwise (ModernBERT's layer_types)."""
    window = getattr(cfg, "local_attention", 0)
    return [0 if not window or i % cfg.global_every == 0 else window for i in range(cfg.num_layers)]


def _theta(cfg: ModelConfig, window: int) -> float:
    return cfg.local_rope_theta if window else cfg.rope_theta


def set_rope_theta(model: nn.Module, theta: float) -> None:
    """Give every global attention layer in `model` (its encoders, ELECTRA's generator) RoPE base `theta`: a schedule
    phase's (context extension). Local layers keep model.local_rope_theta. No weights change; the tables follow. Each
    module's config says it too (the encoders', the pretraining model's, which an export writes into config.json)."""
    for module in model.modules():
        if isinstance(module, SelfAttention) and module.rope_theta is not None and not module.window:
            module.rope_theta = float(theta)
        config = getattr(module, "config", None)
        if isinstance(config, ModelConfig) and config.position_embedding == "rope":
            module.config = replace(config, rope_theta=float(theta))


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int = 0):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = _linear(cfg, cfg.hidden_size, 3 * cfg.hidden_size)  # one matmul for q, k, v
        self.out = _linear(cfg, cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_dropout
        # 0: global. Else local: the mask it is given holds the band (BertEncoder picks it by this number).
        self.window = window
        self.rope_theta = _theta(cfg, window) if cfg.position_embedding == "rope" else None

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | Banded | None
    ) -> torch.Tensor:
        # q [B, N, Lq, D], k / v [B, N, L, D] -> [B, Lq, H] (before the output projection)
        B, N, Lq, D = q.shape
        dropout_p = self.dropout_p if self.training else 0.0
        if isinstance(attn_bias, Banded):  # a local layer, block by block
            y = attn_bias.attend(q, k, v, dropout_p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p)
        return y.transpose(1, 2).reshape(B, Lq, N * D)

    def qkv_heads(self, x: torch.Tensor, rope: tuple | None = None) -> torch.Tensor:
        """q, k, v of x [*lead, H] stacked as [*lead, 3, N, D], q and k rotated under RoPE. rope: (cos, sin)
        broadcastable to [*lead, 1, 1, D] (the tokens' positions), default 0..L-1 over the last lead dim."""
        *lead, H = x.shape  # lead: [B, L], or [T] packed
        N, D = self.num_heads, H // self.num_heads
        qkv = self.qkv(x).view(*lead, 3, N, D)
        if self.rope_theta is not None:
            if rope is None:  # positions 0..L-1 (also how layers used outside BertEncoder, e.g. ELECTRA's generator)
                cos, sin = rope_tables(lead[-1], D, self.rope_theta, x.device, qkv.dtype)
                rope = (cos[:, None, None], sin[:, None, None])  # [L, 1, 1, D]
            cos, sin = (t.to(qkv.dtype) for t in rope)  # tables may be fp32 while autocast runs bf16
            qkv = torch.cat((rotate(qkv[..., :2, :, :], cos, sin), qkv[..., 2:, :, :]), dim=-3)
        return qkv

    def project(self, x: torch.Tensor, rope: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, N, L, D] of x [B, L, H]."""
        q, k, v = self.qkv_heads(x, rope).permute(2, 0, 3, 1, 4)  # 3 x [B, N, L, D]
        return q, k, v

    def queries(self, x: torch.Tensor, rope: tuple | None = None) -> torch.Tensor:
        """Queries [B, N, Lq, D] of another stream x [B, Lq, H] (`EncoderStream`): only the q third of the fused
        projection. rope: (cos, sin) at that stream's positions, broadcastable to [B, Lq, 1, D]."""
        B, Lq, H = x.shape
        N = self.num_heads
        bias = self.qkv.bias[:H] if self.qkv.bias is not None else None
        q = F.linear(x, self.qkv.weight[:H], bias).view(B, Lq, N, H // N)
        if self.rope_theta is not None:
            if rope is None:
                raise ValueError("with RoPE the query stream needs its positions (BertEncoder query_positions)")
            q = rotate(q, *(t.to(q.dtype) for t in rope))
        return q.transpose(1, 2)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_bias: torch.Tensor | Banded | None,
        packed: Packed | None = None,
    ) -> torch.Tensor:
        """Attention of q [B, N, Lq, D] over k / v [B, N, L, D], output-projected: [B, Lq, H], or [T, H] packed."""
        y = self._attend(q, k, v, attn_bias)  # [B, Lq, H]
        if packed is not None:
            y = packed.from_attention(y)  # [T, H]: the output projection skips padding
        return self.out(y)

    def forward(
        self, x: torch.Tensor, attn_bias: torch.Tensor | Banded | None, *, rope: tuple | None = None, packed=None
    ) -> torch.Tensor:
        """x [B, L, H] -> [B, L, H], or packed x [T, H] -> [T, H] (attn_bias then over `packed`'s attention grid;
        where flash attention's variable-length kernel can run, on the packed tokens themselves)."""
        if packed is not None:
            qkv = self.qkv_heads(x, rope)  # [T, 3, N, D]
            dropout_p = self.dropout_p if self.training else 0.0
            if varlen_usable(qkv, dropout_p):
                y = varlen_attention(*qkv.unbind(1), packed, self.window, dropout_p)  # [T, N, D]
                return self.out(y.flatten(1))
            q, k, v = packed.to_attention(qkv).permute(2, 0, 3, 1, 4)  # 3 x [B, N, Lp, D]
            return self.attend(q, k, v, attn_bias, packed)
        q, k, v = self.project(x, rope)
        return self.attend(q, k, v, attn_bias)


class EncoderLayer(nn.Module):
    """Post-LN (BERT): x = LN(x + Attn(x)); x = LN(x + FFN(x)).
    Pre-LN:           x = x + Attn(LN(x)); x = x + FFN(LN(x)).
    FFN: ffn_out(gelu(ffn_in(x))), or with GeGLU ffn_out(gelu(a) * b) where [a, b] = ffn_in(x) [.., 2I]."""

    def __init__(self, cfg: ModelConfig, attn_norm: bool = True, window: int = 0):
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.gated = cfg.activation == "geglu"
        self.attention = SelfAttention(cfg, window)
        # attn_norm=False only for a pre-LN layer whose input is already LayerNorm-ed (see the module doc).
        self.attn_norm = make_norm(cfg, cfg.hidden_size) if attn_norm else nn.Identity()
        self.ffn_in = _linear(cfg, cfg.hidden_size, (2 if self.gated else 1) * cfg.intermediate_size)
        self.ffn_out = _linear(cfg, cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = make_norm(cfg, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        # [*, H] -> [*, H]
        if self.gated:
            a, b = self.ffn_in(x).chunk(2, dim=-1)  # [*, I] each
            return self.ffn_out(F.gelu(a) * b)
        return self.ffn_out(F.gelu(self.ffn_in(x)))

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        # What attention reads of a stream: its state, LayerNorm-ed first under pre-LN. [*, H] -> [*, H]
        return self.attn_norm(x) if self.pre_norm else x

    def residual_ffn(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        # The block math after attention, the same for every stream: [B, *, H] (or [T, H]) -> same
        if self.pre_norm:
            x = x + self.dropout(attn_out)
            return x + self.dropout(self._ffn(self.ffn_norm(x)))
        x = self.attn_norm(x + self.dropout(attn_out))
        return self.ffn_norm(x + self.dropout(self._ffn(x)))

    def forward(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | Banded | None,
        *,
        rope: tuple | None = None,
        packed: Packed | None = None,
    ) -> torch.Tensor:
        """x [B, L, H] (or packed [T, H]) -> same. One signature whatever the objective: a second stream runs
        through the layer's parts (`EncoderStream.layer`), not through extra arguments."""
        return self.residual_ffn(x, self.attention(self.attention_input(x), attn_bias, rope=rope, packed=packed))


class LayerInputs(NamedTuple):
    """What the layers of one window (0 = global) attend with in one forward: built once, used by each of them."""

    bias: torch.Tensor | Banded | None
    """Content stream: additive [B or 1, 1, 1 or L, L] (global), bool [B or 1, 1, L, L] or `Banded` (local); packed:
    over the attention grid [B, Lp]."""
    rope: tuple | None
    """Packed: (cos, sin) [T, 1, 1, D] at each token's position; None: the layer's own 0..L-1 tables."""
    stream: Any = None
    """What a second stream's layers need in this window (`EncoderStream.window_inputs`); None without one."""


@runtime_checkable
class EncoderStream(Protocol):
    """A second stream carried through the encoder's layers beside the content stream: the extension point of
    objectives that need one (XLNet's query stream, `QueryStream`, built by objectives.plm). An objective's
    `before_encoder` puts one in `Forward.stream`; the encoder returns its final state beside the content's
    (`Forward.stream_hidden`). The layers keep one signature: the stream runs each through the layer's parts
    (`attention_input`, `attention.project` / `queries` / `attend`, `residual_ffn`), so the content stream comes
    out as the layer alone gives it. With a stream the encoder runs padded (never `unpadded`)."""

    def start(self) -> torch.Tensor:
        """The stream's initial state [B, Lq, H]."""
        ...

    def window_inputs(self, encoder: BertEncoder, window: int, x: torch.Tensor) -> Any:
        """What the layers of `window` need for this stream (masks, rotary tables), built once per forward from the
        content embeddings x [B, L, H]; it reaches `layer` as `inputs.stream`."""
        ...

    def layer(
        self, layer: EncoderLayer, x: torch.Tensor, state: torch.Tensor, inputs: LayerInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over the content x [B, L, H] and the state [B, Lq, H] -> (x', state'); x' must be what
        layer(x, inputs.bias, rope=inputs.rope) gives, with the same ops in the same order (dropout's RNG)."""
        ...


@dataclass
class QueryStream:
    """Two-stream attention (XLNet): the query stream g [B, Lq, H] runs through the same layers as the content
    stream; at each layer its queries (the layer's q projection of g) attend to the content stream's keys and values
    at that layer's input, under a per-query mask. g never attends to g, and Lq may be smaller than L (PLM runs g
    only at its prediction targets). The field names are the encoder's keyword arguments of the same stream."""

    query_stream: torch.Tensor
    """[B, Lq, H] the initial state."""
    query_mask: torch.Tensor
    """[B, Lq, L] bool: the content positions each query may see."""
    query_positions: torch.Tensor | None = None
    """[B, Lq] the stream's positions: needed with RoPE (its queries turn by them) and local attention (its band)."""

    def start(self) -> torch.Tensor:
        return self.query_stream

    def window_inputs(self, encoder: BertEncoder, window: int, x: torch.Tensor) -> tuple:
        """(query bias [B, 1, Lq, L], query rope (cos, sin) [B, Lq, 1, D] or None) of `window`'s layers."""
        cfg, L = encoder.config, x.shape[1]
        if self.query_positions is None and (cfg.position_embedding == "rope" or any(encoder.windows)):
            raise ValueError(
                "position_embedding=rope or local_attention: the query stream needs query_positions [B, Lq]"
            )
        query_rope = None
        if cfg.position_embedding == "rope":
            head_dim = cfg.hidden_size // cfg.num_heads
            cos, sin = rope_tables(L, head_dim, _theta(cfg, window), x.device, x.dtype)
            query_rope = (cos[self.query_positions, None], sin[self.query_positions, None])  # [B, Lq, 1, D]
        bias = attention_bias(self.query_mask, x.dtype)
        return window_bias(bias, self.query_mask, window, L, x.device, self.query_positions), query_rope

    def layer(self, layer: EncoderLayer, x: torch.Tensor, g: torch.Tensor, inputs: LayerInputs) -> tuple:
        # x [B, L, H], g [B, Lq, H] -> both after the layer; K and V of x computed once, for both streams.
        query_bias, query_rope = inputs.stream
        attention = layer.attention
        q, k, v = attention.project(layer.attention_input(x), inputs.rope)  # [B, N, L, D] each
        a = attention.attend(q, k, v, inputs.bias)  # [B, L, H]
        a_g = attention.attend(attention.queries(layer.attention_input(g), query_rope), k, v, query_bias)  # [B, Lq, H]
        return layer.residual_ffn(x, a), layer.residual_ffn(g, a_g)


def layer_stack(
    encoder: nn.Module,
    x: torch.Tensor,
    inputs: dict[int, LayerInputs],
    packed: Packed | None,
    stream: EncoderStream | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers (+ final norm) of `encoder` (a `BertEncoder`, or ELECTRA's generator: its `config`, `layers` and
    `final_norm`) over x [B, L, H] or packed [T, H], and a second stream's state [B, Lq, H] if any; each layer with
    the inputs of its window. A plain function of the module, so that torch.compile wraps it without
    replacing the module."""
    g = None if stream is None else stream.start()
    for layer in encoder.layers:
        window = inputs[layer.attention.window]
        if stream is None:
            run, args, kwargs = layer, (x, window.bias), {"rope": window.rope, "packed": packed}
        else:
            run, args, kwargs = stream.layer, (layer, x, g, window), {}
        if encoder.config.activation_checkpointing and torch.is_grad_enabled():
            # Non-reentrant: works with kwargs and with inputs that need no grad; the RNG state is saved and
            # restored, so recomputed dropout masks are the forward's (same loss, same grads, resumable).
            out = checkpoint(run, *args, use_reentrant=False, **kwargs)
        else:
            out = run(*args, **kwargs)
        x, g = (out, None) if stream is None else out
    if encoder.final_norm is not None:
        x = encoder.final_norm(x)
        g = encoder.final_norm(g) if g is not None else None
    return x, g


def _embed(
    embeddings: Embeddings, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, positions: torch.Tensor | None
) -> torch.Tensor:
    """`Embeddings` as a plain function of the module, compiled like `layer_stack`: [B, L] -> [B, L, H], or packed
    [T] -> [T, H]."""
    return embeddings(input_ids, token_type_ids, positions)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        windows = layer_windows(cfg)
        self.windows = tuple(sorted(set(windows)))  # the distinct windows: one set of masks each per forward
        if cfg.share_layers and any(windows):
            raise ValueError("model.local_attention with share_layers: one shared layer cannot be global and local")
        if cfg.share_layers:
            # ALBERT: one layer applied num_layers times. It is registered once (state dict:
            # encoder.shared_layer.*); `layers` is a plain tuple, not a module container, so it adds no names.
            self.shared_layer = EncoderLayer(cfg)
            self.layers = (self.shared_layer,) * cfg.num_layers
        else:
            # Pre-LN's first attn_norm would re-normalise the embedding LN's output: Identity (as ModernBERT),
            # unless a projection (E != H) sits between them.
            skip_first = cfg.norm_placement == "pre" and _embedding_size(cfg) == cfg.hidden_size
            self.layers = nn.ModuleList(
                EncoderLayer(cfg, attn_norm=not (skip_first and i == 0), window=windows[i])
                for i in range(cfg.num_layers)
            )
        # Pre-LN leaves the residual stream un-normalised: one LN on the output (ModernBERT's final_norm).
        self.final_norm = make_norm(cfg, cfg.hidden_size) if cfg.norm_placement == "pre" else None

    def _head_dim(self) -> int:
        return self.config.hidden_size // self.config.num_heads

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_stream: torch.Tensor | None = None,
        query_mask: torch.Tensor | None = None,
        query_positions: torch.Tensor | None = None,
        num_tokens: int | None = None,
        *,
        stream: EncoderStream | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, L] -> hidden states [B, L, H]. attention_mask: [B, L] or per-query [B, L, L].
        With a second stream (`EncoderStream`), returns (content [B, L, H], its final state [B, Lq, H]).
        query_stream [B, Lq, H], query_mask [B, Lq, L] and query_positions [B, Lq] are the same as
        stream=QueryStream(query_stream, query_mask, query_positions).
        With config.unpadded and a [B, L] key mask, the layers run on the real tokens only; the result is
        re-padded with zeros at padding (the padded path leaves values there that nothing should read).
        num_tokens: the real tokens of the batch when the caller knows them (`Packed.from_mask`)."""
        if query_stream is not None:
            stream = QueryStream(query_stream, query_mask, query_positions)
        cfg = self.config
        packed = None
        if cfg.unpadded and stream is None and attention_mask is not None and attention_mask.dim() == 2:
            packed = Packed.from_mask(attention_mask, self.embeddings.word_embeddings.weight.dtype, num_tokens)
        if packed is not None:
            return self._forward_packed(packed, input_ids, token_type_ids)
        x = compiled(_embed, cfg)(self.embeddings, input_ids, token_type_ids, None)
        inputs = self._padded_inputs(x, attention_mask, stream)
        stack = compiled(layer_stack, cfg)
        if stream is None:
            return stack(self, x, inputs, None)[0]
        return stack(self, x, inputs, None, stream)

    def _forward_packed(
        self, packed: Packed, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """The layers over the real tokens only ([T, H]), re-padded to [B, L, H]. T changes from batch to batch: the
        compiled graphs are dynamic in it from the first (`compiled`'s varying)."""
        cfg = self.config
        positions = packed.indices % packed.length  # [T]: the column, as in the padded path
        ids, types = packed.gather(input_ids), None if token_type_ids is None else packed.gather(token_type_ids)
        x = compiled(_embed, cfg, varying=(ids, types, positions))(self.embeddings, ids, types, positions)  # [T, H]
        inputs = {}
        for w in self.windows:
            rope = None
            if cfg.position_embedding == "rope":
                cos, sin = rope_tables(packed.length, self._head_dim(), _theta(cfg, w), x.device, x.dtype)
                rope = (cos[positions, None, None], sin[positions, None, None])  # [T, 1, 1, D]
            inputs[w] = LayerInputs(packed.window_mask(w) if w else packed.attn_bias, rope)
        ropes = (t for i in inputs.values() for t in i.rope or ())
        stack = compiled(layer_stack, cfg, varying=(x, packed.indices, packed.attn_indices, *ropes))
        x, _ = stack(self, x, inputs, packed)
        return packed.repad(x)

    def _padded_inputs(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        stream: EncoderStream | None,
    ) -> dict[int, LayerInputs]:
        extra = None if stream is None else (lambda w: stream.window_inputs(self, w, x))
        return padded_layer_inputs(self.windows, x, attention_mask, extra)


def padded_layer_inputs(
    windows: tuple[int, ...],
    x: torch.Tensor,
    attention_mask: torch.Tensor | None,
    stream_inputs: Callable[[int], object] | None = None,
) -> dict[int, LayerInputs]:
    """Each window's layer inputs over padded embeddings x [B, L, H] (attention_mask [B, L], or per query [B, L, L]):
    a stack's (`BertEncoder`, ELECTRA's generator). A local window runs by blocks where it can (a [B, L] key mask
    and no second stream); else it takes the dense band. stream_inputs(window): a second stream's extra inputs."""
    B, L = x.shape[:2]
    bias = attention_bias(attention_mask, x.dtype)
    inputs = {}
    for w in windows:
        by_blocks = w and not masks_nothing(w, L) and (attention_mask is None or attention_mask.dim() == 2)
        if stream_inputs is None and by_blocks:
            inputs[w] = LayerInputs(local_mask(attention_mask, w, L, B, x.device), None)  # by blocks if shorter
        else:
            extra = None if stream_inputs is None else stream_inputs(w)
            inputs[w] = LayerInputs(window_bias(bias, attention_mask, w, L, x.device), None, extra)
    return inputs


def window_bias(
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    window: int,
    length: int,
    device: torch.device,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The global `bias` of `mask` for a global layer, or for a window that sees every key at this length (the
    same bits as global attention); else the window's boolean mask [B or 1, 1, Lq, L] (queries at
    `query_positions` [B, Lq], default 0..length-1)."""
    if not window or masks_nothing(window, length):
        return bias
    return window_mask(mask, window, length, device, query_positions)


def init_weights(module: nn.Module, std: float) -> None:
    """BERT's initialisation: normal(0, std) weights, zero biases, unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
