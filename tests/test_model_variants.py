"""Encoder options (pre-LN, RoPE, GeGLU, no bias, ALBERT factorization and sharing, unpadding, activation
checkpointing, torch.compile): each runs, changes what it should, and the speed options keep the numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import BASE, TOKENS, V, make_batch

from objectives import build_objectives
from pretrain.model.encoder import SelfAttention, rope_tables, rotate
from pretrain.model.pretraining import Forward, PretrainingModel

MODERN = dict(norm_placement="pre", position_embedding="rope", activation="geglu", use_bias=False)
VARIANTS = {
    "pre": dict(norm_placement="pre"),
    "rope": dict(position_embedding="rope"),
    "geglu": dict(activation="geglu"),
    "no_bias": dict(use_bias=False),
    "factorized": dict(embedding_size=16),
    "shared": dict(share_layers=True),
    "modernbert": MODERN,
    "albert": dict(embedding_size=16, share_layers=True),
    "everything": dict(MODERN, embedding_size=16, share_layers=True),
}


def build(seed=0, objectives=("mlm",), **options):
    torch.manual_seed(seed)
    return PretrainingModel(replace(BASE, **options), build_objectives({o: {} for o in objectives}, TOKENS))


def randomize(model, scale=0.3):
    """Off the init (zero biases, unit norms would hide mistakes)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return model


@pytest.mark.parametrize("objective", ["mlm", "span", "rtd"])
@pytest.mark.parametrize("name", VARIANTS)
def test_each_option_runs_forward_and_backward(name, objective):
    """Every encoder option under each objective with a head tied to the word embeddings (factorized ones: E < H)."""
    model = build(objectives=(objective,), **VARIANTS[name])
    loss, metrics = model(make_batch(objectives=model.objectives))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["pre", "rope", "geglu"])
def test_architecture_options_change_the_outputs(name):
    batch = make_batch()
    base, variant = randomize(build()).eval(), build(**VARIANTS[name]).eval()
    # the same weights wherever the two share them, so only the option differs
    shared = {k: v for k, v in base.state_dict().items() if v.shape == variant.state_dict().get(k, v[None]).shape}
    variant.load_state_dict(shared, strict=False)
    with torch.no_grad():
        a = base.encoder(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        b = variant.encoder(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    assert a.shape == b.shape and not torch.allclose(a, b, atol=1e-3)


def test_option_structure():
    pre = build(**MODERN).encoder
    assert isinstance(pre.layers[0].attn_norm, torch.nn.Identity)  # the embedding LN already normalised it
    assert isinstance(pre.layers[1].attn_norm, torch.nn.LayerNorm) and pre.final_norm is not None
    assert pre.embeddings.position_embeddings is None  # rope: no table
    assert pre.layers[0].ffn_in.weight.shape == (2 * BASE.intermediate_size, BASE.hidden_size)  # geglu
    assert not any(name.endswith("bias") for name, _ in pre.named_parameters())
    default = build().encoder
    assert default.final_norm is None and default.embeddings.projection is None


def test_shared_layers_are_stored_once():
    shared, default = build(share_layers=True), build()

    def layer_params(m):
        return sum(p.numel() for n, p in m.named_parameters() if ".layers." in n or "shared_layer" in n)

    assert layer_params(default) == BASE.num_layers * layer_params(shared)
    assert len(shared.encoder.layers) == BASE.num_layers
    assert all(layer is shared.encoder.shared_layer for layer in shared.encoder.layers)
    keys = list(shared.state_dict())
    assert any(k.startswith("encoder.shared_layer.") for k in keys)
    assert not any(k.startswith("encoder.layers.") for k in keys)
    clone = build(seed=1, share_layers=True)
    clone.load_state_dict(shared.state_dict())  # strict round trip


def test_factorized_embeddings_with_the_tied_mlm_head():
    model = build(embedding_size=16)
    emb, head = model.encoder.embeddings, model.heads["mlm"]
    assert emb.word_embeddings.weight.shape == (V, 16) and emb.projection.weight.shape == (BASE.hidden_size, 16)
    assert head.dense.weight.shape == (16, BASE.hidden_size)  # H -> E before the decoder E -> V
    assert head.decoder_weight is emb.word_embeddings.weight
    loss, _ = model(make_batch())
    loss.backward()
    assert emb.word_embeddings.weight.grad.abs().sum() > 0


def test_rope_depends_only_on_relative_positions():
    D, L, shift = 8, 12, 7
    cos, sin = rope_tables(L + shift, D, 10000.0, torch.device("cpu"), torch.float32)
    q, k = torch.randn(L, D), torch.randn(L, D)
    scores = rotate(q, cos[:L], sin[:L]) @ rotate(k, cos[:L], sin[:L]).T  # [L, L]
    shifted = rotate(q, cos[shift:], sin[shift:]) @ rotate(k, cos[shift:], sin[shift:]).T
    torch.testing.assert_close(scores, shifted, atol=1e-5, rtol=1e-5)
    # and a whole attention layer: every position moved by `shift` gives the same output
    torch.manual_seed(0)
    attention = SelfAttention(replace(BASE, position_embedding="rope", attention_dropout=0.0))
    x = torch.randn(2, L, BASE.hidden_size)
    cos, sin = rope_tables(L + shift, BASE.hidden_size // BASE.num_heads, 10000.0, x.device, x.dtype)

    def at(p):
        return attention(x, None, rope=(cos[p, None, None], sin[p, None, None]))

    torch.testing.assert_close(at(torch.arange(L)), at(torch.arange(L) + shift), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["default", "modernbert", "everything"])
def test_unpadded_matches_padded(name):
    options = VARIANTS.get(name, {})
    padded = randomize(build(**options)).eval()
    unpadded = build(**options, unpadded=True).eval()
    unpadded.load_state_dict(padded.state_dict())
    batch = make_batch()
    real = batch["attention_mask"].bool()
    assert not real.all()  # there is padding to remove
    args = (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    torch.testing.assert_close(unpadded.encoder(*args)[real], padded.encoder(*args)[real], atol=1e-5, rtol=1e-5)
    losses = []
    for model in (padded, unpadded):
        loss, _ = model(batch)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for (name_p, p), (_, q) in zip(padded.named_parameters(), unpadded.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name_p)


def test_unpadded_plm_falls_back_to_the_padded_path():
    """PLM's masks are per query ([B, L, L]); the two-stream path runs padded, so the loss is the same."""
    plm = build_objectives({"plm": {}}, TOKENS)
    batch = make_batch(objectives=plm)
    losses = []
    for unpadded in (False, True):
        torch.manual_seed(0)
        model = randomize(PretrainingModel(replace(BASE, unpadded=unpadded, **MODERN), plm)).eval()
        losses.append(model(batch)[0])
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("unpadded", [False, True])
def test_activation_checkpointing_gives_identical_loss_and_grads(unpadded):
    batch = make_batch()
    results = []
    for checkpointing in (False, True):
        model = build(
            seed=0, unpadded=unpadded, activation_checkpointing=checkpointing
        ).train()  # dropout on: recompute must replay it
        torch.manual_seed(123)
        loss, _ = model(batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


@pytest.mark.slow  # inductor compiles a forward and a backward graph: ~15 s warm, up to a minute cold on 2 cores
def test_compile_matches_eager_and_keeps_state_dict_names():
    options = dict(num_layers=1, hidden_size=16, num_heads=2, intermediate_size=32)
    eager = randomize(build(**options)).eval()
    compiled = build(**options, compile=True).eval()
    compiled.load_state_dict(eager.state_dict())
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no _orig_mod. prefixes
    batch = make_batch()
    loss_e, loss_c = eager(batch)[0], compiled(batch)[0]
    torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
    loss_c.backward()
    assert all(p.grad is not None for p in compiled.parameters())


def test_rope_query_stream_for_plm():
    plm = build_objectives({"plm": {}}, TOKENS)
    torch.manual_seed(0)
    model = PretrainingModel(replace(BASE, **MODERN), plm)
    loss, _ = model(make_batch(objectives=plm))
    loss.backward()
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="query_positions"):
        batch = make_batch(objectives=plm)
        f = Forward(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        plm[0].before_encoder(batch, f, model)
        model.encoder(
            f.input_ids, f.token_type_ids, f.attention_mask, query_stream=f.query_stream, query_mask=f.query_mask
        )


def test_rope_tables_made_in_an_evaluation_pass_serve_training():
    """The first table of a length may be made under torch.inference_mode (an evaluation pass); it is cached, and a
    training step after it must be able to save it for backward."""
    from pretrain.model import encoder

    encoder._ROPE_CACHE.clear()
    with torch.inference_mode():
        rope_tables(11, 8, 12345.0, torch.device("cpu"), torch.float32)
    cos, sin = rope_tables(11, 8, 12345.0, torch.device("cpu"), torch.float32)
    assert not cos.is_inference() and not sin.is_inference()
    x = torch.randn(11, 8, requires_grad=True)
    rotate(x, cos, sin).sum().backward()
    assert x.grad is not None


@torch.no_grad()
def test_one_rope_table_serves_every_batch_width():
    """Each batch width (rows padded to their longest: doc-bounded packing, segment pairs) cached a table of its own,
    without bound: every width up to 8192 held ~17 GB per theta. One table of the longest width serves them all, with
    the numbers a table of each width gives."""
    from pretrain.model import encoder

    model = randomize(build(position_embedding="rope")).eval()
    batches = [make_batch(lengths=(w, w - 4)) for w in (12, 40, 9, 25, 33)]

    def hidden(batch):
        return model.encoder(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])

    encoder._ROPE_CACHE.clear()
    cached = [hidden(b) for b in batches]
    head = BASE.hidden_size // BASE.num_heads
    assert [tuple(cos.shape) for cos, _ in encoder._ROPE_CACHE.values()] == [(40, head)]
    for batch, h in zip(batches, cached):
        encoder._ROPE_CACHE.clear()  # a table of this width alone
        assert torch.equal(hidden(batch), h)
