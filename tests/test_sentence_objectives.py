"""Segment pairs (data_pipeline.pairs) and the NSP / SOP objectives, on a real tiny tokenized corpus."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from data_pipeline.loader import Collator, PretrainDataset, sample_rng
from data_pipeline.pairs import SegmentPairs
from data_pipeline.samples import build_samples
from data_pipeline.shards import ShardSet, build_shards
from data_pipeline.tokenizer import load_tokenizer, special_tokens, train_tokenizer
from objectives import build_objectives, sample_builder_for, validate_objectives
from objectives.sentence_head import assemble_pair, truncated_lengths
from pretrain.core.errors import ConfigError
from pretrain.core.tokens import IGNORE_INDEX

MAX_LEN = 48
WORDS = (
    "nation people congress freedom budget treaty citizens liberty harbor territory defense courts "
    "economy workers farmers schools science peace war history future government promise duty"
).split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Documents of 2-12 sentences of 3-14 words; every 20th has a single sentence."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        k = 1 if i % 20 == 7 else rng.randint(2, 12)
        sents = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))).capitalize() + rng.choice(".!?")
            for _ in range(k)
        ]
        docs.append(" ".join(sents))
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairs")
    path = d / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_docs(200)))
    train_tokenizer([str(path)], d / "tok", vocab_size=120, show_progress=False)
    build_shards([str(path)], d / "tok", d / "shards", num_workers=0, docs_per_shard=60, show_progress=False)
    shards = ShardSet(d / "shards")
    tokens = special_tokens(load_tokenizer(d / "tok"))
    return shards, tokens


@pytest.fixture(scope="module")
def pairs(corpus):
    shards, tokens = corpus
    return SegmentPairs(shards, MAX_LEN, tokens, seed=3)


def windows(x: np.ndarray, whole: np.ndarray) -> bool:
    """Whether x is a contiguous window of `whole`."""
    if len(x) > len(whole):
        return False
    return bool((np.lib.stride_tricks.sliding_window_view(whole, len(x)) == x).all(1).any()) if len(x) else True


def split_input(s, tokens):
    """(A, B) token ids of an assembled [CLS] A [SEP] B [SEP] sample."""
    ids = s["input_ids"]
    sep = int(np.flatnonzero(ids == tokens.sep)[0])
    return ids[1:sep], ids[sep + 1 : -1]


def prepared(objective, pairs, n):
    """n (raw, prepared) samples over successive epochs, rng as the loader derives it."""
    out = []
    for k in range(n):
        epoch, index = divmod(k, len(pairs))
        rng = sample_rng(pairs.seed, epoch, index)
        raw = pairs.sample(index, rng)
        out.append((dict(raw), objective.prepare(dict(raw), rng)))
    return out


# ---------------------------------------------------------------------------------------------- index


def test_index_tiles_documents_and_respects_targets(corpus, pairs):
    shards, _ = corpus
    sent = shards.sent_offsets()
    assert len(pairs) > 150 and pairs.first.dtype == np.int64 and pairs.doc.dtype == np.int32
    for d in range(shards.num_docs):
        mine = np.flatnonzero(pairs.doc == d)
        n_sent = len(shards.doc_sentence_offsets(d)) - 1
        if n_sent == 1:  # a random segment only: no pair of its own
            assert mine.size == 0
            continue
        first, end = pairs.first[mine], pairs.end[mine]
        # chunks cover the document's sentences exactly, in order
        s0 = int(np.searchsorted(sent, shards.doc_offsets()[d]))
        assert first[0] == s0 and end[-1] == s0 + n_sent and np.array_equal(first[1:], end[:-1])
        sizes = end - first
        assert (sizes >= 2).all()
        # greedy: a chunk minus its last sentence was under target (unless it had only its 2 minimum)
        under = sent[end - 1] - sent[first] < pairs.target[mine]
        assert (under | (sizes <= 2) | (end == s0 + n_sent)).all()


def test_short_targets_about_ten_percent(corpus):
    shards, tokens = corpus
    targets = np.concatenate([SegmentPairs(shards, MAX_LEN, tokens, seed=s).target for s in range(12)])
    short = targets < MAX_LEN - 3
    assert len(targets) > 2000 and abs(short.mean() - 0.1) < 0.025, short.mean()
    assert targets.min() >= 2 and targets.max() == MAX_LEN - 3
    # index depends on the seed only
    assert np.array_equal(
        SegmentPairs(shards, MAX_LEN, tokens, seed=1).first, SegmentPairs(shards, MAX_LEN, tokens, seed=1).first
    )


# ---------------------------------------------------------------------------------------------- samples


def test_raw_segments_are_consecutive_text(corpus, pairs):
    """A, B and the random segment are each consecutive text, and every B (true or random) starts a sentence: a
    single-sentence document split at a word gave a true B starting mid-sentence, which a random B never does, so
    the NSP label (and SOP's, by where the full stop fell) could be read off the text."""
    shards, _ = corpus
    single = 0
    for index in range(len(pairs)):
        raw = pairs.sample(index, sample_rng(0, 0, index))
        doc = shards.doc_tokens(raw["_doc"]).astype(np.int64)
        assert len(raw["_seg_a"]) >= 1 and len(raw["_seg_b"]) >= 1
        assert np.array_equal(raw["_seg_a"], doc[raw["_a_start"] : raw["_b_start"]])
        assert np.array_equal(raw["_seg_b"], doc[raw["_b_start"] : raw["_b_end"]])
        assert np.array_equal(raw["_seg_b_words"], shards.doc_word_starts(raw["_doc"])[raw["_b_start"] : raw["_b_end"]])
        sents = shards.doc_sentence_offsets(raw["_doc"])
        assert len(sents) > 2 and raw["_b_start"] in sents  # split at a sentence boundary
        single += len(shards.doc_sentence_offsets(raw["_rand_doc"])) == 2
        assert raw["_rand_doc"] != raw["_doc"]
        other = shards.doc_tokens(raw["_rand_doc"]).astype(np.int64)
        assert np.array_equal(raw["_seg_rand"], other[raw["_rand_start"] : raw["_rand_end"]])
        assert raw["_rand_start"] in shards.doc_sentence_offsets(raw["_rand_doc"])
    assert single >= 2  # single-sentence documents are random segments


def test_assemble_pair_layout_and_bert_truncation():
    tokens = type("T", (), {"cls": 2, "sep": 3})
    rng = np.random.default_rng(0)

    def reference(la, lb, m):  # BERT's truncate_seq_pair, lengths only
        while la + lb > m:
            if la > lb:
                la -= 1
            else:
                lb -= 1
        return la, lb

    for la in range(1, 30):
        for lb in range(1, 30):
            assert truncated_lengths(la, lb, 17) == reference(la, lb, 17)
    a, b = np.arange(100, 140), np.arange(200, 207)
    s = assemble_pair(a, b, np.ones(40, bool), np.zeros(7, bool), tokens, 20, rng)
    ids = s["input_ids"]
    # 17 tokens of room: B (7) is shorter, so A alone is trimmed 40 -> 10
    assert len(ids) == 20 and ids[0] == 2 and ids[11] == 3 and ids[-1] == 3
    assert np.array_equal(ids[12:-1], b) and windows(ids[1:11], a)
    assert (s["token_type_ids"][:12] == 0).all() and (s["token_type_ids"][12:] == 1).all()
    assert np.flatnonzero(s["special_mask"]).tolist() == [0, 11, 19]
    assert s["word_starts"][12] and not s["word_starts"][13]  # a segment's first token starts a word
    # removed tokens come off both ends
    fronts = [
        assemble_pair(a, b, np.ones(40, bool), np.ones(7, bool), tokens, 20, rng)["input_ids"][1] - 100
        for _ in range(400)
    ]
    assert 14 < np.mean(fronts) < 16  # Binomial(30, 1/2): mean 15


# ---------------------------------------------------------------------------------------------- NSP / SOP


def check_structure(s, tokens, label_key):
    ids, tt = s["input_ids"], s["token_type_ids"]
    assert len(ids) <= MAX_LEN and ids[0] == tokens.cls and ids[-1] == tokens.sep
    seps = np.flatnonzero(ids == tokens.sep)
    assert len(seps) == 2 and np.flatnonzero(s["special_mask"]).tolist() == [0, seps[0], len(ids) - 1]
    assert (tt[: seps[0] + 1] == 0).all() and (tt[seps[0] + 1 :] == 1).all()
    assert s[label_key].shape == () and s[label_key].dtype == np.int64
    assert not any(k.startswith("_") for k in s)


def test_nsp_labels_balanced_and_segments_true(corpus, pairs):
    shards, tokens = corpus
    (nsp,) = build_objectives({"nsp": {}}, tokens)
    samples = prepared(nsp, pairs, 2400)
    labels = np.array([s["nsp_label"] for _, s in samples])
    assert abs(labels.mean() - 0.5) < 0.03, labels.mean()
    for raw, s in samples[:600]:
        check_structure(s, tokens, "nsp_label")
        a, b = split_input(s, tokens)
        doc = shards.doc_tokens(raw["_doc"]).astype(np.int64)
        if s["nsp_label"] == 0:  # B is the text right after A in the document
            if len(raw["_seg_a"]) + len(raw["_seg_b"]) <= MAX_LEN - 3:
                assert np.array_equal(np.concatenate([a, b]), doc[raw["_a_start"] : raw["_b_end"]])
            assert windows(a, doc[raw["_a_start"] : raw["_b_start"]]) and windows(
                b, doc[raw["_b_start"] : raw["_b_end"]]
            )
        else:  # B comes from another document
            assert raw["_rand_doc"] != raw["_doc"]
            other = shards.doc_tokens(raw["_rand_doc"]).astype(np.int64)
            assert windows(b, other[raw["_rand_start"] : raw["_rand_end"]])


def test_sop_swaps_recoverable_and_balanced(corpus, pairs):
    shards, tokens = corpus
    (sop,) = build_objectives({"sop": {}}, tokens)
    samples = prepared(sop, pairs, 2400)
    labels = np.array([s["sop_label"] for _, s in samples])
    assert abs(labels.mean() - 0.5) < 0.03, labels.mean()
    for raw, s in samples[:600]:
        check_structure(s, tokens, "sop_label")
        first, second = split_input(s, tokens)
        doc = shards.doc_tokens(raw["_doc"]).astype(np.int64)
        early, late = doc[raw["_a_start"] : raw["_b_start"]], doc[raw["_b_start"] : raw["_b_end"]]
        if s["sop_label"] == 1:  # [CLS] B [SEP] A [SEP]: the later text first
            first, second = second, first
        assert windows(first, early) and windows(second, late)
        if len(early) + len(late) <= MAX_LEN - 3:
            assert np.array_equal(np.concatenate([first, second]), doc[raw["_a_start"] : raw["_b_end"]])


def test_samples_deterministic_per_seed_epoch_index(corpus, pairs):
    _, tokens = corpus
    objectives = build_objectives({"mlm": {}, "nsp": {}}, tokens)
    ds = PretrainDataset(pairs, objectives, seed=5)
    a, b = ds[17], ds[17]
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    raw = pairs.sample(4, sample_rng(5, 0, 4))
    assert all(np.array_equal(raw[k], v) for k, v in pairs.sample(4, sample_rng(5, 0, 4)).items())
    # a new epoch draws a new split / partner for the same chunks
    other = [ds[len(pairs) + i] for i in range(40)]
    this = [ds[i] for i in range(40)]
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(this, other))


# ---------------------------------------------------------------------------------------------- composition


def test_composition_with_mlm(corpus, pairs):
    shards, tokens = corpus
    objectives = build_objectives({"mlm": {}, "nsp": {}}, tokens)
    assert [o.name for o in objectives] == ["nsp", "mlm"]
    assert sample_builder_for(objectives) == "pairs"
    assert isinstance(build_samples("pairs", shards, MAX_LEN, tokens, 3), SegmentPairs)
    ds = PretrainDataset(pairs, objectives, seed=3)
    chosen = 0
    for i in range(200):
        s = ds[i]
        special = s["special_mask"]
        assert (s["mlm_labels"][special] == IGNORE_INDEX).all()
        assert s["input_ids"][special].tolist() == [tokens.cls, tokens.sep, tokens.sep]  # never corrupted
        chosen += (s["mlm_labels"] != IGNORE_INDEX).sum()
    assert chosen > 0


def test_nsp_and_sop_together_rejected():
    with pytest.raises(ConfigError, match="nsp and sop both build segment pairs; choose one"):
        validate_objectives({"nsp": {}, "sop": {}})
    with pytest.raises(ConfigError, match="random_next_prob"):
        validate_objectives({"nsp": {"random_next_prob": 1.5}})


@pytest.mark.parametrize("name", ["nsp", "sop"])
def test_model_forward_backward(corpus, pairs, name):
    from pretrain.core.config import ModelConfig
    from pretrain.model.pretraining import PretrainingModel

    _, tokens = corpus
    torch.manual_seed(0)
    objectives = build_objectives({"mlm": {}, name: {}}, tokens)
    cfg = ModelConfig(
        vocab_size=tokens.vocab_size,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=MAX_LEN,
    )
    model = PretrainingModel(cfg, objectives)
    ds = PretrainDataset(pairs, objectives, seed=0)
    batch = Collator(tokens.pad, objectives)([ds[i] for i in range(8)])
    assert batch[f"{name}_label"].shape == (8,) and batch[f"{name}_label"].dtype == torch.int64
    loss, metrics = model(batch)
    loss.backward()
    assert torch.isfinite(loss) and {f"{name}/loss", f"{name}/accuracy", "mlm/loss"} <= set(metrics)
    assert 0.0 <= metrics[f"{name}/accuracy"].value() <= 1.0
    head = model.heads[name]  # names export maps to bert.pooler.dense / cls.seq_relationship
    assert head.pooler.dense.weight.shape == (32, 32) and head.classifier.weight.shape == (2, 32)
    assert head.pooler.dense.weight.grad.abs().sum() > 0 and head.classifier.weight.grad.abs().sum() > 0
