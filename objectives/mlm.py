"""Masked language modelling (BERT): choose 15% of non-special tokens, replace 80/10/10 [MASK]/random/same.

Options: `whole_word` chooses whole words (every token of a chosen word is predicted); `max_ngram` > 1 chooses
ALBERT n-grams of whole words with p(n) proportional to 1/n (implies whole words). The 80/10/10 replacement
stays per token in both, as in Google's whole-word-masking release: a word may come out partly [MASK].

The head projects only the chosen positions onto the vocabulary (sparse head): the dense vocabulary
projection is most of a small encoder's FLOPs, and 85% of it would be thrown away. The positions come from the
collator (`collate`: flat indices into [B * L]), so the head gathers them without a device-side nonzero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
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
from pretrain.core.measures import Mean
from pretrain.core.tokens import IGNORE_INDEX, SpecialTokens
from pretrain.model.compiling import compiled

MAX_NGRAM = 3


@dataclass
class MaskingRates(ObjectiveOptions):
    """Which tokens are chosen for prediction and what each becomes: the options `corrupt` reads (mlm, rtd)."""

    mask_prob: float = option(
        0.15, "Fraction of non-special tokens chosen for prediction.", gt=0, lt=1, schedulable=True
    )
    mask_token_prob: float = option(0.8, "Of the chosen tokens, the fraction replaced by [MASK].", ge=0, le=1)
    random_token_prob: float = option(
        0.1, "Of the chosen tokens, the fraction replaced by a random token (the rest stay unchanged).", ge=0, le=1
    )

    def check(self, where):
        check_replacement(where, self.mask_token_prob, self.random_token_prob)


@dataclass
class MLMOptions(MaskingRates):
    whole_word: bool = option(
        False, "Choose whole words (from the samples' `word_starts`) and predict all their tokens."
    )
    max_ngram: int = option(
        1,
        "> 1: choose n-grams of whole words, n in 1..max_ngram with p(n) proportional to 1/n (ALBERT).",
        ge=1,
        le=MAX_NGRAM,
    )

    @property
    def word_level(self) -> bool:
        return self.whole_word or self.max_ngram > 1


def choose_positions(candidates: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Pick round(rate * len(candidates)) (at least 1) of the candidate positions, sorted."""
    if len(candidates) == 0:
        return candidates
    k = max(1, int(round(rate * len(candidates))))
    return np.sort(rng.choice(candidates, size=k, replace=False))


def corrupt(
    input_ids: np.ndarray, positions: np.ndarray, opts: MaskingRates, tokens: SpecialTokens, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Replace `positions` 80/10/10 and return (corrupted ids [L], labels [L] with -100 elsewhere)."""
    labels = np.full_like(input_ids, IGNORE_INDEX)
    labels[positions] = input_ids[positions]
    u = rng.random(len(positions))  # [M] one draw per token: each token's fate is independent
    return replace_tokens(input_ids, positions, u, opts.mask_token_prob, opts.random_token_prob, tokens, rng), labels


def candidate_positions(sample: dict[str, np.ndarray], tokens: SpecialTokens) -> np.ndarray:
    """Positions that may be masked: never special tokens, never padding."""
    return np.flatnonzero(~ineligible_tokens(sample, tokens))


def _token_loss(
    head: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy summed over targets [M], how many the argmax gets right) of the head on the rows `positions`
    (flat indices into [B * L]) of hidden [B, L, H]. A plain function, compiled with the model."""
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)  # [M, H]
    return summed_ce_and_correct(head(rows).float(), targets)  # logits [M, V]


def token_predictions(
    model: nn.Module,
    head: nn.Module,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    weight: float,
) -> tuple[torch.Tensor, torch.Tensor, Mean, Mean]:
    """`head` of `model` on the rows `positions` of hidden [B, L, H] (flat indices into [B * L]) against `targets`
    [M]: (cross-entropy summed over the targets times `weight`, its sum, accuracy, mean cross-entropy). With no
    target the loss is a zero still connected to the graph, so every rank runs the same backward. M changes from
    batch to batch: a compiled model's graph is dynamic in it."""
    run = compiled(_token_loss, model.config, varying=(positions, targets))
    ce_sum, correct = run(head, hidden, positions, targets)
    n = targets.shape[0]  # a shape: known on the host
    return ce_sum * weight, ce_sum.detach(), Mean(correct, n), Mean(ce_sum.detach(), n)


@register
class MaskedLM(Objective):
    name = "mlm"
    Options = MLMOptions
    rewrites_inputs = True
    pad_values = {"mlm_labels": IGNORE_INDEX}

    def __init__(self, options, tokens):
        super().__init__(options, tokens)
        self.lengths = SpanLengths.ngram(options.max_ngram)  # [1.0] for single whole words

    def prepare(self, sample, rng):
        if self.options.word_level:
            spans = select_word_spans(
                sample_word_starts(sample),
                ineligible_tokens(sample, self.tokens),
                self.options.mask_prob,
                self.lengths,
                rng,
            )
            positions, _ = spans.positions()  # [M] every token of every chosen word
        else:
            positions = choose_positions(candidate_positions(sample, self.tokens), self.options.mask_prob, rng)
        sample["input_ids"], sample["mlm_labels"] = corrupt(
            sample["input_ids"], positions, self.options, self.tokens, rng
        )
        return sample

    def collate(self, arrays):
        positions, targets = flat_targets(arrays["mlm_labels"])
        return {"mlm_positions": positions, "mlm_targets": targets}

    def target_counts(self, arrays):
        return {self.name: len(arrays["mlm_positions"])}

    def build_head(self, model_config, encoder):
        return lm_head(MLMHead, model_config, encoder.embeddings.word_embeddings)

    def loss(self, batch, forward, model, weights):
        loss, _, accuracy, ce = token_predictions(
            model,
            model.heads[self.name],
            forward.hidden,
            batch["mlm_positions"],
            batch["mlm_targets"],
            weights(self.name),
        )
        return ObjectiveOutput(loss, {"loss": ce, "accuracy": accuracy})
