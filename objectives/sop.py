"""Sentence order prediction (ALBERT): are two consecutive segments of one document in order or swapped?

Label `sop_label`, as HF AlbertForPreTraining's sentence_order_label: 0 = A then B (in order),
1 = B then A (swapped). Both segments come from the same document, so topic gives nothing away.
"""

from __future__ import annotations

from dataclasses import dataclass

from objectives.base import ObjectiveOptions, option, register
from objectives.sentence_head import SentencePairObjective


@dataclass
class SOPOptions(ObjectiveOptions):
    swap_prob: float = option(0.5, "Probability that the two segments are swapped (label 1).", ge=0, le=1)


@register
class SentenceOrderPrediction(SentencePairObjective):
    name = "sop"
    Options = SOPOptions
    label_key = "sop_label"

    def choose(self, raw, rng):
        a, b = (raw["_seg_a"], raw["_seg_a_words"]), (raw["_seg_b"], raw["_seg_b_words"])
        return (b, a, 1) if rng.random() < self.options.swap_prob else (a, b, 0)
