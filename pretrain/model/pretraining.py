"""The pretraining model: the encoder plus one head per objective, and the contract of its forward pass.

`PretrainingModel.forward(batch, loss_weights)` builds a `Forward` (the encoder's inputs), lets each objective change
it (`before_encoder`: ELECTRA's sampled tokens, PLM's masks and second stream), runs the encoder, and sums each
objective's weighted loss (`loss`), each loss term weighted per target (`LossWeights`, below). Objectives are
duck-typed here (the contract is `objectives.base.Objective`): this module imports none of them (they sit above it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pretrain.core.batch import Batch
from pretrain.core.config import ModelConfig
from pretrain.core.measures import Mean
from pretrain.model.encoder import BertEncoder, EncoderStream, init_weights


@dataclass
class Forward:
    """One forward pass: the encoder's inputs, which objectives may change before it runs, its outputs, and what each
    objective keeps between `before_encoder` and `loss` (`carry`, by objective name).

    `stream` is the extension slot of an objective that carries a second stream through the encoder's layers (an
    `EncoderStream`, e.g. PLM's `QueryStream`); its final state comes back in `stream_hidden`. The stream's own
    fields read through the forward: `forward.query_mask` is `forward.stream.query_mask`."""

    input_ids: torch.Tensor  # [B, L]
    token_type_ids: torch.Tensor | None = None  # [B, L]
    attention_mask: torch.Tensor | None = None  # [B, L] key mask (None: no padding), or per query [B, L, L]
    stream: EncoderStream | None = None  # a second stream through the same layers
    hidden: torch.Tensor | None = None  # [B, L, H] after the encoder
    stream_hidden: torch.Tensor | None = None  # [B, Lq, H] the second stream after the encoder
    carry: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # Only for names a Forward lacks: those of its stream (never dunders, which copy and pickle probe).
        stream = self.__dict__.get("stream")
        if stream is None or name.startswith("__"):
            raise AttributeError(f"'Forward' object has no attribute '{name}'")
        return getattr(stream, name)


class LossWeights:
    """Per loss term, the weight of one target's loss (see the module doc): the trainer's per-step weights where it
    gives them, else 1 / the term's targets in this micro-batch (a mean). A term with no target weighs 0."""

    def __init__(self, counts: dict[str, int], step: dict[str, float] | None = None):
        self.counts, self.step = counts, step or {}

    def __call__(self, term: str) -> float:
        if term in self.step:
            return self.step[term]
        n = self.counts.get(term, 0)
        return 1.0 / n if n else 0.0


class PretrainingModel(nn.Module):
    """The encoder plus one head per objective; `forward` returns the weighted total and unweighted metrics."""

    def __init__(self, cfg: ModelConfig, objectives: list):
        super().__init__()
        self.config = cfg
        self.encoder = BertEncoder(cfg)
        self.objectives = objectives  # plain list: objectives are not modules, their heads are
        self.heads = nn.ModuleDict()
        for objective in objectives:
            head = objective.build_head(cfg, self.encoder)
            if head is not None:
                self.heads[objective.name] = head
        init_weights(self, cfg.initializer_range)
        for head in self.heads.values():  # heads may have their own initialisation (e.g. tied weights)
            if hasattr(head, "reset_parameters"):
                head.reset_parameters()

    # The forward's own mixed precision (bf16 under `train.precision=bf16` at ZeRO-0: set by `pretrain.train.engine`).
    # It is entered here, inside DeepSpeed's engine, because DeepSpeed's forward turns off an autocast entered around
    # it unless its own `torch_autocast` section is on (0.19: runtime/torch_autocast.py): such a run computed in fp32.
    autocast_dtype: torch.dtype | None = None

    def forward(self, batch, loss_weights: dict[str, float] | None = None) -> tuple[torch.Tensor, dict]:
        """The weighted total loss and every objective's metrics (unweighted) of one micro-batch, under autocast
        to `autocast_dtype` where it is set.

        batch: a collated `pretrain.core.batch.Batch` (tensors by name, and host-side counts: real tokens and each
        loss term's targets, which size the losses with nothing read back from the device). loss_weights: the
        trainer's per-target weight of each loss term, by term (`LossWeights` above); default: a mean over this
        micro-batch."""
        if self.autocast_dtype is None:
            return self._losses(batch, loss_weights)
        with torch.autocast(batch["input_ids"].device.type, dtype=self.autocast_dtype):
            return self._losses(batch, loss_weights)

    def _losses(self, batch, loss_weights: dict[str, float] | None) -> tuple[torch.Tensor, dict]:
        if not isinstance(batch, Batch):  # plain tensors: as the collator would make them (reads them: not in training)
            batch = Batch.of(batch, self.objectives)
        forward = Forward(
            batch["input_ids"], batch.get("token_type_ids"), batch["attention_mask"] if batch.padded else None
        )
        for objective in self.objectives:  # an objective may swap inputs, masks, or add a stream (plm)
            objective.before_encoder(batch, forward, self)
        if forward.stream is None:
            forward.hidden = self.encoder(
                forward.input_ids, forward.token_type_ids, forward.attention_mask, num_tokens=batch.tokens
            )
        else:
            forward.hidden, forward.stream_hidden = self.encoder(
                forward.input_ids, forward.token_type_ids, forward.attention_mask, stream=forward.stream
            )
        weights = LossWeights(batch.counts, loss_weights)
        total = forward.hidden.new_zeros((), dtype=torch.float32)
        metrics: dict = {}
        for objective in self.objectives:
            out = objective.loss(batch, forward, self, weights)
            total = total + objective.weight * out.loss.float()
            reported = {f"{objective.name}/{k}": v for k, v in out.metrics.items()}
            metrics[f"{objective.name}/loss"] = reported.pop(
                f"{objective.name}/loss", Mean.micro_batch(out.loss.detach().float())
            )
            metrics.update(reported)
        metrics["loss"] = Mean.micro_batch(total.detach())
        return total, metrics
