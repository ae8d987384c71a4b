"""MLM masking statistics on >= 100k tokens, determinism, and the sparse head's loss."""

import numpy as np
import pytest
import torch

from data_pipeline.loader import sample_rng
from objectives import build_objectives
from pretrain.core.tokens import IGNORE_INDEX, SpecialTokens

V = 1000
TOKENS = SpecialTokens(
    pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=V + 24, replaceable=np.arange(5, V, dtype=np.int64)
)  # ids >= V are [unused] fillers


def make_sample(rng, length=128):
    ids = rng.integers(5, V, size=length)
    ids[0], ids[-1] = TOKENS.cls, TOKENS.sep
    ids[rng.random(length) < 0.03] = TOKENS.sep  # separators inside packed sequences
    ids[rng.random(length) < 0.01] = TOKENS.unk
    special = np.isin(ids, [TOKENS.cls, TOKENS.sep])
    return {"input_ids": ids, "token_type_ids": np.zeros(length, np.int64), "special_mask": special}


def masked_corpus(n_samples=1000, seed=0):
    (mlm,) = build_objectives({"mlm": {}}, TOKENS)
    data_rng = np.random.default_rng(123)
    originals, outs = [], []
    for i in range(n_samples):
        sample = make_sample(data_rng)
        originals.append(sample["input_ids"].copy())
        outs.append(mlm.prepare(sample, sample_rng(seed, 0, i)))
    return np.concatenate(originals), {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}


def test_masking_statistics():
    original, out = masked_corpus()
    assert len(original) >= 100_000
    chosen = out["mlm_labels"] != IGNORE_INDEX
    eligible = ~np.isin(original, [TOKENS.pad, TOKENS.unk, TOKENS.cls, TOKENS.sep, TOKENS.mask])
    # nothing special or padding is ever chosen
    assert not chosen[~eligible].any()
    assert np.array_equal(out["mlm_labels"][chosen], original[chosen])
    rate = chosen.sum() / eligible.sum()
    assert abs(rate - 0.15) < 0.005, rate
    now = out["input_ids"][chosen]
    masked = (now == TOKENS.mask).mean()
    unchanged = (now == original[chosen]).mean()
    randomised = 1 - masked - unchanged
    assert abs(masked - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01 + 0.001, (masked, unchanged)
    assert abs(randomised - 0.1) < 0.011
    # random replacements are real tokens only: never special, never [unused] fillers
    assert np.isin(now[(now != TOKENS.mask) & (now != original[chosen])], TOKENS.replaceable).all()
    # positions not chosen are untouched
    assert np.array_equal(out["input_ids"][~chosen], original[~chosen])


def test_masks_are_deterministic_and_new_each_epoch():
    (mlm,) = build_objectives({"mlm": {}}, TOKENS)
    sample = make_sample(np.random.default_rng(5))
    a = mlm.prepare(dict(sample), sample_rng(7, 0, 42))
    b = mlm.prepare(dict(sample), sample_rng(7, 0, 42))
    c = mlm.prepare(dict(sample), sample_rng(7, 1, 42))
    assert np.array_equal(a["mlm_labels"], b["mlm_labels"]) and np.array_equal(a["input_ids"], b["input_ids"])
    assert not np.array_equal(a["mlm_labels"], c["mlm_labels"])


def test_configurable_rates():
    (mlm,) = build_objectives({"mlm": {"mask_prob": 0.3, "mask_token_prob": 1.0, "random_token_prob": 0.0}}, TOKENS)
    rng = np.random.default_rng(1)
    sample = make_sample(rng, 4096)
    eligible = ~sample["special_mask"] & (sample["input_ids"] != TOKENS.unk)
    out = mlm.prepare(sample, rng)
    chosen = out["mlm_labels"] != IGNORE_INDEX
    assert chosen.sum() == round(0.3 * eligible.sum())
    assert (out["input_ids"][chosen] == TOKENS.mask).all()


def test_sparse_head_loss_matches_dense():
    from pretrain.core.config import ModelConfig
    from pretrain.model.pretraining import PretrainingModel

    torch.manual_seed(0)
    objectives = build_objectives({"mlm": {}}, TOKENS)
    cfg = ModelConfig(
        vocab_size=TOKENS.vocab_size,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = PretrainingModel(cfg, objectives).eval()
    ids = torch.randint(5, V, (2, 16))
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, 3], labels[1, 7], labels[1, 9] = 10, 20, 30
    loss, metrics = model({"input_ids": ids, "mlm_labels": labels})
    hidden = model.encoder(ids)
    dense = torch.nn.functional.cross_entropy(model.heads["mlm"](hidden).flatten(0, 1), labels.flatten())
    assert loss.item() == pytest.approx(dense.item(), rel=1e-5)
    assert set(metrics) == {"loss", "mlm/loss", "mlm/accuracy"}
    # the decoder is tied to the word embeddings
    assert model.heads["mlm"].decoder_weight is model.encoder.embeddings.word_embeddings.weight
