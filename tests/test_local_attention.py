"""Local (sliding-window) attention, as ModernBERT's: logits equal to transformers' ModernBERT with global and local
layers mixed, padded and unpadded, within and beyond the window; a ModernBERT checkpoint with sliding layers imported by
model.init_from and exported back; a window that masks nothing is global attention, bit for bit; the query stream
(PLM) takes the band too; bad values are refused by name."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file

from data_pipeline.tokenizer import load_tokenizer, special_tokens
from objectives import build_objectives
from pretrain.core.config import ConfigError, ModelConfig, build_config
from pretrain.core.errors import UserError
from pretrain.hf.export import export_pretrained, load_hf, verify_export
from pretrain.hf.interop import select_architecture
from pretrain.model.padding import Banded, window_mask
from pretrain.model.pretraining import PretrainingModel
from pretrain.train.setup import build_model, config_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 128  # = conftest.TINY_VOCAB (the `tokens` fixture)
WINDOW = 128  # ModernBERT's: a token sees 64 positions on each side
CARD = {"objectives": ["mlm"], "corpus": "tiny", "tokens_seen": 10, "steps": 1, "final_loss": 1.0, "run_name": "t"}
ATOL = 1e-4
# Four layers, global_every 3: global, local, local, global (ModernBERT's layout). No dropout: eval parity.
OURS = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_layers=4,
    num_heads=4,
    intermediate_size=48,
    max_position_embeddings=512,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    norm_placement="pre",
    position_embedding="rope",
    activation="geglu",
    use_bias=False,
    type_vocab_size=1,
    rope_theta=160000.0,
    local_attention=WINDOW,
    global_every=3,
    local_rope_theta=10000.0,
)
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def randomize(module: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> None:
    """Random everything (zero biases / unit norms would hide a swapped tensor)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def make_model(tokens, seed=0, **options) -> PretrainingModel:
    torch.manual_seed(seed)
    model = PretrainingModel(ModelConfig(**{**OURS, **options}), build_objectives({"mlm": {}}, tokens))
    randomize(model, seed)
    return model.eval()


def batch(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, mask [3, length]: a full row, one with 40 padding tokens at the end, one a third real."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (3, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, length - 40 :] = 0
    mask[2, length // 3 :] = 0
    ids[mask == 0] = 0
    return ids, mask


def save_tokenizer(path) -> None:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
    transformers.BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}).save_pretrained(str(path))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(path)
    return path


def with_options(model: PretrainingModel, **options) -> PretrainingModel:
    """The same weights under other execution options (the encoder reads its config at each forward)."""
    model.config = model.encoder.config = replace(model.config, **options)
    return model


def ours(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = model.encoder(ids, None, mask)
    return hidden, model.heads["mlm"](hidden)


def theirs(hf, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    return hf.model(input_ids=ids, attention_mask=mask).last_hidden_state, hf(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("length", [64, 150, 300])  # within; dense band; by blocks
def test_export_matches_transformers_within_and_beyond_the_window(tokens, tokenizer_dir, tmp_path, length):
    model = make_model(tokens)
    out = export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", CARD)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == LAYER_TYPES and config["local_attention"] == WINDOW
    assert config["global_attn_every_n_layers"] == 3
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == OURS["rope_theta"]
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == OURS["local_rope_theta"]
    hf = load_hf(out)
    assert verify_export(model, out) <= ATOL  # the export's own check

    ids, mask = batch(length)
    real = mask.bool()
    with torch.no_grad():
        want_hidden, want_logits = theirs(hf, ids, mask)
        hidden, logits = ours(model, ids, mask)
        # padded: every position as transformers (a padding query out of reach of any real key gets zeros in both)
        assert (hidden - want_hidden).abs().max() <= ATOL and (logits - want_logits).abs().max() <= ATOL
        _, unpadded = ours(with_options(model, unpadded=True), ids, mask)
        assert (unpadded[real] - want_logits[real]).abs().max() <= ATOL
        if length > WINDOW // 2 + 1:  # the band masks something here: not global attention under another name
            banded = ours(make_model(tokens, local_rope_theta=OURS["rope_theta"]), ids, mask)[1]
            full = ours(make_model(tokens, local_attention=0), ids, mask)[1]
            assert (banded[real] - full[real]).abs().max() > 1e-3

    # Training through padding rows with no key in reach (row 2 at 300) stays finite, on both paths.
    for unpadded_path in (False, True):
        model = with_options(make_model(tokens), unpadded=unpadded_path).train()
        model.zero_grad()
        _, logits = ours(model, ids, mask)
        logits[real].float().pow(2).mean().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _modernbert_checkpoint(path) -> transformers.ModernBertForMaskedLM:
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        cls_token_id=2,
        sep_token_id=3,
        global_attn_every_n_layers=3,
        local_attention=WINDOW,
        # not the defaults, so that each is seen to travel
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 80000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
        },
    )
    assert config.layer_types == LAYER_TYPES
    hf = transformers.ModernBertForMaskedLM(config)
    randomize(hf, seed=3)
    hf.save_pretrained(str(path))
    save_tokenizer(path)
    return hf.eval()


@pytest.mark.parametrize("unpadded", [False, True])
def test_init_from_a_modernbert_with_sliding_layers_and_export_back(tmp_path, unpadded):
    src = tmp_path / "src"
    hf = _modernbert_checkpoint(src)
    cfg = config_from_dict(
        {
            "output_dir": str(tmp_path),
            "name": "run",
            "objectives": {"mlm": {}},
            "data": {"max_seq_len": 64},  # shorter than the window: an import keeps its window anyway
            "model": {"init_from": str(src), "hidden_dropout": 0.0, "attention_dropout": 0.0, "unpadded": unpadded},
        }
    )
    m = cfg.model
    assert (m.local_attention, m.global_every, m.rope_theta, m.local_rope_theta) == (WINDOW, 3, 80000.0, 5000.0)
    tokens = special_tokens(load_tokenizer(cfg.tokenizer_dir))
    model = build_model(cfg, tokens).eval()
    ids, mask = batch(300)
    real = mask.bool()
    with torch.no_grad():
        _, want = theirs(hf, ids, mask)
        _, got = ours(model, ids, mask)
    assert (got[real] - want[real]).abs().max() <= ATOL

    out = export_pretrained(model, tokens, cfg.tokenizer_dir, tmp_path / "out", CARD)
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (src, out))
    for key in ("layer_types", "local_attention", "rope_parameters"):
        assert out_cfg[key] == src_cfg[key], key
    with torch.no_grad():
        _, again = theirs(load_hf(out), ids, mask)
    assert (again - want).abs().max() <= ATOL


@pytest.mark.parametrize("window, length", [(2, 9), (8, 37), (8, 13), (128, 300)])
def test_blocks_equal_the_dense_band(window, length):
    """Banded (queries by blocks of window / 2 against 3 key blocks) is the dense boolean band, padding included."""
    gen = torch.Generator().manual_seed(window + length)
    q, k, v = (torch.randn(3, 2, length, 8, generator=gen, requires_grad=True) for _ in range(3))
    mask = torch.ones(3, length, dtype=torch.bool)
    mask[1, length // 2 :] = False
    mask[2, 1:] = False
    band = window_mask(mask, window, length, q.device)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band)
    blocks = Banded.build(mask, window, length, 3, q.device).attend(q, k, v, 0.0)
    torch.testing.assert_close(blocks, dense, atol=1e-6, rtol=1e-6)
    grads = [torch.autograd.grad(out.pow(2).sum(), (q, k, v)) for out in (dense, blocks)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("unpadded", [False, True])
def test_a_window_that_masks_nothing_is_global_attention(tokens, unpadded):
    ids, mask = batch(64)
    same_theta = dict(local_rope_theta=OURS["rope_theta"], unpadded=unpadded)
    with torch.no_grad():
        wide = make_model(tokens, local_attention=2 * 64, **same_theta).encoder(ids, None, mask)
        full = make_model(tokens, local_attention=0, **same_theta).encoder(ids, None, mask)
    assert torch.equal(wide, full)


def test_query_stream_takes_the_band(tokens):
    """A query stream that starts as the content embeddings, at the content positions and under the same mask,
    follows the content stream through local layers too (band over its positions, local theta)."""
    model = make_model(tokens)
    encoder = model.encoder
    ids, mask = batch(300)
    L = ids.shape[1]
    with torch.no_grad():
        plain = encoder(ids, None, mask)
        h, g = encoder(
            ids,
            None,
            mask,
            query_stream=encoder.embeddings(ids, None),
            query_mask=mask.bool()[:, None, :].expand(-1, L, -1),
            query_positions=torch.arange(L).expand(3, -1),
        )
    real = mask.bool()
    # the content stream beside a query stream takes the dense band, the plain one runs by blocks: the same sums
    torch.testing.assert_close(h, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g[real], plain[real], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="query_positions"):
        encoder(ids, None, mask, query_stream=g, query_mask=mask.bool()[:, None, :].expand(-1, L, -1))


def test_the_exports_own_check_sees_a_wrong_window(tokens, tokenizer_dir, tmp_path):
    """The check's probe is longer than the window: at 16 tokens a window of 128 computes what one of 256 does, so an
    export that gave transformers the wrong window passed its own check."""
    from pretrain.hf.parity import ExportError

    model = make_model(tokens)
    out = export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", CARD)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "local_attention": 2 * WINDOW}))
    with pytest.raises(ExportError, match="HF outputs differ from ours"):
        verify_export(model, out)


def test_only_modernbert_exports_local_attention(tokens):
    model = make_model(tokens, norm_placement="post", position_embedding="learned", activation="gelu", use_bias=True)
    with pytest.raises(UserError, match="model.local_attention=128"):
        select_architecture(model)


@pytest.mark.parametrize(
    "model, data, key",
    [
        ({"local_attention": -2}, {}, "model.local_attention: value -2"),
        ({"local_attention": 7}, {}, "model.local_attention: value 7"),
        ({"local_attention": 64, "global_every": 0}, {}, "model.global_every: must be >= 1, got 0"),
        ({"local_attention": 64, "global_every": 1}, {}, "model.global_every: value 1"),
        ({"local_rope_theta": 0.0}, {}, "model.local_rope_theta: must be > 0, got 0.0"),
        ({"local_attention": 64, "share_layers": True}, {}, "model.share_layers=true"),
        # 128 tokens: a window of 254 or more sees all of them from everywhere
        ({"local_attention": 254}, {"max_seq_len": 128}, "model.local_attention: value 254 .* data.max_seq_len=128"),
    ],
)
def test_bad_values_are_refused_by_name(model, data, key):
    with pytest.raises(ConfigError, match=key):
        build_config({"model": model, "data": data})


def test_good_values_are_read():
    cfg = build_config({"model": {"local_attention": 252, "global_every": 2}, "data": {"max_seq_len": 128}})
    assert (cfg.model.local_attention, cfg.model.global_every, cfg.model.local_rope_theta) == (252, 2, 10000.0)


@pytest.mark.parametrize("length", [10, 40])
def test_every_band_is_made_on_the_activations_device(length):
    """Rows without padding have no key mask to take a device from; a band made on the CPU then fails SDPA on a GPU.
    The meta device stands in for the GPU: the dense band (length 10 < 3 blocks of 4), blocks (40), and the query
    stream's band at both."""
    from pretrain.model.encoder import BertEncoder

    cfg = ModelConfig(**{**OURS, "local_attention": 8})
    encoder = BertEncoder(cfg).to("meta")
    ids = torch.zeros(2, length, dtype=torch.long, device="meta")
    assert encoder(ids).device.type == "meta"
    query = torch.zeros(2, 3, cfg.hidden_size, device="meta")
    positions = torch.zeros(2, 3, dtype=torch.long, device="meta")
    assert encoder(ids, query_stream=query, query_positions=positions)[1].device.type == "meta"


def test_a_phases_rope_theta_is_the_one_an_export_of_the_model_writes(tokens, tokenizer_dir, tmp_path):
    """`set_rope_theta` (a schedule phase's context extension) changed the layers and the encoder's config but not the
    pretraining model's: an export of that model wrote the old theta into config.json (its own check failed, by 0.39;
    unchecked, transformers computed other logits). Local layers keep theirs."""
    from pretrain.model.encoder import set_rope_theta

    model = make_model(tokens)
    set_rope_theta(model, 40000.0)
    assert model.config.rope_theta == 40000.0 and model.encoder.config.rope_theta == 40000.0
    out = export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", CARD)  # checked against ours
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 40000.0
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == OURS["local_rope_theta"]
