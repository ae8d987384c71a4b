"""HF export: transformers loads it cleanly, reproduces our logits, runs fill-mask; the export is atomic."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file

from objectives import build_objectives
from pretrain.core.config import ModelConfig
from pretrain.hf.export import export_pretrained, verify_export
from pretrain.hf.init_from import load_init_from
from pretrain.hf.interop import to_hf_state_dict
from pretrain.model.pretraining import PretrainingModel

VOCAB = 128  # = conftest.TINY_VOCAB, which the `tokens` fixture uses
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = "the a of and to in is was we our nation people government freedom liberty union states".split()
CARD = {
    "objectives": ["mlm"],
    "corpus": "data/us-speeches.public-domain.jsonl",
    "tokens_seen": 123456,
    "steps": 789,
    "final_loss": 4.2512,
    "config": {"model": {"hidden_size": 32}},
    "run_name": "tiny",
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A WordPiece tokenizer with our special-token ids, padded to VOCAB like the real pipeline does."""
    chars = sorted(set("".join(WORDS)))
    vocab = SPECIALS + WORDS + chars + [f"##{c}" for c in chars]
    vocab += [f"[unused{i}]" for i in range(VOCAB - len(vocab))]
    assert len(vocab) == VOCAB
    path = tmp_path_factory.mktemp("tokenizer")
    transformers.BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def model(tokens) -> PretrainingModel:
    cfg = ModelConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_position_embeddings=64
    )
    torch.manual_seed(0)
    m = PretrainingModel(cfg, build_objectives({"mlm": {}}, tokens))
    # The init has zero biases and unit LayerNorms, which would hide a swapped or dropped tensor.
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m.eval()


@pytest.fixture(scope="module")
def export_dir(model, tokens, tokenizer_dir, tmp_path_factory):
    return export_pretrained(model, tokens, tokenizer_dir, tmp_path_factory.mktemp("runs") / "hf", CARD)


def test_transformers_loads_export_and_matches_logits(model, export_dir):
    hf, info = transformers.AutoModelForMaskedLM.from_pretrained(str(export_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert hf.config.architectures == ["BertForMaskedLM"]
    assert json.loads((export_dir / "config.json").read_text())["hidden_act"] == "gelu"
    # the tokenizer's model_max_length is the position table's (64), not the 512 the tokenizer was saved with
    assert transformers.AutoTokenizer.from_pretrained(str(export_dir)).model_max_length == 64
    # verify_export uses a batch with padding (attention_mask zeros) and both token types
    assert verify_export(model, export_dir, atol=1e-4) <= 1e-4
    assert model.training is False and next(model.parameters()).dtype == torch.float32  # caller's model untouched


def test_verify_export_leaves_bf16_training_model_alone(model, export_dir):
    half = PretrainingModel(model.config, model.objectives)
    half.load_state_dict(model.state_dict())
    half.to(torch.bfloat16).train()
    verify_export(half, export_dir, atol=1.0)  # bf16 weights are rounded: only the mechanics are checked here
    assert half.training and next(half.parameters()).dtype == torch.bfloat16


def test_fill_mask_pipeline_runs(export_dir):
    fill = transformers.pipeline("fill-mask", model=str(export_dir))
    preds = fill(f"the people of the {fill.tokenizer.mask_token} states", top_k=3)
    assert len(preds) == 3 and all("token_str" in p and "score" in p for p in preds)


def test_model_card_states_training_facts(export_dir):
    text = (export_dir / "README.md").read_text()
    assert text.startswith("---\n") and "library_name: transformers" in text and "pipeline_tag: fill-mask" in text
    assert "license" not in text.split("---")[1]  # no license given: none claimed
    assert "language" not in text.split("---")[1]  # nor a language: it said en whatever the corpus was
    assert "Data provenance" not in text  # nothing recorded: no line (it said "unknown" on every export)
    for fact in ("mlm", "789", "123,456", "4.2512", "us-speeches", 'pipeline("fill-mask"'):
        assert fact in text, fact


def test_hf_to_ours_to_hf_round_trip(model, export_dir):
    hf_sd = load_file(export_dir / "model.safetensors")
    assert "cls.predictions.decoder.weight" not in hf_sd  # tied: transformers re-ties it on load
    torch.manual_seed(99)
    fresh = PretrainingModel(model.config, model.objectives)
    assert load_init_from(fresh, export_dir) == {"fresh": [], "unused": []}  # the import `model.init_from` runs
    assert fresh.heads["mlm"].decoder_weight is fresh.encoder.embeddings.word_embeddings.weight  # still tied
    again = to_hf_state_dict(fresh, "bert")
    assert again.keys() == hf_sd.keys()
    for name, tensor in hf_sd.items():
        assert torch.equal(again[name], tensor), name
    # ours -> hf -> ours is exact too, qkv split and re-fused included
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_config_fields_logits_cannot_show_round_trip(tokens, tokenizer_dir, tmp_path):
    """layer_norm_eps and the dropouts leave eval logits at this scale alike, so parity cannot see them: an export
    writing another eps (1e-5 for 1e-12) or dropout, or an import reading another eps, passed every parity test."""
    from pretrain.hf.init_from import model_config_from_hf, read_hf_config

    cfg = ModelConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, max_position_embeddings=64
    )
    cfg = replace(cfg, layer_norm_eps=1e-7, hidden_dropout=0.05, attention_dropout=0.07)
    out = export_pretrained(
        PretrainingModel(cfg, build_objectives({"mlm": {}}, tokens)), tokens, tokenizer_dir, tmp_path / "hf", {}
    )
    written = json.loads((out / "config.json").read_text())
    assert (written["layer_norm_eps"], written["hidden_dropout_prob"], written["attention_probs_dropout_prob"]) == (
        1e-7,
        0.05,
        0.07,
    )
    imported = model_config_from_hf(read_hf_config(out), ModelConfig())
    assert imported.layer_norm_eps == 1e-7  # the weights' meaning; dropout stays the importing run's own
    assert (imported.hidden_dropout, imported.attention_dropout) == (ModelConfig().hidden_dropout,) * 2


def test_export_over_existing_dir_replaces_only_its_files(model, tokens, tokenizer_dir, tmp_path):
    out = tmp_path / "hf"
    export_pretrained(model, tokens, tokenizer_dir, out, {})
    (out / "stale.txt").write_text("from an older export")
    (tmp_path / ".tmp-hf").mkdir()  # as if an earlier export had crashed half-way
    result = export_pretrained(model, tokens, tokenizer_dir, out, CARD)
    assert result == out and (out / "stale.txt").read_text() == "from an older export"  # kept: not the export's
    assert "789" in (out / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no .tmp- or .old- leftovers
    assert {"config.json", "model.safetensors", "README.md", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}


def test_the_exported_tokenizer_names_a_class_transformers_4_knows(model, tokens, tokenizer_dir, tmp_path):
    """transformers 5 saves its generic tokenizer as TokenizersBackend, which transformers 4's AutoTokenizer cannot
    find: the export names it PreTrainedTokenizerFast (the same class in 5), and encodes as the run's tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    run_tokenizer = shutil.copytree(tokenizer_dir, tmp_path / "tokenizer")
    config = json.loads((run_tokenizer / "tokenizer_config.json").read_text())
    (run_tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "TokenizersBackend"}))
    ours = AutoTokenizer.from_pretrained(run_tokenizer)
    assert type(ours).__name__ == "TokenizersBackend"  # what train_tokenizer saves under transformers 5
    out = export_pretrained(model, tokens, run_tokenizer, tmp_path / "hf", {})
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    theirs = AutoTokenizer.from_pretrained(out)
    text = ("The union of the states [MASK] one.", "A second segment.")
    assert ours(*text)["input_ids"] == theirs(*text)["input_ids"] and theirs.mask_token == "[MASK]"


def test_card_gives_the_checkpoints_record_of_its_data(model, tokens, tokenizer_dir, tmp_path):
    """The card's data provenance is the hashes the checkpoint's fingerprint holds, not a line saying "unknown"."""
    from pretrain.pipeline import export_card
    from pretrain.train.fingerprint import DATA_KEY, TOKENIZER_KEY
    from pretrain.train.setup import load_config

    state = {"step": 7, "tokens_seen": 99, "fingerprint": {DATA_KEY: "d" * 64, TOKENIZER_KEY: "t" * 64}}
    card = export_card(load_config("tiny"), model, state, "tiny", [])
    text = (export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", card) / "README.md").read_text()
    assert f"- Data provenance: sha256 of the shards' content {'d' * 64}; sha256 of tokenizer.json {'t' * 64}" in text
    assert "language" not in text.split("---")[1]
    assert "- Data: data/us-speeches.public-domain.jsonl\n" in text  # relative: as the config has it
    # an absolute path by its last part: a card goes to the Hub as written, and /home/<user>/... is not for it
    private = load_config("tiny", [f"data.corpus={tmp_path}/private/speeches.jsonl"])
    text = (
        export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", export_card(private, model, state, "t", []))
        / "README.md"
    ).read_text()
    assert "- Data: speeches.jsonl\n" in text and str(tmp_path) not in text  # the config's copy too
    # files of one name: as many of their last parts as tell them apart
    two = load_config("tiny", [f"data.corpus=[{tmp_path}/en/train.jsonl,{tmp_path}/de/train.jsonl]"])
    text = (
        export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", export_card(two, model, state, "t", []))
        / "README.md"
    ).read_text()
    assert "- Data: en/train.jsonl, de/train.jsonl\n" in text and str(tmp_path) not in text
    # a checkpoint saved between log lines (step 7; lines at 4 and 6): the loss is the last line's, and says whose
    history = [{"step": 4, "loss": 6.5}, {"step": 6, "loss": 6.25}]
    card = export_card(load_config("tiny"), model, state, "tiny", history)
    text = (export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", card) / "README.md").read_text()
    assert "- Final loss: 6.2500 (the last log line before the checkpoint, at step 6)" in text
    card = export_card(load_config("tiny"), model, {**state, "step": 6}, "tiny", history)
    text = (export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", card) / "README.md").read_text()
    assert "- Final loss: 6.2500\n" in text


def test_minimal_card_says_unknown(model, tokens, tokenizer_dir, tmp_path):
    text = (export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", {}) / "README.md").read_text()
    assert "Steps: unknown" in text and "Tokens seen: unknown" in text and "Final loss: unknown" in text


def test_verify_export_catches_a_wrong_weight(model, tokens, tokenizer_dir, tmp_path):
    from safetensors.torch import save_file

    from pretrain.hf.export import ExportError

    out = export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", CARD)
    sd = load_file(out / "model.safetensors")
    sd["bert.encoder.layer.1.attention.self.value.weight"] *= 1.1  # (a key bias would cancel in softmax)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match="differ"):
        verify_export(model, out)
    del sd["cls.predictions.bias"]
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match="missing_keys"):
        verify_export(model, out)


def test_card_lists_objective_options(model, tokens, tokenizer_dir, tmp_path):
    card = {**CARD, "objectives": {"mlm": {"weight": 1.0, "mask_prob": 0.15}}, "license": "mit"}
    text = (export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", card) / "README.md").read_text()
    assert "mlm (weight=1.0, mask_prob=0.15)" in text and "license: mit" in text and "- mlm" in text


def test_an_unpadded_model_exports_and_verifies_on_real_tokens(model, tokens, tokenizer_dir, tmp_path):
    """model.unpadded leaves zeros at padding, where transformers computes values nothing reads: the parity check
    compares real tokens there (it refused every unpadded run's export), and still catches a wrong weight."""
    from dataclasses import replace

    from safetensors.torch import save_file

    from pretrain.hf.export import ExportError

    unpadded = PretrainingModel(replace(model.config, unpadded=True), model.objectives)
    unpadded.load_state_dict(model.state_dict())
    out = export_pretrained(unpadded.eval(), tokens, tokenizer_dir, tmp_path / "hf", CARD)
    assert verify_export(unpadded, out) < 1e-4
    sd = load_file(out / "model.safetensors")
    sd["bert.encoder.layer.1.attention.self.value.weight"] *= 1.1
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match="differ"):
        verify_export(unpadded, out)
