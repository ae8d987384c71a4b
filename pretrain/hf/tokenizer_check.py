"""The exported tokenizer encodes a sentence pair as pretraining did.

transformers runs a pair task on whatever the tokenizer returns. A BERT-family export (bert, albert, electra: segment
embeddings) must return the ids and token types our NSP/SOP samples have (`objectives.sentence_head.assemble_pair`:
[CLS] A [SEP] B [SEP], types 0 then 1); without token_type_ids the model would read B as type 0. RoBERTa and
ModernBERT exports return no token types, as transformers' own tokenizers for them
(`data_pipeline.tokenizer.takes_token_types`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from data_pipeline.tokenizer import TOKEN_TYPE_ARCHS, takes_token_types
from pretrain.hf.export import ExportError

PAIR = ("The first sentence of a pair, with a comma.", "And a second one that follows it!")


def check_pair_encoding(export_dir: str | os.PathLike, pair: tuple[str, str] = PAIR) -> None:
    """Load `export_dir` (and its generator/, for ELECTRA) with AutoTokenizer, encode `pair`, and raise ExportError
    unless the ids and token_type_ids are those of our pipeline's pair sample for the same two segments, or, for an
    architecture without token types, unless no token_type_ids come back."""
    root = Path(export_dir)
    for directory in (root, root / "generator"):
        if directory == root or (directory / "config.json").is_file():
            _check_one(directory, pair)


def _check_one(directory: Path, pair: tuple[str, str]) -> None:
    from transformers import AutoTokenizer

    from objectives.sentence_head import assemble_pair

    try:
        config = json.loads((directory / "config.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as err:
        raise ExportError(f"{directory}: cannot load the exported config or tokenizer ({err})") from err
    model_type = config.get("model_type")
    types_wanted = takes_token_types(model_type, config.get("type_vocab_size", 2))
    got = tokenizer(*pair)
    if not types_wanted:
        if "token_type_ids" in got:
            raise ExportError(
                f"{directory}: the tokenizer returns token_type_ids for a {model_type} model with "
                f"type_vocab_size={config.get('type_vocab_size')}: tokenizer_config.json's model_input_names "
                f"should leave them out"
            )
        if model_type not in TOKEN_TYPE_ARCHS:
            return  # RoBERTa / ModernBERT conventions: the separators are the tokenizer's own business
    a, b = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in pair)
    if not a or not b:
        raise ExportError(f"{directory}: the tokenizer encodes {pair} as {a} and {b}: a segment with no tokens")
    tokens = SimpleNamespace(cls=tokenizer.cls_token_id, sep=tokenizer.sep_token_id)
    words = (np.ones(len(a), bool), np.ones(len(b), bool))  # word starts do not affect ids or types
    ours = assemble_pair(np.array(a), np.array(b), *words, tokens, len(a) + len(b) + 3, np.random.default_rng(0))
    expected = {"input_ids": ours["input_ids"].tolist()}
    if types_wanted:
        expected["token_type_ids"] = ours["token_type_ids"].tolist()
    for key, value in expected.items():
        if got.get(key) != value:
            raise ExportError(
                f"{directory}: the exported tokenizer encodes the pair {pair} with {key} {got.get(key)}; "
                f"pretraining built {value} ([CLS] A [SEP] B [SEP], types 0 then 1; see tokenizer_config.json's "
                "model_input_names and tokenizer.json's post_processor)"
            )
