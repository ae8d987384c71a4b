"""What NSP and SOP share: a [CLS] pooler + 2-way classifier head, its loss, and pair assembly.

A subclass only says which (first, second, label) to build from a `SegmentPairs` sample (`choose`).
Submodule names match HF so export can map them: `pooler.dense` -> bert.pooler.dense, `classifier` ->
cls.seq_relationship (BertForPreTraining) or sop_classifier.classifier (AlbertForPreTraining).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from data_pipeline.pairs import assemble_pair, pop_raw
from objectives.base import Objective, ObjectiveOutput
from pretrain.measures import Mean


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

    sentence_level = True
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
        logits = model.heads[self.name](forward.hidden).float()  # [B, 2]
        labels = batch[self.label_key]  # [B]
        ce_sum = F.cross_entropy(logits, labels, reduction="sum")
        n = labels.shape[0]
        return ObjectiveOutput(ce_sum * weights(self.name), {"loss": Mean(ce_sum.detach(), n),
                                                             "accuracy": Mean((logits.argmax(-1) == labels).sum(), n)})
