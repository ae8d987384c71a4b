"""Next sentence prediction (BERT): is B the text that follows A, or a segment of another document?

Label `nsp_label`, as HF BertForPreTraining's next_sentence_label: 0 = B continues A, 1 = B is random.
"""

from __future__ import annotations

from dataclasses import dataclass

from objectives.base import ObjectiveOptions, option, register
from objectives.sentence_head import SentencePairObjective


@dataclass
class NSPOptions(ObjectiveOptions):
    random_next_prob: float = option(
        0.5, "Probability that B is a random segment from another document (label 1).", ge=0, le=1
    )


@register
class NextSentencePrediction(SentencePairObjective):
    name = "nsp"
    Options = NSPOptions
    label_key = "nsp_label"

    def choose(self, raw, rng):
        a = (raw["_seg_a"], raw["_seg_a_words"])
        if rng.random() < self.options.random_next_prob:
            if raw["_rand_doc"] < 0:
                raise ValueError("nsp needs at least 2 documents to draw a random next segment from")
            return a, (raw["_seg_rand"], raw["_seg_rand_words"]), 1
        return a, (raw["_seg_b"], raw["_seg_b_words"]), 0
