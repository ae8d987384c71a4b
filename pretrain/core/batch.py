"""A collated micro-batch: tensors by name, and what is known about them on the host.

The collator (`data_pipeline.loader.Collator`) pads the samples, lets each objective add the arrays its model side
gathers with (`Objective.collate`: flat target positions, so no device-side nonzero) and count its loss terms'
targets (`Objective.target_counts`), and makes tensors. The trainer normalises losses and counts tokens with these
host numbers, so a training step reads nothing back from the device.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


class Batch:
    """Tensors by name (read like a dict; on the host until `to`), the real tokens, each loss term's number of
    targets, and whether any row is padded. Not a Mapping subclass on purpose: torch's loader rebuilds Mappings as
    plain dicts when it pins memory, which would drop the counts; it calls `pin_memory` on other objects."""

    def __init__(self, tensors: dict[str, torch.Tensor], tokens: int, counts: dict[str, int], padded: bool):
        self.tensors, self.tokens, self.counts, self.padded = tensors, tokens, counts, padded

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], objectives, padded: bool | None = None) -> Batch:
        """From padded host arrays ([B, L] per token with attention_mask, [B] per sample), after each objective
        added its arrays and counted its targets. `padded`: whether the model is given the attention mask (default:
        when a row has padding; True keeps one mask form for a compiled model)."""
        counts: dict[str, int] = {}
        for objective in objectives:
            arrays.update(objective.collate(arrays))
            counts.update(objective.target_counts(arrays))
        mask = arrays["attention_mask"]
        return cls(
            {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()},
            int(mask.sum()),
            counts,
            not bool(mask.all()) if padded is None else padded,
        )

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], objectives) -> Batch:
        """From plain tensors (padded, on any device), as the collator would make it. It reads them back to the
        host: for tools and tests, not for the training step."""
        arrays = {k: v.detach().cpu().numpy() for k, v in tensors.items()}
        arrays.setdefault("attention_mask", np.ones(arrays["input_ids"].shape, bool))
        return cls.from_arrays(arrays, objectives).to(tensors["input_ids"].device)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def get(self, key: str, default=None):
        return self.tensors.get(key, default)

    def keys(self):
        return self.tensors.keys()

    def items(self):
        return self.tensors.items()

    def _with(self, fn) -> Batch:
        return Batch({k: fn(v) for k, v in self.tensors.items()}, self.tokens, self.counts, self.padded)

    def to(self, device) -> Batch:
        return self._with(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:  # the DataLoader's pinning thread calls this on a GPU machine
        return self._with(lambda t: t.pin_memory())
