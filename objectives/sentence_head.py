"""What NSP and SOP share: a [CLS] pooler + 2-way classifier head, its loss, and pair assembly.

A subclass only says which (first, second, label) to build from a `SegmentPairs` sample (`choose`).
Submodule names match HF so export can map them: `pooler.dense` -> bert.pooler.dense, `classifier` ->
cls.seq_relationship (BertForPreTraining) or sop_classifier.classifier (AlbertForPreTraining).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from objectives.base import Objective, ObjectiveOutput, summed_ce_and_correct
from pretrain.core.measures import Mean
from pretrain.model.compiling import compiled


def pop_raw(sample: dict) -> dict:
    """Remove and return the raw "_" keys of a `SegmentPairs` sample (see the module docstring)."""
    return {k: sample.pop(k) for k in [k for k in sample if k.startswith("_")]}


def truncated_lengths(len_a: int, len_b: int, max_tokens: int) -> tuple[int, int]:
    """Lengths BERT's truncate_seq_pair leaves: trim the longer segment (B on a tie) one token at a time."""
    if len_a + len_b <= max_tokens:
        return len_a, len_b
    keep_a = min(len_a, max((max_tokens + 1) // 2, max_tokens - len_b))
    return keep_a, max_tokens - keep_a


def assemble_pair(
    a: np.ndarray,
    b: np.ndarray,
    a_words: np.ndarray,
    b_words: np.ndarray,
    tokens,
    max_seq_len: int,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """[CLS] A [SEP] B [SEP] as a sample dict (same arrays as PackedSequences), truncated to max_seq_len.

    Like truncate_seq_pair, each removed token comes off the front or the back with probability 1/2
    (so the front share is Binomial(removed, 1/2)); the loop is replaced by one draw per segment.
    """
    keep_a, keep_b = truncated_lengths(len(a), len(b), max_seq_len - 3)
    parts = []
    for seg, words, keep in ((a, a_words, keep_a), (b, b_words, keep_b)):
        front = int(rng.binomial(len(seg) - keep, 0.5)) if keep < len(seg) else 0
        w = words[front : front + keep].copy()
        w[:1] = True  # a truncated segment may start mid-word; treat its first token as a word start
        parts.append((seg[front : front + keep], w))
    (a, a_words), (b, b_words) = parts
    n = len(a) + len(b) + 3
    input_ids = np.empty(n, np.int64)  # [n]
    input_ids[0], input_ids[1 : len(a) + 1], input_ids[len(a) + 1] = tokens.cls, a, tokens.sep
    input_ids[len(a) + 2 : -1], input_ids[-1] = b, tokens.sep
    special = np.zeros(n, bool)  # [n] CLS and both SEPs
    special[[0, len(a) + 1, n - 1]] = True
    word_starts = special.copy()  # [n] specials count as word starts
    word_starts[1 : len(a) + 1], word_starts[len(a) + 2 : -1] = a_words, b_words
    token_type_ids = np.zeros(n, np.int64)  # [n] 0: CLS A SEP, 1: B SEP
    token_type_ids[len(a) + 2 :] = 1
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "word_starts": word_starts,
        "special_mask": special,
    }


class Pooler(nn.Module):
    """BERT's pooler: tanh(dense(hidden of [CLS]))."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, L, H] -> [B, H]
        return torch.tanh(self.dense(hidden[:, 0]))


class SentencePairHead(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.pooler = Pooler(hidden_size)
        self.classifier = nn.Linear(hidden_size, 2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, L, H] -> logits [B, 2]
        return self.classifier(self.pooler(hidden))


class SentencePairObjective(Objective):
    """Base of the pair objectives (not registered): one 0-d int64 label per sample under `label_key`."""

    sample_builder = "pairs"
    label_key: str

    def choose(self, raw: dict, rng: np.random.Generator) -> tuple[tuple, tuple, int]:
        """((ids, word_starts) of the first segment, same of the second, label) from `raw`."""
        raise NotImplementedError

    def prepare(self, sample, rng):
        raw = pop_raw(sample)  # the "_" keys of SegmentPairs: none may reach collate
        (a, a_words), (b, b_words), label = self.choose(raw, rng)
        sample.update(assemble_pair(a, b, a_words, b_words, self.tokens, raw["_max_seq_len"], rng))
        sample[self.label_key] = np.array(label, np.int64)  # 0-d: collate stacks it to [B]
        return sample

    def build_head(self, model_config, encoder):
        return SentencePairHead(model_config.hidden_size)

    def target_counts(self, arrays):
        return {self.name: len(arrays[self.label_key])}  # one label per row

    def loss(self, batch, forward, model, weights):
        labels = batch[self.label_key]  # [B]
        ce_sum, correct = compiled(_pair_loss, model.config)(model.heads[self.name], forward.hidden, labels)
        n = labels.shape[0]
        return ObjectiveOutput(
            ce_sum * weights(self.name), {"loss": Mean(ce_sum.detach(), n), "accuracy": Mean(correct, n)}
        )


def _pair_loss(head: SentencePairHead, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy summed over the rows, argmax right) of the pair head's logits [B, 2] over hidden [B, L, H]
    against labels [B]. A plain function, compiled with the model."""
    return summed_ce_and_correct(head(hidden).float(), labels)  # logits [B, 2]
