"""A BERT encoder (post-LN, learned absolute positions, token types, GELU) on PyTorch SDPA.

Shapes: B = batch, L = sequence length, H = hidden size, N = heads, D = H / N, I = intermediate size.
Weight names are ours (fused qkv projection); `pretrain.export` maps them to each HF architecture.

Two-stream attention (XLNet, used by objectives.plm): besides the content stream h [B, L, H], the encoder can
carry a query stream g [B, Lq, H] through the SAME layers. At each layer g's queries attend to the content
stream's keys/values at that layer's input, under a per-query mask; g never attends to g. Lq may be smaller
than L (PLM runs g only at its prediction targets). Without a query stream nothing changes: same ops, same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        # input_ids, token_type_ids: [B, L] -> [B, L, H]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.layer_norm(x))

    def query_stream(self, word: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """Initial query stream: a content-free vector `word` [H] in place of the word embedding, plus the
        position and type embeddings of `positions`, normalised like the content embeddings.
        word [H], positions / token_type_ids [B, Lq] -> [B, Lq, H]."""
        x = word + self.position_embeddings(positions) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.layer_norm(x))


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # one matmul for q, k, v
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_dropout

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None) -> torch.Tensor:
        # q [B, N, Lq, D], k / v [B, N, L, D] -> [B, Lq, H]
        B, N, Lq, D = q.shape
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias,
                                           dropout_p=self.dropout_p if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, Lq, N * D))

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None, query: torch.Tensor | None = None,
                query_bias: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, H] -> [B, L, H]. With a query stream `query` [B, Lq, H], also its attention output
        [B, Lq, H]: Q from `query` through the same q projection, K and V those of `x` (computed once)."""
        B, L, H = x.shape
        # [B, L, 3H] -> 3 x [B, N, L, D]
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, H // self.num_heads).permute(2, 0, 3, 1, 4)
        y = self._attend(q, k, v, attn_bias)
        if query is None:
            return y
        # Only the q third of the fused projection: [B, Lq, H] -> [B, N, Lq, D]
        q_g = F.linear(query, self.qkv.weight[:H], self.qkv.bias[:H])
        q_g = q_g.view(B, query.shape[1], self.num_heads, H // self.num_heads).transpose(1, 2)
        return y, self._attend(q_g, k, v, query_bias)


class EncoderLayer(nn.Module):
    """Post-LN block: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = SelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def _residual_ffn(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        # The block math after attention, shared by both streams: [B, *, H] -> [B, *, H]
        x = self.attn_norm(x + self.dropout(attn_out))
        return self.ffn_norm(x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(x)))))

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None, query: torch.Tensor | None = None,
                query_bias: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, H] -> [B, L, H]; with a query stream [B, Lq, H], returns (x', query')."""
        if query is None:
            return self._residual_ffn(x, self.attention(x, attn_bias))
        a, a_query = self.attention(x, attn_bias, query, query_bias)
        return self._residual_ffn(x, a), self._residual_ffn(query, a_query)


def attention_bias(attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive bias for SDPA (broadcast over heads); None when nothing is masked. Accepts a key mask
    [B, L] (1 = real token) -> [B, 1, 1, L], or a per-query mask [B, Lq, L] (True = query may attend key)
    -> [B, 1, Lq, L]. A query row with no allowed key attends uniformly (finfo.min, not -inf: no NaN)."""
    if attention_mask is None:
        return None
    bias = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    bias.masked_fill_(~attention_mask.bool(), torch.finfo(dtype).min)
    return bias[:, None, None, :] if attention_mask.dim() == 2 else bias[:, None]


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, query_stream: torch.Tensor | None = None,
                query_mask: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, L] -> hidden states [B, L, H]. attention_mask: [B, L] or per-query [B, L, L].
        Two-stream: with query_stream [B, Lq, H] (initial state) and query_mask [B, Lq, L] (which content
        positions each query may see), returns (content [B, L, H], query stream [B, Lq, H])."""
        x = self.embeddings(input_ids, token_type_ids)
        bias = attention_bias(attention_mask, x.dtype)
        if query_stream is None:
            for layer in self.layers:
                x = layer(x, bias)
            return x
        g, g_bias = query_stream, attention_bias(query_mask, x.dtype)
        for layer in self.layers:
            x, g = layer(x, bias, g, g_bias)
        return x, g


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
            nn.init.zeros_(m.bias)


class PretrainingModel(nn.Module):
    """The encoder plus one head per objective; `forward` returns the weighted total and unweighted metrics."""

    def __init__(self, cfg: ModelConfig, objectives: list):
        super().__init__()
        self.config = cfg
        self.encoder = BertEncoder(cfg)
        self.objectives = objectives  # plain list: objectives are not modules, their heads are
        self.heads = nn.ModuleDict()
        for objective in objectives:
            head = objective.build_head(cfg, self.encoder)
            if head is not None:
                self.heads[objective.name] = head
        init_weights(self, cfg.initializer_range)
        for head in self.heads.values():  # heads may have their own initialisation (e.g. tied weights)
            if hasattr(head, "reset_parameters"):
                head.reset_parameters()

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for objective in self.objectives:
            batch = objective.before_encoder(batch, self)
        # An objective may swap the [B, L] key mask for a per-query one ("content_mask" [B, L, L]), and may
        # add a query stream (plm): its final state goes to the objectives as batch["query_hidden"].
        mask = batch.get("content_mask", batch.get("attention_mask"))
        if batch.get("query_stream") is None:
            hidden = self.encoder(batch["input_ids"], batch.get("token_type_ids"), mask)
        else:
            hidden, query_hidden = self.encoder(batch["input_ids"], batch.get("token_type_ids"), mask,
                                                query_stream=batch["query_stream"], query_mask=batch["query_mask"])
            batch = {**batch, "query_hidden": query_hidden}
        total = hidden.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        for objective in self.objectives:
            out = objective.loss(batch, hidden, self)
            total = total + objective.weight * out.loss.float()
            metrics[f"{objective.name}/loss"] = out.loss.detach().float()
            for key, value in out.metrics.items():
                metrics[f"{objective.name}/{key}"] = value.detach().float()
        metrics["loss"] = total.detach()
        return total, metrics
