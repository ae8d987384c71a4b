"""HuggingFace interop both ways: export parity (hidden states and logits within 1e-4 of transformers, padded
batch, fp32) per architecture, import of transformers-initialised checkpoints and re-export to the same tensors,
the architecture dispatch and its errors, and --push-to-hub (never the network)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file

from data_pipeline.tokenizer import load_tokenizer, special_tokens
from objectives import build_objectives
from pretrain.core.config import ModelConfig
from pretrain.core.errors import ConfigError, UserError
from pretrain.evaluation.evaluate import load_target
from pretrain.hf import interop as hf_interop
from pretrain.hf.export import _probe_batch, compare_with_hf, export_pretrained, lm_head_name, load_hf
from pretrain.hf.init_from import InitFromWarning
from pretrain.hf.interop import select_architecture
from pretrain.model.pretraining import PretrainingModel
from pretrain.pipeline import stage_tokenizer
from pretrain.train.dryrun import dry_run
from pretrain.train.setup import build_model, config_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 128  # = conftest.TINY_VOCAB, which the `tokens` fixture uses
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = "the a of and to in is was we our nation people government freedom liberty union states".split()
CARD = {"objectives": ["mlm"], "corpus": "tiny", "tokens_seen": 10, "steps": 1, "final_loss": 1.0, "run_name": "t"}
ATOL = 1e-4
# Tiny and deterministic: no dropout, so our model and transformers' agree in train-free eval.
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    intermediate_size=48,
    max_position_embeddings=40,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
MODERNBERT = dict(
    norm_placement="pre", position_embedding="rope", activation="geglu", use_bias=False, rope_theta=1000.0
)


def _vocab() -> list[str]:
    chars = sorted(set("".join(WORDS)) - set(WORDS))  # "a" is a word already: no duplicate entries
    vocab = SPECIALS + WORDS + chars + [f"##{c}" for c in sorted(set("".join(WORDS)))]
    return vocab + [f"[unused{i}]" for i in range(VOCAB - len(vocab))]


def save_tokenizer(path) -> None:
    transformers.BertTokenizer(vocab={t: i for i, t in enumerate(_vocab())}).save_pretrained(str(path))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(path)
    return path


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Zero biases / unit LayerNorms (the inits) would hide a swapped or dropped tensor: all random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def make_model(tokens, objectives, seed=0, **options) -> PretrainingModel:
    torch.manual_seed(seed)
    model = PretrainingModel(ModelConfig(**{**BASE, **options}), build_objectives(objectives, tokens))
    randomize(model, seed)
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Export parity

PARITY = {
    # name: (objectives, model options, --arch, expected class, extra outputs compared)
    "bert-mlm": ({"mlm": {}}, {}, None, "BertForMaskedLM", ()),
    "bert-pretraining": ({"mlm": {}, "nsp": {}}, {}, None, "BertForPreTraining", ("nsp",)),
    "roberta": ({"mlm": {}}, {"type_vocab_size": 1}, "roberta", "RobertaForMaskedLM", ()),
    "albert-pretraining": (
        {"mlm": {}, "sop": {}},
        {"embedding_size": 16, "share_layers": True},
        None,
        "AlbertForPreTraining",
        ("sop",),
    ),
    "albert-mlm-unshared": ({"mlm": {}}, {"embedding_size": 16}, None, "AlbertForMaskedLM", ()),
    "albert-identity-projection": (
        {"mlm": {}, "sop": {}},
        {"share_layers": True},
        None,
        "AlbertForPreTraining",
        ("sop",),
    ),
    "modernbert": ({"mlm": {}}, {**MODERNBERT, "type_vocab_size": 1}, None, "ModernBertForMaskedLM", ()),
    # type 0's (random, non-zero) row folded into the input table: an untied export
    "modernbert-folded-types": ({"mlm": {}}, MODERNBERT, None, "ModernBertForMaskedLM", ()),
}


@pytest.mark.parametrize("name", list(PARITY))
def test_export_parity(name, tokens, tokenizer_dir, tmp_path):
    objectives, options, arch, hf_class, extra = PARITY[name]
    model = make_model(tokens, objectives, **options)
    target = select_architecture(model, arch)
    assert target.hf_class == hf_class
    out = export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", CARD, arch=arch)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [hf_class]
    assert {"model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert f"`{hf_class}`" in (out / "README.md").read_text()
    hf = load_hf(out)  # raises on missing / unexpected weights
    diffs = compare_with_hf(model, hf, target.arch)
    print(f"\n{name} ({hf_class}): max |diff| " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert {"hidden", "logits", *extra} <= diffs.keys()
    assert max(diffs.values()) <= ATOL, diffs
    # `pretrain eval` on the export gives our logits for every architecture (ModernBERT takes no token types), and
    # its decoder runs on the scored positions alone: [M, V], never [B, L, V]
    logits_fn, _, _, _ = load_target(out)
    ids, types, mask = _probe_batch(model.config)
    types = torch.zeros_like(types) if target.arch == "modernbert" else types
    scored = mask.bool() & (torch.arange(mask.shape[1]) % 3 == 1)  # [B, L] a few real positions per row
    vocab = model.config.vocab_size
    shapes = []  # of every module output as wide as the vocabulary: the decoder's

    def record(_module, _args, output):
        if isinstance(output, torch.Tensor) and output.shape[-1] == vocab:
            shapes.append(tuple(output.shape))

    with torch.no_grad():
        expected = model.get_submodule(lm_head_name(model))(model.encoder(ids, types, mask))
        hook = torch.nn.modules.module.register_module_forward_hook(record)
        try:
            got = logits_fn(ids, types, mask, scored)
        finally:
            hook.remove()
    assert got.shape == (int(scored.sum()), vocab) and set(shapes) == {tuple(got.shape)}, shapes
    assert (got - expected[scored]).abs().max().item() <= ATOL


def test_roberta_positions_are_offset(tokens, tokenizer_dir, tmp_path):
    model = make_model(tokens, {"mlm": {}}, type_vocab_size=1)
    out = export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", CARD, arch="roberta")
    sd = load_file(out / "model.safetensors")
    table = sd["roberta.embeddings.position_embeddings.weight"]
    ours = model.encoder.embeddings.position_embeddings.weight
    offset = tokens.pad + 1
    assert table.shape[0] == ours.shape[0] + offset
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == ours.shape[0] + offset
    assert torch.equal(table[offset:], ours.detach()) and not table[:offset].any()
    # the tokenizer cuts (truncation=True) to what the table holds, not to 512 past it
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.model_max_length == ours.shape[0] < 512
    long = tokenizer(" ".join(["the people"] * 400), truncation=True)["input_ids"]
    assert len(long) == ours.shape[0]
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(out))
    assert hf(input_ids=torch.tensor([long])).logits.shape[1] == ours.shape[0]


def test_a_run_with_sentence_pairs_is_not_exported_as_roberta(tokens, tokenizer_dir, tmp_path):
    """NSP and SOP train B as type 1; RoBERTa's tokenizer returns no types, so a pair would reach the export as one
    segment while the parity check (one segment) and the pair check (no types, as RoBERTa's) both passed."""
    for objectives in ({"mlm": {}, "nsp": {}}, {"mlm": {}, "sop": {}}):
        model = make_model(tokens, objectives)
        with pytest.raises(UserError, match=r"roberta export: the run trained sentence pairs .* Export it as bert"):
            export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", CARD, arch="roberta")
        assert not (tmp_path / "hf" / "config.json").exists()


def test_modernbert_config_is_global_attention(tokens, tokenizer_dir, tmp_path):
    model = make_model(tokens, {"mlm": {}}, **MODERNBERT, type_vocab_size=1)
    with torch.no_grad():  # type 0 adds nothing (as after an import): nothing to fold, the decoder stays tied
        model.encoder.embeddings.token_type_embeddings.weight.zero_()
    out = export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", CARD)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["full_attention"] * BASE["num_layers"]
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == MODERNBERT["rope_theta"]
    assert config["tie_word_embeddings"] is True and config["norm_bias"] is False
    sd = load_file(out / "model.safetensors")
    assert "model.layers.0.attn_norm.weight" not in sd and "decoder.weight" not in sd  # Identity; tied


# ----------------------------------------------------------------------------------------------
# The dispatch and its errors


@pytest.mark.parametrize(
    "options, arch, match",
    [
        ({"norm_placement": "pre"}, None, "norm_placement=pre"),  # pre-LN with learned positions
        ({"position_embedding": "rope"}, None, "position_embedding=rope"),  # RoPE with post-LN
        ({**MODERNBERT, "use_bias": True}, None, "use_bias=true"),
        ({"embedding_size": 16}, "roberta", "albert"),
        ({}, "electra", "rtd"),
        ({}, "gpt2", "not one of"),
    ],
)
def test_options_without_hf_equivalent_are_a_clear_error(tokens, options, arch, match):
    model = make_model(tokens, {"mlm": {}}, **options)
    with pytest.raises(UserError, match=match) as err:
        select_architecture(model, arch)
    if arch is None:  # the message lists what does exist
        assert "modernbert" in str(err.value) and "albert" in str(err.value)


def test_sentence_heads_that_do_not_fit_are_noted(tokens):
    bert_sop = select_architecture(make_model(tokens, {"mlm": {}, "sop": {}}))
    assert bert_sop.hf_class == "BertForMaskedLM" and any("sop" in n for n in bert_sop.notes)
    albert_mlm = select_architecture(make_model(tokens, {"mlm": {}}, share_layers=True))
    assert albert_mlm.hf_class == "AlbertForMaskedLM" and any("AlbertForPreTraining" in n for n in albert_mlm.notes)
    assert select_architecture(make_model(tokens, {"rtd": {}})).arch == "electra"


# ----------------------------------------------------------------------------------------------
# Import: model.init_from


def _hf_checkpoint(path, hf_model) -> None:
    randomize(hf_model, seed=3)
    hf_model.save_pretrained(str(path))
    save_tokenizer(path)


HF_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    pad_token_id=0,
)
IMPORTS = {
    # name: (HF class, config, objectives, --arch for the re-export)
    "BertForPreTraining": (
        transformers.BertForPreTraining,
        transformers.BertConfig(**HF_TINY, max_position_embeddings=40),
        {"mlm": {}, "nsp": {}},
        None,
    ),
    "BertForMaskedLM": (
        transformers.BertForMaskedLM,
        transformers.BertConfig(**HF_TINY, max_position_embeddings=40),
        {"mlm": {}},
        None,
    ),
    "RobertaForMaskedLM": (
        transformers.RobertaForMaskedLM,
        transformers.RobertaConfig(**HF_TINY, max_position_embeddings=41, type_vocab_size=1),
        {"mlm": {}},
        "roberta",
    ),
    "AlbertForPreTraining": (
        transformers.AlbertForPreTraining,
        transformers.AlbertConfig(
            **HF_TINY, embedding_size=16, max_position_embeddings=40, hidden_act="gelu", classifier_dropout_prob=0.0
        ),
        {"mlm": {}, "sop": {}},
        None,
    ),
    "ModernBertForMaskedLM": (
        transformers.ModernBertForMaskedLM,
        transformers.ModernBertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=40,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=3,
            cls_token_id=2,
            sep_token_id=3,
            global_attn_every_n_layers=1,
        ),
        {"mlm": {}},
        None,
    ),
    "ElectraForMaskedLM": (
        transformers.ElectraForMaskedLM,
        transformers.ElectraConfig(**HF_TINY, embedding_size=32, max_position_embeddings=40),
        {"mlm": {}},
        None,
    ),
}


def _import(tmp_path, directory, objectives, **overrides):
    cfg = config_from_dict(
        {
            "output_dir": str(tmp_path),
            "name": "run",
            "objectives": objectives,
            "data": {"max_seq_len": 32},  # within the tiny checkpoints' 40 positions
            "model": {"init_from": str(directory), "hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides},
        }
    )  # resolved: init_from applied
    assert cfg.tokenizer_dir == directory  # init_from implies the checkpoint's tokenizer
    tokens = special_tokens(load_tokenizer(cfg.tokenizer_dir))
    return cfg, tokens, build_model(cfg, tokens).eval()


# A run config with architecture options of ours away from their defaults (a ModernBERT preset's, and more): none
# of it may reach a model imported from a checkpoint that does not have it (a BERT has no sliding window).
RUN_ARCHITECTURE = dict(
    norm_placement="pre",
    position_embedding="rope",
    rope_theta=160000.0,
    local_attention=16,
    global_every=2,
    local_rope_theta=5000.0,
    activation="geglu",
    use_bias=False,
    layer_norm_eps=1e-3,
)


@pytest.mark.parametrize("name", list(IMPORTS))
def test_import_matches_transformers_and_reexports_the_same_tensors(name, tmp_path, recwarn):
    cls, config, objectives, arch = IMPORTS[name]
    src = tmp_path / "src"
    _hf_checkpoint(src, cls(config))
    cfg, tokens, model = _import(tmp_path, src, objectives, **RUN_ARCHITECTURE)
    assert not [w for w in recwarn.list if issubclass(w.category, InitFromWarning)], [str(w.message) for w in recwarn]

    hf = load_hf(src, name)
    diffs = compare_with_hf(model, hf, config.model_type)
    print(f"\nimported {name}: max |diff| " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert max(diffs.values()) <= ATOL, diffs
    # `train --dry-run` plans the same model, from the checkpoint's config and tokenizer
    total = re.search(r"^total\s+([\d,]+)$", dry_run(cfg), re.M).group(1)
    assert int(total.replace(",", "")) == sum(p.numel() for p in model.parameters())

    if name == "ElectraForMaskedLM":
        return  # a generator imports as an MLM model; it re-exports as BERT (ELECTRA export needs an rtd run)
    out = export_pretrained(model, tokens, cfg.tokenizer_dir, tmp_path / "out", CARD, arch=arch)
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    for key in before:
        if name == "RobertaForMaskedLM" and key == "roberta.embeddings.position_embeddings.weight":
            # rows [0, pad] are unreachable for real tokens (RoBERTa numbers them from pad + 1): written as zeros
            off = hf_interop.roberta_offset(tokens.pad)
            assert torch.equal(before[key][off:], after[key][off:]) and not after[key][:off].any()
            continue
        assert torch.equal(before[key], after[key]), key
    assert json.loads((out / "config.json").read_text())["architectures"] == [name]


def test_electra_discriminator_import(tmp_path, tokens):
    """ElectraForPreTraining: the encoder of any run; its discriminator head is ours in an rtd run."""
    src = tmp_path / "src"
    config = transformers.ElectraConfig(**HF_TINY, embedding_size=32, max_position_embeddings=40)
    _hf_checkpoint(src, transformers.ElectraForPreTraining(config))
    with pytest.warns(InitFromWarning, match="heads.rtd"):  # no generator/ beside it: fresh, and said so
        _, _, model = _import(tmp_path, src, {"rtd": {}})
    hf = load_hf(src, "ElectraForPreTraining")
    ids = torch.randint(5, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        ours = model.heads["rtd"].discriminate(model.encoder(ids, None, mask))
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    assert (ours - theirs).abs().max().item() <= ATOL
    with pytest.warns(InitFromWarning) as caught:  # an mlm run: the head is fresh, the discriminator's unused
        _import(tmp_path / "mlm", src, {"mlm": {}})
    messages = " | ".join(str(w.message) for w in caught)
    assert "heads.mlm" in messages and "discriminator_predictions" in messages


def test_electra_export_imports_back_with_its_generator(tokens, tmp_path, recwarn):
    """Our ELECTRA export (discriminator + generator/) starts an rtd run whole, and re-exports identically."""
    from pretrain.hf.electra import export_electra

    src = export_electra(make_model(tokens, {"rtd": {}}), tokens, _tok(tmp_path), tmp_path / "src", CARD)
    cfg, tokens2, model = _import(tmp_path, src, {"rtd": {}})
    assert not [w for w in recwarn.list if issubclass(w.category, InitFromWarning)], [str(w.message) for w in recwarn]
    out = export_electra(model, tokens2, cfg.tokenizer_dir, tmp_path / "out", CARD)
    for sub in ("", "generator"):
        before, after = load_file(src / sub / "model.safetensors"), load_file(out / sub / "model.safetensors")
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), sub


def _tok(tmp_path):
    path = tmp_path / "tokenizer"
    save_tokenizer(path)
    return path


def test_encoder_only_checkpoint_gets_a_fresh_head_and_a_warning(tmp_path):
    src = tmp_path / "src"
    config = transformers.BertConfig(**HF_TINY, max_position_embeddings=40)
    _hf_checkpoint(src, transformers.BertModel(config))  # keys without the bert. prefix, with a pooler
    with pytest.warns(InitFromWarning) as caught:
        _, _, model = _import(tmp_path, src, {"mlm": {}})
    messages = " | ".join(str(w.message) for w in caught)
    assert "heads.mlm" in messages and "freshly initialised" in messages and "pooler" in messages
    sd = load_file(src / "model.safetensors")
    assert torch.equal(model.encoder.embeddings.word_embeddings.weight, sd["embeddings.word_embeddings.weight"])
    assert not model.heads["mlm"].bias.any()  # the fresh head's init


def test_import_errors_are_clear(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        _import(tmp_path, tmp_path / "nothing", {"mlm": {}})
    src = tmp_path / "local"
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=48,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        cls_token_id=2,
        sep_token_id=3,
        global_attn_every_n_layers=3,
    )
    # a layout "every n-th layer global" cannot express: a sliding first layer
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    _hf_checkpoint(src, transformers.ModernBertForMaskedLM(config))
    with pytest.raises(UserError, match="layer_types"):
        _import(tmp_path, src, {"mlm": {}})
    # the MLM head's activation is a key of its own in ModernBERT: it was not read, and SiLU ran as GELU
    config.layer_types = ["full_attention"] * 3
    for act, refused in (("silu", True), ("gelu_pytorch_tanh", False)):
        config.classifier_activation = act
        _hf_checkpoint(src, transformers.ModernBertForMaskedLM(config))
        if refused:
            with pytest.raises(UserError, match=f"classifier_activation '{act}' has no equivalent here"):
                _import(tmp_path, src, {"mlm": {}})
        else:
            with pytest.warns(InitFromWarning, match=f"classifier_activation '{act}' is the tanh approximation"):
                _import(tmp_path, src, {"mlm": {}})


UNTIED = {  # a checkpoint of each kind whose MLM decoder holds values of its own (tie_word_embeddings=false)
    "bert": (transformers.BertForMaskedLM, transformers.BertConfig(**HF_TINY, max_position_embeddings=40)),
    "roberta": (
        transformers.RobertaForMaskedLM,
        transformers.RobertaConfig(**HF_TINY, max_position_embeddings=41, type_vocab_size=1),
    ),
    "albert": (
        transformers.AlbertForMaskedLM,
        transformers.AlbertConfig(**HF_TINY, embedding_size=16, max_position_embeddings=40, hidden_act="gelu"),
    ),
    "electra": (
        transformers.ElectraForMaskedLM,
        transformers.ElectraConfig(**HF_TINY, embedding_size=32, max_position_embeddings=40),
    ),
}


@pytest.mark.parametrize("name", list(UNTIED))
def test_an_untied_decoder_is_refused_rather_than_dropped(name, tmp_path):
    """Ours decodes with the input embeddings: the checkpoint's own decoder was counted as tied and dropped, the
    MLM logits then off by ~10 with no word."""
    cls, config = UNTIED[name]
    config.tie_word_embeddings = False
    _hf_checkpoint(tmp_path / "src", cls(config))
    with pytest.raises(UserError, match="decoder .* is not tied to its input embeddings"):
        _import(tmp_path, tmp_path / "src", {"mlm": {}})


def test_an_electra_generator_computing_otherwise_is_refused(tokens, tmp_path):
    """Only the generator's depth and width were compared: another head count, activation or epsilon loaded into
    same-shaped weights and computed something else."""
    from pretrain.hf.electra import export_electra

    src = export_electra(make_model(tokens, {"rtd": {}}), tokens, _tok(tmp_path), tmp_path / "src", CARD)
    config_file = src / "generator" / "config.json"
    saved = json.loads(config_file.read_text())
    for key, value, match in (
        ("num_attention_heads", saved["num_attention_heads"] * 2, "num_attention_heads"),
        ("layer_norm_eps", 1e-3, "layer_norm_eps"),
        ("hidden_act", "relu", "hidden_act 'relu' has no equivalent"),
    ):
        config_file.write_text(json.dumps({**saved, key: value}))
        with pytest.raises(UserError, match=match):
            _import(tmp_path / key, src, {"rtd": {}})


def test_checkpoint_settings_the_run_cannot_honour_are_refused_before_anything_runs(tmp_path):
    """Each was accepted, then dropped (a biased ModernBERT head: logits off by 2.6) or failed at the first forward
    with a bare IndexError, after the tokenizer and shards were built."""
    modern = dict(IMPORTS["ModernBertForMaskedLM"][1].to_dict(), classifier_bias=True)
    _hf_checkpoint(tmp_path / "modern", transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**modern)))
    with pytest.raises(UserError, match="'classifier_bias': True"):
        _import(tmp_path, tmp_path / "modern", {"mlm": {}})
    bert = tmp_path / "bert"
    _hf_checkpoint(bert, transformers.BertForMaskedLM(transformers.BertConfig(**HF_TINY, max_position_embeddings=40)))
    spec = {"output_dir": str(tmp_path), "objectives": {"mlm": {}}, "model": {"init_from": str(bert)}}
    with pytest.raises(ConfigError, match=r"checkpoint's architecture, data.max_seq_len \(64\) exceeds .*\(40\)"):
        config_from_dict({**spec, "data": {"max_seq_len": 64}})
    roberta = tmp_path / "roberta"
    _hf_checkpoint(roberta, transformers.RobertaForMaskedLM(UNTIED["roberta"][1]))
    pairs = {**spec, "model": {"init_from": str(roberta)}, "data": {"max_seq_len": 32}}
    with pytest.raises(ConfigError, match=r"nsp build segment pairs.*type_vocab_size is 1 \(the checkpoint's"):
        config_from_dict({**pairs, "objectives": {"mlm": {}, "nsp": {}}})
    with pytest.raises(ConfigError, match="sop build segment pairs"):  # the run's own model too
        config_from_dict({"output_dir": str(tmp_path), "objectives": {"sop": {}}, "model": {"type_vocab_size": 1}})


def test_a_tokenizer_numbering_tokens_otherwise_than_the_checkpoints_is_said(tmp_path, recwarn):
    """Same size, same pad id: passed unsaid, every embedding row then another token's."""
    src = tmp_path / "src"
    _hf_checkpoint(src, transformers.BertForMaskedLM(IMPORTS["BertForMaskedLM"][1]))
    _import(
        tmp_path / "same",
        src,
        {"mlm": {}},
    )
    assert not [w for w in recwarn.list if "another id" in str(w.message)]
    shuffled = tmp_path / "shuffled"
    vocab = _vocab()
    vocab[5:10] = reversed(vocab[5:10])  # five words renumbered; specials (and so the pad id) kept
    transformers.BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}).save_pretrained(str(shuffled))
    spec = {"output_dir": str(tmp_path), "objectives": {"mlm": {}}, "data": {"max_seq_len": 32}}
    cfg = config_from_dict(
        {**spec, "model": {"init_from": str(src)}, "data": {**spec["data"], "tokenizer": str(shuffled)}}
    )
    tokens = special_tokens(load_tokenizer(cfg.tokenizer_dir))
    with pytest.warns(InitFromWarning, match=r"4 of the 128 tokens of this run's tokenizer .* have another id"):
        build_model(cfg, tokens)
    # a checkpoint with only the slow tokenizer's files, and no data.tokenizer: named, not a dead end later
    (src / "tokenizer.json").unlink()
    (src / "vocab.txt").write_text("\n".join(_vocab()) + "\n")  # as transformers 4 and older repos keep it
    cfg = config_from_dict({**spec, "model": {"init_from": str(src)}})
    assert "# memory per device" in dry_run(cfg)  # planning needs no tokenizer
    with pytest.raises(UserError, match=r"has no tokenizer.json \(only \['vocab.txt'\]\): set data.tokenizer"):
        stage_tokenizer(cfg)  # where it went on to train one into the checkpoint's directory


# ----------------------------------------------------------------------------------------------
# --push-to-hub


@pytest.fixture()
def stage_inputs(tokens, tokenizer_dir, tmp_path, monkeypatch):
    from pretrain import pipeline as stages

    cfg = config_from_dict({"output_dir": str(tmp_path), "name": "run", "objectives": {"mlm": {}}})
    model = make_model(tokens, {"mlm": {}})
    monkeypatch.setattr(
        stages,
        "load_checkpoint_model",
        lambda path, ema=True: (cfg, model, tokens, tokenizer_dir, {"step": 3, "tokens_seen": 99}),
    )
    return stages, cfg


def test_push_without_token_fails_before_exporting(stage_inputs, monkeypatch):
    import huggingface_hub

    stages, cfg = stage_inputs
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(UserError, match="HF_TOKEN"):
        stages.stage_export(cfg.run_dir, push_to_hub="someone/tiny-bert")
    assert not cfg.hf_dir.exists()


def test_push_uploads_the_export_dir(stage_inputs, monkeypatch):
    import huggingface_hub

    stages, cfg = stage_inputs
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, **kwargs):
            calls.append(("create_repo", kwargs))

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs))

    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    demo = stages.stage_export(cfg.run_dir, arch="roberta", push_to_hub="someone/tiny-roberta")
    assert demo == cfg.hf_dir
    assert calls[0] == ("init", "hf_test_token")
    upload = dict(calls)["upload_folder"]
    assert upload["repo_id"] == "someone/tiny-roberta" and upload["folder_path"] == str(cfg.hf_dir)
    assert upload["repo_type"] == "model" and upload["revision"] is None
    assert dict(calls)["create_repo"]["private"] is None  # the Hub's default: public
    # files of ours this export does not write (an earlier ELECTRA export's generator/) go in the same commit
    assert "generator/config.json" in upload["delete_patterns"]
    assert upload["delete_patterns"] == upload["allow_patterns"]
    assert json.loads((cfg.hf_dir / "config.json").read_text())["architectures"] == ["RobertaForMaskedLM"]


def test_push_sends_only_what_an_export_writes(tmp_path):
    """The files the Hub client would take (its own matcher, on the patterns the push gives), from an ELECTRA-like
    export holding the user's files beside its own: 'generator/*' matched the user's notes in generator/ at any depth
    (fnmatch's '*' crosses '/'), which re-exports keep there, so they went up to a repo that may be public."""
    from huggingface_hub.utils import filter_repo_objects

    from pretrain.core.outputs import MARKER
    from pretrain.hf.export import EXPORT_ENTRIES
    from pretrain.hf.hub import upload_patterns

    ours = ["config.json", "model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json"]
    ours += [f"generator/{name}" for name in ours]
    mine = ["notes.txt", "finetuned/config.json", "generator/notes.txt", "generator/drafts/config.json", MARKER]
    mine += ["generator/.lock", f"generator/{MARKER}"]
    for path in ours + mine:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    present = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    sent = list(filter_repo_objects(present, allow_patterns=upload_patterns(EXPORT_ENTRIES)))
    assert sorted(sent) == sorted(ours)


def test_cli_export_flags():
    from pretrain.cli import build_parser

    args = build_parser().parse_args(["export", "runs/x", "--arch", "roberta", "--push-to-hub", "me/x"])
    assert (args.arch, args.push_to_hub) == ("roberta", "me/x")
