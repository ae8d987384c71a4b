"""Permutation LM: targets, masks, no leak of a target's own or later tokens, unchanged standard path, export."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from data_pipeline.loader import Collator
from objectives import build_objectives
from objectives.plm import PAD_RANK
from pretrain.core.config import ModelConfig
from pretrain.core.errors import ConfigError
from pretrain.core.tokens import IGNORE_INDEX, SpecialTokens
from pretrain.model.pretraining import Forward, PretrainingModel

V = 64
TOKENS = SpecialTokens(pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=V, replaceable=np.arange(5, V))
CFG = ModelConfig(
    vocab_size=V,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def make_sample(rng, length):
    ids = rng.integers(5, V, size=length)
    ids[0], ids[-1], ids[length // 2] = TOKENS.cls, TOKENS.sep, TOKENS.sep
    ids[3] = TOKENS.unk
    types = np.zeros(length, np.int64)
    types[length // 2 + 1 :] = 1
    special = np.isin(ids, [TOKENS.cls, TOKENS.sep])
    words = special | (np.arange(length) % 3 != 1)  # words of one and two tokens (no rng: the draws stay as they were)
    return {"input_ids": ids, "token_type_ids": types, "special_mask": special, "word_starts": words}


def make_batch(plm, lengths=(24, 17), seed=0):
    rng = np.random.default_rng(seed)
    samples = [plm.prepare(make_sample(rng, n), rng) for n in lengths]
    return Collator(TOKENS.pad, [plm])(samples)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = PretrainingModel(CFG, build_objectives({"plm": {}}, TOKENS))
    with torch.no_grad():  # larger than the init, so that what each position sees shows in the outputs
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m.eval()


def prepared(model, batch) -> Forward:
    """The encoder inputs PLM's before_encoder makes for `batch`."""
    forward = Forward(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    model.objectives[0].before_encoder(batch, forward, model)
    return forward


def two_stream(model, batch):
    """(content [B, L, H], query-stream logits [B, T, V], target positions [B, T]) for `batch`."""
    f = prepared(model, batch)
    h, g = model.encoder(
        f.input_ids, f.token_type_ids, f.attention_mask, query_stream=f.query_stream, query_mask=f.query_mask
    )
    return h, model.heads["plm"](g), f.query_positions


def test_targets_are_the_last_ceil_n_over_k_of_the_order():
    (plm,) = build_objectives({"plm": {"predict_fraction_k": 6}}, TOKENS)
    rng = np.random.default_rng(1)
    for length in (5, 7, 30, 128):
        sample = make_sample(rng, length)
        ids = sample["input_ids"].copy()
        out = plm.prepare(sample, rng)
        eligible = ~np.isin(ids, TOKENS.special_ids)
        n = eligible.sum()
        rank, labels = out["plm_order"], out["plm_labels"]
        assert np.array_equal(out["input_ids"], ids)  # inputs are never corrupted
        assert sorted(rank[eligible]) == list(range(n))  # a permutation of the eligible tokens
        assert (rank[ids == TOKENS.cls] == length).all() and (rank[~eligible & (ids != TOKENS.cls)] == -1).all()
        targets = labels != IGNORE_INDEX
        assert targets.sum() == math.ceil(n / 6) and not targets[~eligible].any()
        assert (rank[targets] >= n - math.ceil(n / 6)).all()  # exactly the tail of the order
        assert np.array_equal(labels[targets], ids[targets])
    batch = make_batch(plm)
    pad = ~batch["attention_mask"]
    assert pad.any() and (batch["plm_order"][pad] == PAD_RANK).all() and (batch["plm_labels"][pad] == -100).all()


def test_xlnet_code_targets_are_whole_word_ngrams_ordered_after_the_rest():
    """max_ngram = 5: the targets are n-grams of whole words, p(n) ~ 1/n, about 1/K of the eligible tokens and never
    more than ceil(m / K) (a span is cut to fit), after every other eligible token in the order;
    bidirectional_context: those others are context (rank -1)."""
    rng = np.random.default_rng(2)
    for bidirectional in (False, True):
        opts = {"predict_fraction_k": 6, "max_ngram": 5, "bidirectional_context": bidirectional}
        (plm,) = build_objectives({"plm": opts}, TOKENS)
        fractions, run_words = [], []
        for _ in range(300):
            sample = make_sample(rng, 64)
            ids, starts = sample["input_ids"].copy(), sample["word_starts"]
            out = plm.prepare(sample, rng)
            rank, targets = out["plm_order"], out["plm_labels"] != IGNORE_INDEX
            eligible = ~np.isin(ids, TOKENS.special_ids)
            assert np.array_equal(out["input_ids"], ids) and not targets[~eligible].any()
            t, m = int(targets.sum()), int(eligible.sum())
            assert t <= math.ceil(m / 6)
            word = np.cumsum(starts) - 1  # [n] word of each token
            if t < math.ceil(m / 6):  # (at the cap a span may have been cut inside a word)
                assert all(targets[word == w].all() for w in np.unique(word[targets]))  # whole words only
            assert sorted(rank[targets]) == list(range(m - t, m))  # the tail of the order
            others = rank[eligible & ~targets]
            assert (others == -1).all() if bidirectional else sorted(others) == list(range(m - t))
            fractions.append(t / m)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], targets.astype(int), [0]])))  # target runs
            run_words += [int(starts[a:b].sum()) for a, b in zip(edges[::2], edges[1::2])]
        assert 0.14 < np.mean(fractions) <= 1 / 6, np.mean(fractions)  # (cut spans take a little off 1/K)
        # p(n) ~ 1/n: 44% of the n-grams one word (merged neighbours make it 42% of the runs; uniform n: 19%)
        single = np.mean(np.array(run_words) == 1)
        assert max(run_words) >= 5 and 0.35 < single < 0.5, np.bincount(run_words)


def test_the_papers_targets_draw_as_they_always_have():
    """The default path's draws are pinned: the same seed gives the same orders and targets as before the n-gram and
    context options came (a resumed run's samples must not change under it)."""
    from objectives.plm import factorization

    rng, digest = np.random.default_rng(7), hashlib.sha256()
    for length in (9, 30, 77, 128):
        rank, labels = factorization(make_sample(rng, length), TOKENS, 6, rng)
        digest.update(rank.tobytes() + labels.tobytes())
    assert digest.hexdigest()[:16] == "3d0afeb59265ca4c"


def test_ngram_targets_keep_the_query_stream_width():
    """Under max_ngram a row never has more targets than ceil(L / K), so the query stream of every batch is
    [B, ceil(L / K)]: a compiled model keeps one shape (the span draw alone passed its budget in a quarter of rows)."""
    (plm,) = build_objectives({"plm": {"predict_fraction_k": 6, "max_ngram": 5}}, TOKENS)
    widths = {make_batch(plm, lengths=(128,) * 8, seed=seed)["plm_query_positions"].shape[1] for seed in range(20)}
    assert widths == {math.ceil(128 / 6)}


def test_a_sample_whose_first_target_would_see_nothing_is_refused():
    """Every token a target and no [SEP]: the first target in the order saw no key, and a query with none attends
    to every key, its own token's included. The pipeline's samples end with [SEP]; a sample built otherwise is
    refused, not trained on its own answer."""
    (plm,) = build_objectives({"plm": {"predict_fraction_k": 1}}, TOKENS)
    rng = np.random.default_rng(0)
    ids = np.array([TOKENS.cls, 10, 11, 12, 13], np.int64)
    with pytest.raises(ValueError, match=r"plm: a sample with every token a target needs a token all of them see"):
        plm.prepare({"input_ids": ids, "token_type_ids": np.zeros(5, np.int64)}, rng)
    with_sep = np.append(ids, TOKENS.sep)
    out = plm.prepare({"input_ids": with_sep, "token_type_ids": np.zeros(6, np.int64)}, rng)
    assert (out["plm_labels"] != IGNORE_INDEX).sum() == 4  # with [SEP]: every token a target, each sees [SEP]


def test_content_and_query_masks(model):
    plm = model.objectives[0]
    batch = make_batch(plm)
    f = prepared(model, batch)
    rank, real = batch["plm_order"], batch["attention_mask"]
    for r in range(rank.shape[0]):
        for i in range(rank.shape[1]):
            expected = [bool(rank[r, j] <= rank[r, i] and real[r, j]) for j in range(rank.shape[1])]
            assert f.attention_mask[r, i].tolist() == expected
        for t, pos in enumerate(f.query_positions[r].tolist()):
            expected = [bool(rank[r, j] < rank[r, pos] and real[r, j]) for j in range(rank.shape[1])]
            assert f.query_mask[r, t].tolist() == expected
    # the query stream predicts exactly the targets: their flat indices into [B, T] and the labels there
    queried = torch.gather(batch["plm_labels"], 1, f.query_positions).reshape(-1)
    assert torch.equal(queried[batch["plm_query_index"]], batch["plm_query_targets"])
    assert len(batch["plm_query_index"]) == (batch["plm_labels"] != -100).sum() == batch.counts["plm"]


def test_content_stream_sees_only_earlier_in_the_order(model):
    batch = make_batch(model.objectives[0])
    rank = batch["plm_order"][0]
    i = int(torch.nonzero(rank == 5)[0])  # a position with some tokens before it in the order, most after
    later = (rank > rank[i]) & batch["attention_mask"][0]
    earlier = (rank < rank[i]) & (rank >= 0)
    h = two_stream(model, batch)[0][0, i]

    def with_changed(where):
        changed = dict(batch, input_ids=batch["input_ids"].clone())
        changed["input_ids"][0, where] = 5 + (changed["input_ids"][0, where] - 4) % (V - 5)  # another real token
        return two_stream(model, changed)[0][0, i]

    torch.testing.assert_close(with_changed(later), h, atol=1e-6, rtol=0)
    assert (with_changed(earlier) - h).abs().max() > 1e-3

    # [CLS] ranks after everything: its content state (what nsp / sop read) sees the whole sequence.
    last = int(torch.nonzero(rank == rank[(rank >= 0) & (rank < int(rank[0]))].max())[0])
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][0, last] = 5 + (changed["input_ids"][0, last] - 4) % (V - 5)
    assert (two_stream(model, changed)[0][0, 0] - two_stream(model, batch)[0][0, 0]).abs().max() > 1e-3


XLNET_CODE = {"max_ngram": 3, "bidirectional_context": True}
VARIANTS = {"paper": {}, "ngrams": {"max_ngram": 3}, "context": {"bidirectional_context": True}, "xlnet": XLNET_CODE}


@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("row", [0, 1])
def test_no_leak_of_own_or_later_tokens_to_a_prediction(model, row, options):
    (plm,) = build_objectives({"plm": {"predict_fraction_k": 3, **options}}, TOKENS)
    batch = make_batch(plm)
    rank, real = batch["plm_order"][row], batch["attention_mask"][row]
    special = torch.from_numpy(np.isin(batch["input_ids"][row].numpy(), TOKENS.special_ids))
    _, logits, positions = two_stream(model, batch)
    checked = 0
    for q, t in enumerate(positions[row].tolist()):
        if batch["plm_labels"][row, t] == IGNORE_INDEX:
            continue  # filler of a row with fewer targets

        def logits_with_changed(where, row=row, q=q):
            changed = dict(batch, input_ids=batch["input_ids"].clone())
            changed["input_ids"][row, where] = 5 + (changed["input_ids"][row, where] - 4) % (V - 5)
            return two_stream(model, changed)[1][row, q]

        own = torch.zeros_like(real)
        own[t] = True
        later = (rank > rank[t]) & real  # other targets after t, and [CLS]
        earlier = (rank < rank[t]) & real & ~special  # (the context, rank -1, under bidirectional_context)
        torch.testing.assert_close(logits_with_changed(own), logits[row, q], atol=1e-6, rtol=0)
        torch.testing.assert_close(logits_with_changed(later), logits[row, q], atol=1e-6, rtol=0)
        assert (logits_with_changed(earlier) - logits[row, q]).abs().max() > 1e-3  # the test is not vacuous
        checked += 1
    assert checked >= 2


def test_bidirectional_context_sees_all_the_context_and_no_target(model):
    """Under bidirectional_context a token that is not a target sees every other such token, wherever it is in the
    order, and no target."""
    batch = make_batch(build_objectives({"plm": {"predict_fraction_k": 4, **XLNET_CODE}}, TOKENS)[0])
    rank, real, targets = batch["plm_order"][0], batch["attention_mask"][0], batch["plm_labels"][0] != IGNORE_INDEX
    context = (rank == -1) & real & ~torch.from_numpy(np.isin(batch["input_ids"][0].numpy(), TOKENS.special_ids))
    i, *rest = torch.nonzero(context)[:, 0].tolist()
    h = two_stream(model, batch)[0][0, i]

    def with_changed(where):
        changed = dict(batch, input_ids=batch["input_ids"].clone())
        changed["input_ids"][0, where] = 5 + (changed["input_ids"][0, where] - 4) % (V - 5)
        return two_stream(model, changed)[0][0, i]

    torch.testing.assert_close(with_changed(targets), h, atol=1e-6, rtol=0)
    assert len(rest) >= 3 and all((with_changed(j) - h).abs().max() > 1e-3 for j in rest)


def _reference_encoder(enc, ids, types, mask):
    """The encoder's math before two-stream support, written out: the standard path must match it bit for bit."""
    x = enc.embeddings(ids, types)
    bias = torch.zeros(mask.shape).masked_fill_(~mask.bool(), torch.finfo(torch.float32).min)[:, None, None, :]
    for layer in enc.layers:
        B, L, H = x.shape
        att = layer.attention
        q, k, v = att.qkv(x).view(B, L, 3, att.num_heads, H // att.num_heads).permute(2, 0, 3, 1, 4)
        y = att.out(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(B, L, H))
        x = layer.attn_norm(x + y)
        x = layer.ffn_norm(x + layer.ffn_out(F.gelu(layer.ffn_in(x))))
    return x


@torch.no_grad()
def test_standard_path_unchanged_and_streams_share_the_layer_math(model):
    batch = make_batch(model.objectives[0])
    ids, types, mask = batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]
    plain = model.encoder(ids, types, mask)
    assert torch.equal(plain, _reference_encoder(model.encoder, ids, types, mask))
    # A per-query mask that only repeats the key mask means the same attention.
    L = ids.shape[1]
    torch.testing.assert_close(model.encoder(ids, types, mask[:, None, :].expand(-1, L, -1)), plain)
    # A query stream does not disturb the content stream, and a query stream that starts as the content
    # embeddings under the same mask follows it exactly: one block math for both streams.
    h, g = model.encoder(
        ids,
        types,
        mask,
        query_stream=model.encoder.embeddings(ids, types),
        query_mask=mask[:, None, :].expand(-1, L, -1),
    )
    assert torch.equal(h, plain)
    torch.testing.assert_close(g, plain, atol=1e-5, rtol=1e-5)


def test_training_reduces_the_loss():
    torch.manual_seed(0)
    m = PretrainingModel(CFG, build_objectives({"plm": {"predict_fraction_k": 2}}, TOKENS)).train()
    batch = make_batch(m.objectives[0], lengths=(24, 20, 16, 24))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss, metrics = m(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert {"plm/loss", "plm/accuracy", "loss"} <= metrics.keys()
    assert m.heads["plm"].query_embedding.grad.abs().sum() > 0  # w is trained
    assert losses[-1] < 0.7 * losses[0], losses


def test_plm_is_exclusive_with_other_token_objectives():
    with pytest.raises(ConfigError, match="plm"):
        build_objectives({"plm": {}, "mlm": {}}, TOKENS)
    with pytest.raises(ConfigError, match="predict_fraction_k"):
        build_objectives({"plm": {"predict_fraction_k": 0}}, TOKENS)


def test_export_as_bert_for_masked_lm(model, tmp_path):
    from pretrain.hf.export import export_pretrained, lm_head_name, verify_export

    assert lm_head_name(model) == "heads.plm"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"[unused{i}]" for i in range(V - 5)]
    tok_dir = tmp_path / "tokenizer"
    transformers.BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}).save_pretrained(str(tok_dir))
    out = export_pretrained(model, TOKENS, tok_dir, tmp_path / "hf", {"objectives": ["plm"]})
    assert verify_export(model, out, atol=1e-4) <= 1e-4
