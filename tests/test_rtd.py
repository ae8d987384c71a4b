"""ELECTRA replaced-token detection: labels, sampling, gradient flow (plain and disentangled), loss weights,
HF export parity of discriminator and generator, and that training reduces the loss."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from data_pipeline.loader import Collator
from objectives import build_objectives
from objectives.rtd import DisentangledWordEmbedding, generator_config
from pretrain.core.config import ModelConfig
from pretrain.core.errors import ConfigError, UserError
from pretrain.core.tokens import IGNORE_INDEX, SpecialTokens
from pretrain.hf.electra import export_electra, to_hf_electra_state_dicts, verify_electra_export
from pretrain.hf.init_from import load_init_from
from pretrain.model.pretraining import Forward, PretrainingModel

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 128  # = conftest.TINY_VOCAB, which the `tokens` fixture uses
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = "the a of and to in is was we our nation people government freedom liberty union states".split()
CARD = {
    "objectives": {"rtd": {"disc_weight": 50.0}},
    "corpus": "data/us-speeches.public-domain.jsonl",
    "tokens_seen": 123456,
    "steps": 789,
    "final_loss": 4.2512,
    "run_name": "tiny-electra",
}
# 3 heads of 16; generator_size 1/4 -> width 12, 1 head, intermediate 24. No dropout: deterministic checks.
CFG = ModelConfig(
    vocab_size=VOCAB,
    hidden_size=48,
    num_layers=2,
    num_heads=3,
    intermediate_size=96,
    max_position_embeddings=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def make_model(tokens, seed=0, randomize=False, cfg=CFG, **options) -> PretrainingModel:
    torch.manual_seed(seed)
    model = PretrainingModel(cfg, build_objectives({"rtd": options}, tokens))
    if randomize:  # zero biases / unit LayerNorms / zero delta would hide a swapped or dropped tensor
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.5)
    return model


def make_batch(tokens, objective, seed=0, lengths=(20, 14, 9, 20)) -> dict[str, torch.Tensor]:
    """Packed-like samples [CLS] words [SEP] of different lengths (so the batch has padding), prepared by rtd."""
    rng = np.random.default_rng(seed)
    samples = []
    for n in lengths:
        ids = np.concatenate([[tokens.cls], rng.integers(5, VOCAB, n - 2), [tokens.sep]]).astype(np.int64)
        samples.append(objective.prepare({"input_ids": ids, "token_type_ids": np.zeros(n, np.int64)}, rng))
    return Collator(tokens.pad, [objective])(samples)


def test_generator_config_and_options():
    opts = build_objectives({"rtd": {}}, SpecialTokens(0, 1, 2, 3, 4, VOCAB))[0].options
    assert (opts.mask_prob, opts.mask_token_prob, opts.random_token_prob) == (0.15, 0.85, 0.0)
    assert (opts.gen_weight, opts.disc_weight, opts.temperature, opts.disentangled) == (1.0, 50.0, 1.0, False)
    gen = generator_config(CFG, opts)
    assert (gen.hidden_size, gen.num_heads, gen.intermediate_size, gen.num_layers) == (12, 1, 24, 2)
    # ELECTRA-Small's generator: 256 / 4 heads / 1024 -> 64 / 1 head / 256 (and -Base's 768 -> 192)
    small = generator_config(ModelConfig(hidden_size=256, num_heads=4, intermediate_size=1024), opts)
    assert (small.hidden_size, small.num_heads, small.intermediate_size) == (64, 1, 256)
    big = generator_config(ModelConfig(hidden_size=768, num_heads=12, intermediate_size=3072), opts)
    assert (big.hidden_size, big.num_heads, big.intermediate_size) == (192, 3, 768)
    with pytest.raises(ConfigError, match="temperature"):
        build_objectives({"rtd": {"temperature": 0}}, SpecialTokens(0, 1, 2, 3, 4, VOCAB))
    # under RoPE a head needs an even width: ELECTRA-Base's 1/3 of 512 over 8 heads gave 3 heads of 57 (a crash)
    third = build_objectives({"rtd": {"generator_size": 1 / 3}}, SpecialTokens(0, 1, 2, 3, 4, VOCAB))[0].options
    for hidden, heads in ((512, 8), (256, 4)):
        rope = ModelConfig(hidden_size=hidden, num_heads=heads, intermediate_size=4 * hidden, position_embedding="rope")
        gen = generator_config(rope, third)
        assert gen.hidden_size % (2 * gen.num_heads) == 0, (gen.hidden_size, gen.num_heads)
    assert generator_config(dataclasses.replace(rope, position_embedding="learned"), third).hidden_size == 85


def test_the_generator_has_the_encoders_layer_pattern(tokens):
    """ELECTRA's generator is built like the encoder: with model.local_attention its local layers see only their
    window (at their own RoPE base), and under pre-LN its output is LayerNorm-ed. Its layers were all global, at the
    global base, and its pre-LN output reached the head un-normalised."""
    modern = dataclasses.replace(
        CFG,
        num_layers=3,
        norm_placement="pre",
        position_embedding="rope",
        activation="geglu",
        use_bias=False,
        local_attention=4,
        global_every=3,
        rope_theta=160000.0,
    )
    model = make_model(tokens, cfg=modern, generator_size=0.5).eval()
    gen, enc = model.heads["rtd"].generator, model.encoder
    assert [lay.attention.window for lay in gen.layers] == [lay.attention.window for lay in enc.layers] == [0, 4, 4]
    assert [lay.attention.rope_theta for lay in gen.layers] == [160000.0, 10000.0, 10000.0]
    assert gen.final_norm is not None
    # a token's generator state depends on tokens beyond its window only through the global layer: with the global
    # layer bypassed, changing the last token leaves the first token's state as it was
    x = torch.randn(1, 12, modern.hidden_size)  # the shared embeddings' width, projected to the generator's
    far = x.clone()
    far[0, 11] += 1.0
    gen.layers[0].forward = lambda h, *a, **k: h
    with torch.no_grad():
        assert torch.equal(gen.encode(x, None)[0, 0], gen.encode(far, None)[0, 0])
        assert not torch.equal(gen.encode(x, None)[0, 10], gen.encode(far, None)[0, 10])  # within the window
    # BERT's layout (post-LN, global) computes what it did: the layers one after another on the padding bias
    from pretrain.model.encoder import attention_bias

    plain = make_model(tokens, randomize=True).eval().heads["rtd"].generator
    assert plain.final_norm is None
    x, mask = torch.randn(2, 9, CFG.hidden_size), torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        expected = plain.embeddings_project(x)
        for layer in plain.layers:
            expected = layer(expected, attention_bias(mask, x.dtype))
        assert torch.equal(plain.encode(x, mask), expected)


def test_labels_mark_exactly_the_replaced_tokens(tokens):
    model = make_model(tokens).eval()
    rtd = model.objectives[0]
    # A generator that always proposes token 7: replaced = masked positions whose original is not 7.
    with torch.no_grad():
        model.heads["rtd"].generator.head.bias[7] = 1e4
    batch = make_batch(tokens, rtd)
    labels = batch["rtd_mlm_labels"]
    masked = labels != IGNORE_INDEX
    labels[masked.nonzero()[0].unbind()] = 7  # one masked original IS 7: sampled == original there -> label 0
    batch["rtd_targets"][0] = 7  # the collator's copy of the first (row-major) masked original
    original = torch.where(masked, labels, batch["input_ids"])
    out = Forward(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    rtd.before_encoder(batch, out, model)

    assert torch.equal(out.input_ids[masked], torch.full((int(masked.sum()),), 7))
    assert torch.equal(out.input_ids[~masked], original[~masked])  # untouched outside the masked positions
    real = batch["attention_mask"]
    expected = ((out.input_ids != original) & real).float()  # padding is never a target (its weight is 0 anyway)
    sampled = out.carry["rtd"]
    assert torch.equal(sampled.labels, expected)
    assert (sampled.labels[real] == 1).sum() == masked.sum() - 1 and int(sampled.replaced.sum()) == masked.sum() - 1
    assert torch.equal(batch["input_ids"], make_batch(tokens, rtd)["input_ids"])  # caller's batch not mutated


def test_samples_only_at_masked_positions_never_special(tokens):
    """Never a special token, nor an [unusedN] filler (here ids 96-127, as a tokenizer's fillers are left out of
    `replaceable`): the generator drew 157 fillers in 576 replacements before."""
    tokens = dataclasses.replace(tokens, replaceable=np.arange(5, 96))
    model = make_model(tokens, seed=1)
    rtd = model.objectives[0]
    batch = make_batch(tokens, rtd, seed=3, lengths=(40, 33, 25, 40))
    masked = batch["rtd_mlm_labels"] != IGNORE_INDEX
    original = torch.where(masked, batch["rtd_mlm_labels"], batch["input_ids"])

    def sample():
        forward = Forward(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        rtd.before_encoder(batch, forward, model)
        return forward.input_ids

    torch.manual_seed(5)
    ids = sample()
    changed = ids != original
    assert changed.any() and not (changed & ~masked).any()
    assert torch.isin(ids[masked], torch.from_numpy(tokens.replaceable)).all()
    assert not (ids == tokens.mask).any()  # the discriminator never sees [MASK]
    torch.manual_seed(5)  # sampling uses torch's global RNG, which checkpoints save: same state, same samples
    assert torch.equal(sample(), ids)


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss, metrics = model(batch)
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}, metrics


def _is_zero(grad) -> bool:
    return grad is None or not grad.abs().sum()


def test_discriminator_loss_does_not_reach_the_generator(tokens):
    model = make_model(tokens, gen_weight=0.0)  # the discriminator loss alone
    batch = make_batch(tokens, model.objectives[0])
    grads, _ = _grads(model, batch)
    generator_only = [
        n for n in grads if n.startswith("heads.rtd.generator.") and n != "heads.rtd.generator.head.decoder_weight"
    ]
    assert len(generator_only) > 10 and all(_is_zero(grads[n]) for n in generator_only), [
        n for n in generator_only if not _is_zero(grads[n])
    ]
    # ... but it does train the shared embeddings (ELECTRA) and the discriminator
    for name in (
        "encoder.embeddings.word_embeddings.weight",
        "encoder.layers.0.attention.qkv.weight",
        "heads.rtd.dense_prediction.weight",
    ):
        assert not _is_zero(grads[name]), name
    # Sanity: with the generator loss on, the generator does learn.
    model.objectives[0].options.gen_weight = 1.0
    grads, _ = _grads(model, batch)
    assert all(not _is_zero(grads[n]) for n in generator_only if ".layers." in n and n.endswith("weight"))


def test_disentangled_shared_embeddings_get_no_discriminator_gradient(tokens):
    model = make_model(tokens, gen_weight=0.0, disentangled=True)
    word = model.encoder.embeddings.word_embeddings
    assert isinstance(word, DisentangledWordEmbedding) and not word.delta.abs().sum()  # zero-initialised
    assert model.heads["rtd"].generator.head.decoder_weight is word.weight  # still tied to the shared table
    batch = make_batch(tokens, model.objectives[0])
    grads, _ = _grads(model, batch)
    assert _is_zero(grads["encoder.embeddings.word_embeddings.weight"])
    assert not _is_zero(grads["encoder.embeddings.word_embeddings.delta"])
    model.objectives[0].options.gen_weight = 1.0  # the generator's loss still trains the shared table
    grads, _ = _grads(model, batch)
    assert not _is_zero(grads["encoder.embeddings.word_embeddings.weight"])


def test_total_is_gen_plus_50_disc(tokens):
    model = make_model(tokens)
    loss, metrics = model(make_batch(tokens, model.objectives[0]))
    value = {k: m.value() for k, m in metrics.items()}
    expected = value["rtd/gen_loss"] + 50.0 * value["rtd/disc_loss"]
    assert loss.item() == pytest.approx(expected, rel=1e-5) and value["rtd/loss"] == pytest.approx(expected, rel=1e-5)
    for key in ("gen_accuracy", "disc_accuracy", "replaced_fraction", "disc_auc", "gen_sampled_original"):
        assert 0.0 <= value[f"rtd/{key}"] <= 1.0, key
    assert 0.0 < value["rtd/replaced_fraction"] < 0.3  # ~15% masked, nearly all replaced at init
    # at init the generator samples nearly uniformly (1/123 per token): over ~280 masked positions its samples
    # are almost never the original token (10% would be ~28 hits where ~2 are expected)
    _, metrics = model(make_batch(tokens, model.objectives[0], seed=1, lengths=(64,) * 30))
    assert metrics["rtd/gen_sampled_original"].value() < 0.1


def test_training_reduces_the_loss(tokens):
    model = make_model(tokens, seed=2)
    batch = make_batch(tokens, model.objectives[0], seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss, _ = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses


# ----------------------------------------------------------------------------------------------
# Export


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    chars = sorted(set("".join(WORDS)))
    vocab = SPECIALS + WORDS + chars + [f"##{c}" for c in chars]
    vocab += [f"[unused{i}]" for i in range(VOCAB - len(vocab))]
    path = tmp_path_factory.mktemp("tokenizer")
    transformers.BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}).save_pretrained(str(path))
    return path


# name: (model.embedding_size, rtd options, discriminator (E, H), generator (E, Hg, heads), projections on disc/gen)
EXPORT_VARIANTS = {
    "plain": (0, {}, (48, 48), (48, 12, 1), (False, True)),
    "disentangled": (0, {"disentangled": True}, (48, 48), (48, 12, 1), (False, True)),
    # ELECTRA-small's layout: E narrower than H, the generator projecting E to its own width
    "factorized": (24, {}, (24, 48), (24, 12, 1), (True, True)),
    "factorized, generator as wide as E": (12, {}, (12, 48), (12, 12, 1), (True, False)),
    # the encoder on real tokens only (zeros at padding, where HF computes values): compared on real tokens
    "unpadded": (0, {}, (48, 48), (48, 12, 1), (False, True)),
}


@pytest.mark.parametrize("variant", list(EXPORT_VARIANTS))
def test_export_matches_transformers(tokens, tokenizer_dir, tmp_path, variant):
    embedding_size, options, disc_shape, gen_shape, projections = EXPORT_VARIANTS[variant]
    disentangled = options.get("disentangled", False)
    cfg = dataclasses.replace(CFG, embedding_size=embedding_size, unpadded=variant == "unpadded")
    model = make_model(tokens, randomize=True, cfg=cfg, **options).eval()
    out = export_electra(model, tokens, tokenizer_dir, tmp_path / "hf", CARD)
    diffs = verify_electra_export(model, out, atol=1e-4)  # padded batch; raises on missing/unexpected keys
    assert max(diffs.values()) <= 1e-4, diffs

    disc_cfg = json.loads((out / "config.json").read_text())
    gen_cfg = json.loads((out / "generator" / "config.json").read_text())
    assert disc_cfg["architectures"] == ["ElectraForPreTraining"] and gen_cfg["architectures"] == ["ElectraForMaskedLM"]
    assert (disc_cfg["embedding_size"], disc_cfg["hidden_size"]) == disc_shape
    assert (gen_cfg["embedding_size"], gen_cfg["hidden_size"], gen_cfg["num_attention_heads"]) == gen_shape
    assert disc_cfg["hidden_act"] == gen_cfg["hidden_act"] == "gelu"
    for where in (out, out / "generator"):
        assert {"model.safetensors", "README.md", "tokenizer_config.json"} <= {p.name for p in where.iterdir()}
    disc_card, gen_card = (out / "README.md").read_text(), (out / "generator" / "README.md").read_text()
    assert "ElectraForPreTraining" in disc_card and "fill-mask" not in disc_card and "- electra\n" in disc_card
    assert "ElectraForMaskedLM" in gen_card and "pipeline_tag: fill-mask" in gen_card and "789" in gen_card

    # HF -> ours -> HF: the weight maps invert (delta recovered as the difference of the two word tables)
    disc_sd, gen_sd = load_file(out / "model.safetensors"), load_file(out / "generator" / "model.safetensors")
    assert "generator_lm_head.weight" not in gen_sd  # tied: transformers re-ties it on load
    has_projection = ("electra.embeddings_project.weight" in disc_sd, "electra.embeddings_project.weight" in gen_sd)
    assert has_projection == projections
    fresh = make_model(tokens, seed=9, cfg=cfg, disentangled=disentangled)
    load_init_from(fresh, out)  # the import `model.init_from` runs: discriminator and generator/
    if variant == "plain":  # a generator of another depth or width than the run builds: the options are named
        for options, said in (
            ({"generator_layers": 1}, "num_hidden_layers 2 (this run's: 1)"),
            ({"generator_size": 0.5}, "hidden_size 12 (this run's: 24)"),
        ):
            with pytest.raises(UserError, match=rf"{re.escape(said)}: set objectives\.rtd\.generator_layers"):
                load_init_from(make_model(tokens, seed=9, cfg=cfg, **options), out)
    if disentangled:  # into a run without it: the option to set is named
        with pytest.raises(UserError, match=r"trained with objectives\.rtd\.disentangled=true; set it to import"):
            load_init_from(make_model(tokens, seed=9, cfg=cfg), out)
    again_disc, again_gen = to_hf_electra_state_dicts(fresh)
    for ref, again in ((disc_sd, again_disc), (gen_sd, again_gen)):
        assert ref.keys() == again.keys()
        for name in ref:
            assert torch.allclose(ref[name], again[name], atol=1e-6), name


def test_a_sentence_head_beside_rtd_is_said_to_be_left_out_of_the_export(tokens, tokenizer_dir, tmp_path):
    """rtd + sop: ElectraForPreTraining has no place for the sop head, and the export dropped it with no word."""
    from pretrain.hf.interop import select_architecture

    torch.manual_seed(0)
    model = PretrainingModel(CFG, build_objectives({"rtd": {}, "sop": {}}, tokens)).eval()
    said = "the sop head has no place in ElectraForPreTraining and is not exported"
    assert said in select_architecture(model).notes  # `pretrain export` and the run's export say each note
    out = export_electra(model, tokens, tokenizer_dir, tmp_path / "hf", CARD)
    assert said in (out / "README.md").read_text() and said not in (out / "generator" / "README.md").read_text()


def test_fill_mask_on_the_generator_and_bert_export_refuses(tokens, tokenizer_dir, tmp_path):
    from pretrain.hf.export import export_pretrained

    model = make_model(tokens).eval()
    out = export_electra(model, tokens, tokenizer_dir, tmp_path / "hf", CARD)
    fill = transformers.pipeline("fill-mask", model=str(out / "generator"))
    assert len(fill(f"the people of the {fill.tokenizer.mask_token} states", top_k=3)) == 3
    with pytest.raises(UserError, match="token-prediction"):  # the generator head is not a BERT MLM head
        export_pretrained(model, tokens, tokenizer_dir, tmp_path / "bert", CARD)


def test_stage_export_dispatches_on_rtd(tokens, tokenizer_dir, tmp_path, monkeypatch):
    from pretrain import pipeline as stages
    from pretrain.train.setup import config_from_dict

    cfg = config_from_dict({"output_dir": str(tmp_path), "name": "electra", "objectives": {"rtd": {}}})
    model = make_model(tokens).eval()
    monkeypatch.setattr(
        stages,
        "load_checkpoint_model",
        lambda path, ema=True: (cfg, model, tokens, tokenizer_dir, {"step": 3, "tokens_seen": 99}),
    )
    demo_dir = stages.stage_export(tmp_path / "electra")
    assert demo_dir == cfg.hf_dir / "generator"
    assert json.loads((cfg.hf_dir / "config.json").read_text())["architectures"] == ["ElectraForPreTraining"]


def test_categorical_sampler_matches_the_distribution():
    from objectives.rtd import sample_categorical

    torch.manual_seed(0)
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2]]).repeat(40000, 1)
    draws = sample_categorical(probs)
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[1] == 0  # a zero-probability token (e.g. [MASK]) is never drawn
    assert torch.allclose(freq, probs[0], atol=0.01), freq
