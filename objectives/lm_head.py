"""The token-prediction head of every objective that predicts tokens (mlm, span, plm; rtd's generator).

dense H -> E, GELU, LayerNorm(E), then a decoder tied to the word embeddings [V, E] with its own bias [V]. `lm_head`
builds one from the model config, so that every objective honours `model.use_bias` alike: False drops the dense
and LayerNorm biases (ModernBERT's head); the decoder keeps its bias.

Export (`pretrain.hf.interop`) takes the `MLMHead` tied to the word embeddings under `heads.` as the *ForMaskedLM
head and maps it by its parameter names: `dense`, `layer_norm`, `bias` (`decoder_weight` is the word-embedding
table itself). A head that must not be exported as the model's LM head (ELECTRA's generator) subclasses
`TiedLMHead` instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class TiedLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> decoder tied to the word embeddings (+ own bias).

    The dense layer maps its input width to the embedding width E of the tied table (ALBERT's head: dense H -> E,
    LN(E), decoder E -> V); E = H unless the encoder factorizes its embeddings. `bias=False` drops the dense and
    LayerNorm biases (ModernBERT's head; the decoder keeps its own)."""

    def __init__(self, hidden_size: int, layer_norm_eps: float, word_embeddings: nn.Embedding, bias: bool = True):
        super().__init__()
        width = word_embeddings.embedding_dim  # E
        self.dense = nn.Linear(hidden_size, width, bias=bias)
        self.layer_norm = nn.LayerNorm(width, eps=layer_norm_eps, bias=bias)
        self.bias = nn.Parameter(torch.zeros(word_embeddings.num_embeddings))
        self.decoder_weight = word_embeddings.weight  # tied: the same Parameter (ZeRO-3 gathers it here too)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] -> [..., E] -> logits [..., V]
        x = self.layer_norm(F.gelu(self.dense(hidden)))
        return F.linear(x, self.decoder_weight, self.bias)


class MLMHead(TiedLMHead):
    """The LM head a *ForMaskedLM export gets (mlm's, span's `.mlm`, plm's)."""


def lm_head(
    cls: type[TiedLMHead], model_config: Any, word_embeddings: nn.Embedding, hidden_size: int = 0, **extra
) -> Any:
    """A `cls` head over inputs `hidden_size` wide (default: the model's), tied to `word_embeddings`, with the
    model's LayerNorm eps and `use_bias`; `extra` goes to a subclass's own arguments."""
    return cls(
        hidden_size or model_config.hidden_size,
        model_config.layer_norm_eps,
        word_embeddings,
        bias=getattr(model_config, "use_bias", True),
        **extra,
    )
