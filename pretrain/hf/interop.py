"""HuggingFace interop, both ways: what consumers call, each a look-up in the architecture registry
(`pretrain.hf.architectures`: one record per HF architecture with its weight table, configs both ways, tied keys,
prefix, fix-ups, classes and verification).

Export dispatch (`select_architecture`), from the model options and the run's heads: the architecture that claims
the model (electra an rtd run; modernbert pre-LN + RoPE + GeGLU + no biases; albert factorized embeddings or shared
layers), else bert; roberta on request (--arch). Any other mix of options (pre-LN with learned positions, RoPE with
post-LN, local attention outside ModernBERT, ...) has no HF class that computes the same function: `UserError`
naming the option and the architectures that exist.

Import (`model.init_from`) lives in `pretrain.hf.init_from`, uploads in `pretrain.hf.hub`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pretrain.hf.architectures import Target, get, names
from pretrain.hf.architectures.base import Link, Table, factorized, lm_head_name, select_architecture
from pretrain.hf.architectures.bert import BERT_OPTIONS, bert_body, roberta_offset
from pretrain.hf.architectures.electra import (
    electra_discriminator_table,
    electra_generator_as_mlm_table,
    generator_table,
)
from pretrain.hf.architectures.modernbert import MODERNBERT_OPTIONS, modernbert_tied
from pretrain.hf.architectures.weights import fill_aliases, from_hf, from_hf_state_dict, to_hf, to_hf_state_dict

__all__ = [
    "BERT_OPTIONS",
    "MODERNBERT_OPTIONS",
    "Link",
    "Table",
    "Target",
    "bert_body",
    "electra_discriminator_table",
    "electra_generator_as_mlm_table",
    "factorized",
    "fill_aliases",
    "from_hf",
    "from_hf_state_dict",
    "generator_table",
    "hf_config",
    "lm_head_name",
    "modernbert_tied",
    "names",
    "roberta_offset",
    "select_architecture",
    "table",
    "to_hf",
    "to_hf_state_dict",
]


def table(model: nn.Module, arch: str) -> Table:
    """`arch`'s weight table for our model."""
    return get(arch).table(model)


def hf_config(model: nn.Module, target: Target, tokens) -> Any:
    """The transformers config object `target` needs for our model."""
    return get(target.arch).to_config(model, target, tokens)
