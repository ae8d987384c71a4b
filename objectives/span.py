"""SpanBERT: mask contiguous spans of whole words, and predict each masked token twice: from its own hidden
state (MLM) and from the span's two boundary tokens plus its position in the span (span boundary objective).

Span lengths in words are Geometric(geometric_p) truncated to 1..max_span and renormalised, as in SpanBERT.
Spans are drawn until ~mask_prob of the candidate tokens are chosen, with at least one unchosen word between
spans so both boundaries are unchosen tokens; the first and last token ([CLS], [SEP]) are never in a span, so
boundaries always exist. The 80/10/10 replacement is decided per span, as in SpanBERT: a whole span becomes
[MASK], or random tokens, or stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from objectives.base import (
    Objective,
    ObjectiveOptions,
    ObjectiveOutput,
    flat_targets,
    option,
    register,
    summed_ce_and_correct,
)
from objectives.lm_head import MLMHead, lm_head
from objectives.masking import (
    SpanLengths,
    check_replacement,
    ineligible_tokens,
    replace_tokens,
    sample_word_starts,
    select_word_spans,
)
from objectives.mlm import token_predictions
from pretrain.core.measures import Mean
from pretrain.core.tokens import IGNORE_INDEX
from pretrain.model.compiling import compiled


@dataclass
class SpanOptions(ObjectiveOptions):
    mask_prob: float = option(
        0.15, "Fraction of candidate (non-special) tokens chosen for prediction.", gt=0, lt=1, schedulable=True
    )
    geometric_p: float = option(
        0.2,
        "Span lengths in words ~ Geometric(geometric_p) on 1..max_span, renormalised (mean 3.8 at 0.2, 10).",
        gt=0,
        le=1,
    )
    max_span: int = option(10, "Longest span, in words.", ge=1)
    mask_token_prob: float = option(0.8, "Of the spans, the fraction replaced by [MASK].", ge=0, le=1)
    random_token_prob: float = option(
        0.1, "Of the spans, the fraction replaced by random tokens (the rest stay unchanged).", ge=0, le=1
    )
    sbo_weight: float = option(1.0, "Weight of the span boundary loss inside this objective's loss.", ge=0)
    position_embedding_size: int = option(
        200,
        "Relative positions (tokens from the span's start) the SBO can tell apart; later ones share the last.",
        ge=1,
    )

    def check(self, where):
        check_replacement(where, self.mask_token_prob, self.random_token_prob)


class SpanBoundaryHead(nn.Module):
    """SBO: [h_left; h_right; p_pos] -> Linear -> GELU -> LN -> Linear -> GELU -> LN -> tied decoder.

    The decoder matrix is the word embeddings (the same Parameter as the MLM head's); the SBO keeps its own
    output bias, as in SpanBERT, since the two predictions see different features. The second Linear maps to the
    embedding width E of that table (E = H unless the encoder factorizes its embeddings, as the LM head does).
    """

    def __init__(self, hidden_size: int, layer_norm_eps: float, word_embeddings: nn.Embedding, max_positions: int):
        super().__init__()
        width = word_embeddings.embedding_dim  # E
        self.position_embeddings = nn.Embedding(max_positions, hidden_size)
        self.ffn = nn.Sequential(
            nn.Linear(3 * hidden_size, hidden_size),
            nn.GELU(),
            nn.LayerNorm(hidden_size, eps=layer_norm_eps),
            nn.Linear(hidden_size, width),
            nn.GELU(),
            nn.LayerNorm(width, eps=layer_norm_eps),
        )
        self.bias = nn.Parameter(torch.zeros(word_embeddings.num_embeddings))
        self.decoder_weight = word_embeddings.weight  # tied

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)

    def forward(self, left: torch.Tensor, right: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        # left, right: [M, H] boundary hidden states; position: [M] -> [M, E] -> logits [M, V]
        x = self.ffn(torch.cat([left, right, self.position_embeddings(position)], dim=-1))
        return F.linear(x, self.decoder_weight, self.bias)


class SpanHead(nn.Module):
    """`.mlm`: the shared LM head (what a *ForMaskedLM export gets); `.sbo`: the span boundary head."""

    def __init__(self, model_config, word_embeddings: nn.Embedding, max_positions: int):
        super().__init__()
        self.mlm = lm_head(MLMHead, model_config, word_embeddings)
        self.sbo = SpanBoundaryHead(
            model_config.hidden_size, model_config.layer_norm_eps, word_embeddings, max_positions
        )

    def reset_parameters(self) -> None:
        self.mlm.reset_parameters()
        self.sbo.reset_parameters()


@register
class SpanMasking(Objective):
    name = "span"
    Options = SpanOptions
    rewrites_inputs = True
    # span_labels pads with -100 by its name; boundaries/positions of padding are never read (label -100)
    pad_values = {"span_labels": IGNORE_INDEX, "span_left": 0, "span_right": 0, "span_pos": 0}

    def __init__(self, options, tokens):
        super().__init__(options, tokens)
        self.lengths = SpanLengths.geometric(options.geometric_p, options.max_span)

    def prepare(self, sample, rng):
        o = self.options
        ids = sample["input_ids"]  # [n]
        ineligible = ineligible_tokens(sample, self.tokens)  # [n]
        ineligible[[0, -1]] = True  # so every span has a token on each side (they are [CLS] and [SEP] anyway)
        spans = select_word_spans(sample_word_starts(sample), ineligible, o.mask_prob, self.lengths, rng, separate=True)
        positions, span_of = spans.positions()  # [M], [M]
        begin = spans.begin[span_of]  # [M] first token of each target's span
        labels = np.full_like(ids, IGNORE_INDEX)
        labels[positions] = ids[positions]
        left, right, pos = np.zeros((3, len(ids)), np.int64)  # [n] each; 0 where unlabelled
        left[positions] = begin - 1  # >= 0: token 0 is never in a span
        right[positions] = spans.end[span_of]  # <= n - 1: the last token is never in a span
        pos[positions] = np.minimum(positions - begin, o.position_embedding_size - 1)
        u = rng.random(len(spans.begin))[span_of]  # [M] one draw per span: all its tokens share one fate
        sample["input_ids"] = replace_tokens(
            ids, positions, u, o.mask_token_prob, o.random_token_prob, self.tokens, rng
        )
        sample.update(span_labels=labels, span_left=left, span_right=right, span_pos=pos)
        return sample

    def collate(self, arrays):
        positions, targets = flat_targets(arrays["span_labels"])  # [M] flat into [B * L], [M]
        width = arrays["span_labels"].shape[1]
        row_start = positions - positions % width  # [M] flat index of each target's row start
        return {
            "span_positions": positions,
            "span_targets": targets,
            "span_left_at": row_start + arrays["span_left"].reshape(-1)[positions],
            "span_right_at": row_start + arrays["span_right"].reshape(-1)[positions],
            "span_pos_at": arrays["span_pos"].reshape(-1)[positions],
        }

    def target_counts(self, arrays):
        return {self.name: len(arrays["span_positions"])}

    def build_head(self, model_config, encoder):
        return SpanHead(model_config, encoder.embeddings.word_embeddings, self.options.position_embedding_size)

    def loss(self, batch, forward, model, weights):
        head, hidden = model.heads[self.name], forward.hidden  # hidden [B, L, H]
        weight = weights(self.name)  # the MLM and SBO terms share their targets
        targets = batch["span_targets"]  # [M]
        mlm_loss, mlm_sum, accuracy, mlm_ce = token_predictions(
            model, head.mlm, hidden, batch["span_positions"], targets, weight
        )
        at = batch["span_left_at"], batch["span_right_at"], batch["span_pos_at"]  # [M] each
        sbo_sum, sbo_correct = compiled(_boundary_loss, model.config, varying=(*at, targets))(
            head.sbo, hidden, *at, targets
        )
        n = targets.shape[0]
        loss = mlm_loss + self.options.sbo_weight * sbo_sum * weight
        return ObjectiveOutput(
            loss,
            {
                "loss": Mean(mlm_sum + self.options.sbo_weight * sbo_sum.detach(), n),
                "accuracy": accuracy,
                "mlm_loss": mlm_ce,
                "sbo_loss": Mean(sbo_sum.detach(), n),
                "sbo_accuracy": Mean(sbo_correct, n),
            },
        )


def _boundary_loss(
    sbo: nn.Module,
    hidden: torch.Tensor,
    left_at: torch.Tensor,
    right_at: torch.Tensor,
    pos_at: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy summed over targets [M], argmax right) of the span boundary head on each target's boundary rows
    (`left_at`, `right_at`: flat into [B * L] of hidden [B, L, H]) and its place in the span (`pos_at`). Sparse like
    the MLM head; a plain function, compiled with the model."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B * L, H]
    logits = sbo(flat.index_select(0, left_at), flat.index_select(0, right_at), pos_at).float()  # [M, V]
    return summed_ce_and_correct(logits, targets)
