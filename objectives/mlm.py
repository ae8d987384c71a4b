"""Masked language modelling (BERT): choose 15% of non-special tokens, replace 80/10/10 [MASK]/random/same.

The head projects only the chosen positions onto the vocabulary (sparse head): the dense vocabulary
projection is most of a small encoder's FLOPs, and 85% of it would be thrown away.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from objectives.base import IGNORE_INDEX, Objective, ObjectiveOptions, ObjectiveOutput, SpecialTokens, register


@dataclass
class MLMOptions(ObjectiveOptions):
    mask_prob: float = 0.15
    """Fraction of non-special tokens chosen for prediction."""
    mask_token_prob: float = 0.8
    """Of the chosen tokens, the fraction replaced by [MASK]."""
    random_token_prob: float = 0.1
    """Of the chosen tokens, the fraction replaced by a random token (the rest stay unchanged)."""


def choose_positions(candidates: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Pick round(rate * len(candidates)) (at least 1) of the candidate positions, sorted."""
    if len(candidates) == 0:
        return candidates
    k = max(1, int(round(rate * len(candidates))))
    return np.sort(rng.choice(candidates, size=k, replace=False))


def corrupt(input_ids: np.ndarray, positions: np.ndarray, opts: MLMOptions, tokens: SpecialTokens,
            rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Replace `positions` 80/10/10 and return (corrupted ids [L], labels [L] with -100 elsewhere)."""
    labels = np.full_like(input_ids, IGNORE_INDEX)
    labels[positions] = input_ids[positions]
    corrupted = input_ids.copy()
    u = rng.random(len(positions))
    to_mask = positions[u < opts.mask_token_prob]
    to_random = positions[(u >= opts.mask_token_prob) & (u < opts.mask_token_prob + opts.random_token_prob)]
    corrupted[to_mask] = tokens.mask
    corrupted[to_random] = rng.choice(tokens.replaceable, size=len(to_random))
    return corrupted, labels


def candidate_positions(sample: dict[str, np.ndarray], tokens: SpecialTokens) -> np.ndarray:
    """Positions that may be masked: never special tokens, never padding."""
    ids = sample["input_ids"]
    ok = ~np.isin(ids, tokens.special_ids)
    if "special_mask" in sample:
        ok &= ~sample["special_mask"]
    return np.flatnonzero(ok)


class MLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> decoder tied to the word embeddings (+ own bias)."""

    def __init__(self, hidden_size: int, layer_norm_eps: float, word_embeddings: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.layer_norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(word_embeddings.num_embeddings))
        self.decoder_weight = word_embeddings.weight  # tied: the same Parameter (ZeRO-3 gathers it here too)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [M, H] -> logits [M, V]
        x = self.layer_norm(F.gelu(self.dense(hidden)))
        return F.linear(x, self.decoder_weight, self.bias)


def masked_lm_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> ObjectiveOutput:
    """Cross-entropy over the labelled positions only. hidden [B, L, H], labels [B, L] (-100 = ignore)."""
    selected = labels != IGNORE_INDEX  # [B, L]
    targets = labels[selected]  # [M]
    if targets.numel() == 0:  # keep the graph connected so every rank runs the same backward
        zero = hidden.sum() * 0.0
        return ObjectiveOutput(zero, {"accuracy": zero.detach()})
    logits = head(hidden[selected]).float()  # [M, V]
    loss = F.cross_entropy(logits, targets)
    accuracy = (logits.argmax(-1) == targets).float().mean()
    return ObjectiveOutput(loss, {"accuracy": accuracy})


@register
class MaskedLM(Objective):
    name = "mlm"
    Options = MLMOptions
    rewrites_inputs = True
    pad_values = {"mlm_labels": IGNORE_INDEX}

    def prepare(self, sample, rng):
        positions = choose_positions(candidate_positions(sample, self.tokens), self.options.mask_prob, rng)
        sample["input_ids"], sample["mlm_labels"] = corrupt(sample["input_ids"], positions, self.options,
                                                            self.tokens, rng)
        return sample

    def build_head(self, model_config, encoder):
        return MLMHead(model_config.hidden_size, model_config.layer_norm_eps, encoder.embeddings.word_embeddings)

    def loss(self, batch, hidden, model):
        return masked_lm_loss(model.heads[self.name], hidden, batch["mlm_labels"])
