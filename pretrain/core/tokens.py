"""Token ids every layer agrees on: the tokenizer's special tokens, and the label of a position without a target."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IGNORE_INDEX = -100
"""Label of a position that is not a target (torch's cross_entropy default ignore_index)."""


@dataclass(frozen=True)
class SpecialTokens:
    """Ids the objectives need from the tokenizer."""

    pad: int
    unk: int
    cls: int
    sep: int
    mask: int
    vocab_size: int
    """Size of the (padded) vocabulary; the model's output size."""
    replaceable: np.ndarray = field(compare=False, repr=False, default_factory=lambda: np.zeros(0, np.int64))
    """Ids a random replacement may draw: real tokens, no special or padding-filler ([unusedN]) ids."""

    @property
    def special_ids(self) -> tuple[int, ...]:
        return (self.pad, self.unk, self.cls, self.sep, self.mask)
