"""Permutation language modelling (XLNet) with two-stream attention.

Each sample draws a random factorization order over its eligible tokens (mlm's candidates: never special,
padding or [UNK]) and predicts the last 1/K of it. Inputs are not corrupted; instead attention masks make
each prediction autoregressive in that order:

- content stream h (the ordinary encoder input): position i sees j iff rank[j] <= rank[i] (itself included);
- query stream g (run only at the targets): target t sees content j iff rank[j] < rank[t]. It starts from a
  learned vector w + the position and type embeddings of t, never t's word embedding, so t's own token
  cannot reach t's prediction: not through g (g never sees h_t), nor through any h_j (rank[j] < rank[t]
  means h_j never saw t either).

The paper's targets are single tokens, the tail of the order. XLNet's pretraining code differs in two ways, each
an option: `max_ngram` > 0 chooses the targets first, n-grams of 1..N whole words (p(n) ~ 1/n, its N is 5; its
released code counts an n-gram's n in tokens from a word start, which its authors call unintended), at most
ceil(m / K) tokens, and orders them after all other tokens; `bidirectional_context` lets the tokens that are not
targets see each other in full (rank -1, as specials) instead of in their order. No target ever sees itself or a
later target.

Tokens outside the order get fixed ranks:
- [SEP], [UNK] and other specials: rank -1, context visible to everyone; they see only each other (and the
  other rank -1 tokens under `bidirectional_context`), so they leak nothing.
- [CLS]: rank n (after every eligible token): it sees the whole sequence and nobody sees it. Its content
  state is therefore a full bidirectional summary, which is what a sentence-level objective run alongside
  (nsp / sop read hidden[:, 0]) needs; it is computed from permutation-masked token states, not BERT's.
- padding: PAD_RANK, and masked out as keys everywhere.

Export: the head is an `MLMHead` tied to the word embeddings (`PLMHead`), so the content encoder + head
export as `BertForMaskedLM`. Only w, which exists for the query stream, is left out. The head was trained on
query-stream states, so the export is exact but its fill-mask quality is not that of an MLM-trained model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from objectives.base import Objective, ObjectiveOptions, ObjectiveOutput, flat_targets, option, register
from objectives.lm_head import MLMHead, lm_head
from objectives.masking import SpanLengths, WordSpans, ineligible_tokens, sample_word_starts, select_word_spans
from objectives.mlm import candidate_positions, token_predictions
from pretrain.core.tokens import IGNORE_INDEX
from pretrain.model.encoder import QueryStream

CONTEXT_RANK = -1
"""Rank of specials (except [CLS]), and of the tokens that are not targets under `bidirectional_context`: visible to
every position, seeing only each other."""
PAD_RANK = np.iinfo(np.int64).max
"""Rank of padding: after everything (keys are masked by attention_mask anyway)."""


@dataclass
class PLMOptions(ObjectiveOptions):
    predict_fraction_k: int = option(
        6,
        "Predict 1/K of the m eligible tokens (XLNet's K): the last ceil(m / K) of the factorization order, or under "
        "max_ngram about m / K in whole-word n-grams, never more than ceil(m / K).",
        ge=1,
    )
    max_ngram: int = option(
        0,
        "0: the targets are single tokens, the tail of the order (the paper). N >= 1: n-grams of 1..N whole words, "
        "p(n) ~ 1/n, ordered after the other tokens (XLNet's pretraining code: N = 5).",
        ge=0,
        le=10,
    )
    bidirectional_context: bool = option(
        False,
        "The tokens that are not targets see each other in full (XLNet's pretraining code), not only those before "
        "them in the factorization order (the paper).",
    )


class PLMHead(MLMHead):
    """The shared LM head applied to the final query stream, plus w, the query stream's content-free input."""

    def __init__(
        self,
        hidden_size: int,
        layer_norm_eps: float,
        word_embeddings: nn.Embedding,
        bias: bool = True,
        std: float = 0.02,
    ):
        super().__init__(hidden_size, layer_norm_eps, word_embeddings, bias)
        self.std = std
        self.query_embedding = nn.Parameter(torch.empty(hidden_size))  # w [H]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.normal_(self.query_embedding, std=self.std)  # like a word embedding


def factorization(
    sample: dict[str, np.ndarray],
    tokens,
    k: int,
    rng: np.random.Generator,
    max_ngram: int = 0,
    bidirectional_context: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(rank [n] int64, labels [n]: the original token at targets, -100 elsewhere). See the module doc."""
    ids = sample["input_ids"]
    n = len(ids)
    eligible = candidate_positions(sample, tokens)  # [m] positions
    rank = np.full(n, CONTEXT_RANK, np.int64)
    rank[ids == tokens.cls] = n
    if max_ngram:  # whole-word n-grams first, ordered after every other eligible token
        targets = _ngram_targets(sample, tokens, k, max_ngram, math.ceil(len(eligible) / k), rng)  # [T] sorted
        others = np.setdiff1d(eligible, targets, assume_unique=True)  # [m - T]
        rank[targets] = len(others) + rng.permutation(len(targets))
        rank[others] = rng.permutation(len(others))
    else:  # the last ceil(m / K) of a permutation of all of them
        rank[eligible] = rng.permutation(len(eligible))
        is_target = rank[eligible] >= len(eligible) - math.ceil(len(eligible) / k)  # [m]
        targets, others = eligible[is_target], eligible[~is_target]
    if bidirectional_context:
        rank[others] = CONTEXT_RANK
    if len(others) == 0 and len(targets) and not (rank == CONTEXT_RANK).any():
        # the first target in the order would see no key, and a query with none attends to every key, its own
        # token's included (`attention_bias`): the pipeline's samples end with [SEP], which every target sees
        raise ValueError(
            "plm: a sample with every token a target needs a token all of them see ([SEP], as the pipeline's "
            "samples have); add one, or predict a smaller fraction (predict_fraction_k)"
        )
    labels = np.full(n, IGNORE_INDEX, np.int64)
    labels[targets] = ids[targets]
    return rank, labels


def _ngram_targets(sample, tokens, k: int, max_ngram: int, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Positions [T] sorted of whole-word n-grams, about 1/k of the eligible tokens and at most `cap`: the span draw
    meets its budget on average, its last span may pass it, and the query stream's width must not (`collate`). Random
    spans lose their last tokens until it fits, as XLNet shortens the n-gram that would pass its count."""
    words, ineligible = sample_word_starts(sample), ineligible_tokens(sample, tokens)
    spans = select_word_spans(words, ineligible, 1 / k, SpanLengths.ngram(max_ngram), rng)
    sizes = spans.end - spans.begin  # [S]
    excess = int(sizes.sum()) - cap
    for s in rng.permutation(len(sizes)) if excess > 0 else ():
        cut = min(excess, int(sizes[s]))
        sizes[s] -= cut
        excess -= cut
        if excess == 0:
            break
    return WordSpans(spans.begin, spans.begin + sizes, spans.words).positions()[0]


@register
class PermutationLM(Objective):
    name = "plm"
    Options = PLMOptions
    rewrites_inputs = True  # it owns the token-level targets: exclusive with mlm, span, rtd
    pad_values = {"plm_order": PAD_RANK, "plm_labels": IGNORE_INDEX}

    def prepare(self, sample, rng):
        o = self.options
        sample["plm_order"], sample["plm_labels"] = factorization(
            sample, self.tokens, o.predict_fraction_k, rng, o.max_ngram, o.bidirectional_context
        )
        return sample

    def collate(self, arrays):
        # The query stream runs at the targets only: a stable sort brings each row's targets first, in position
        # order. Rows with fewer than T targets are filled with other positions, left out of the loss (their flat
        # index is not in plm_query_index). T = ceil(L / K), the most targets a row of this width can have (n-gram
        # targets are capped to it too), not this batch's most: under a static width (a compiled model) the layers
        # that carry the stream keep one shape.
        labels = arrays["plm_labels"]  # [B, L]
        is_target = labels != IGNORE_INDEX
        t = max(1, -(-labels.shape[1] // self.options.predict_fraction_k), int(is_target.sum(1).max()))
        positions = np.argsort(~is_target, axis=1, kind="stable")[:, :t].astype(np.int64)  # [B, T]
        index, targets = flat_targets(np.take_along_axis(labels, positions, axis=1))  # [M] into [B * T], [M]
        return {"plm_query_positions": positions, "plm_query_index": index, "plm_query_targets": targets}

    def target_counts(self, arrays):
        return {self.name: len(arrays["plm_query_index"])}  # the query stream predicts exactly these

    def build_head(self, model_config, encoder):
        return lm_head(PLMHead, model_config, encoder.embeddings.word_embeddings, std=model_config.initializer_range)

    def before_encoder(self, batch, forward, model):
        # The content stream's masks, and the query stream (this objective's extension of the encoder) at the targets.
        rank = batch["plm_order"]  # [B, L]
        real = batch["attention_mask"]  # [B, L] bool
        positions = batch["plm_query_positions"]  # [B, T]
        forward.attention_mask = (rank[:, None, :] <= rank[:, :, None]) & real[:, None, :]  # [B, L query, L key]
        query_rank = rank.gather(1, positions)  # [B, T]
        types = forward.token_type_ids
        types = torch.zeros_like(positions) if types is None else types.gather(1, positions)
        forward.stream = QueryStream(
            query_stream=model.encoder.embeddings.query_stream(
                model.heads[self.name].query_embedding, positions, types
            ),  # [B, T, H]
            query_mask=(rank[:, None, :] < query_rank[:, :, None]) & real[:, None, :],  # [B, T, L], not itself
            query_positions=positions,  # RoPE rotates the query stream's queries by them, local attention bands them
        )

    def loss(self, batch, forward, model, weights):
        # Predictions come from the final query stream [B, T, H], never from the content stream.
        loss, _, accuracy, ce = token_predictions(
            model,
            model.heads[self.name],
            forward.stream_hidden,
            batch["plm_query_index"],
            batch["plm_query_targets"],
            weights(self.name),
        )
        return ObjectiveOutput(loss, {"loss": ce, "accuracy": accuracy})
