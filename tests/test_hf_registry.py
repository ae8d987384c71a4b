"""The HF architecture registry: it lists the architectures we know, an unknown name is a clear error naming the
choices, and an architecture registered from outside the package (here a renamed BERT with its own transformers
config and class) exports, passes its parity check and imports back, with nothing else changed."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from objectives import build_objectives
from pretrain.core.config import ModelConfig
from pretrain.core.errors import UserError
from pretrain.hf import architectures
from pretrain.hf.architectures.bert import BERT
from pretrain.hf.export import export_pretrained, verify_parts
from pretrain.hf.init_from import load_init_from, model_config_from_hf, read_hf_config
from pretrain.hf.interop import select_architecture, to_hf_state_dict
from pretrain.hf.parity import compare_with_hf, load_checked
from pretrain.model.pretraining import PretrainingModel

pytestmark = pytest.mark.usefixtures("one_thread")
CARD = {"objectives": ["mlm"], "corpus": "tiny", "tokens_seen": 10, "steps": 1, "final_loss": 1.0, "run_name": "t"}
TINY = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48)
TINY.update(max_position_embeddings=40, hidden_dropout=0.0, attention_dropout=0.0)


def make_model(tokens, seed=0) -> PretrainingModel:
    torch.manual_seed(seed)
    model = PretrainingModel(ModelConfig(**TINY), build_objectives({"mlm": {}}, tokens))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # all random: init values (zero biases, unit norms) would hide a dropped tensor
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(123)]
    transformers.BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}).save_pretrained(str(path))
    return path


# ----------------------------------------------------------------------------------------------
# A toy architecture, registered from outside the package: BERT's weights under another model_type and class


class ToyConfig(transformers.BertConfig):
    model_type = "toybert"


class ToyForMaskedLM(transformers.BertForMaskedLM):
    config_class = ToyConfig


def _toy_config(model, target, tokens):
    return ToyConfig(**BERT.to_config(model, target, tokens).to_dict())


def _toy_verify(model, directory):
    return compare_with_hf(model, load_checked(ToyForMaskedLM, directory), "toybert")


TOY = dataclasses.replace(
    BERT,
    name="toybert",
    title="ToyBERT",
    target=lambda model: dataclasses.replace(BERT.target(model), arch="toybert", hf_class="ToyForMaskedLM"),
    to_config=_toy_config,
    verify=_toy_verify,
)


@pytest.fixture()
def toy():
    transformers.AutoConfig.register("toybert", ToyConfig, exist_ok=True)
    architectures.register(TOY)
    yield TOY
    architectures.unregister("toybert")


def test_registry_lists_the_known_architectures():
    assert {"bert", "roberta", "albert", "electra", "modernbert"} <= set(architectures.names())
    for name in architectures.names():
        record = architectures.get(name)
        assert record.name == name and record.title and record.prefix and record.computes


def test_unknown_architecture_names_the_choices(tokens):
    with pytest.raises(UserError, match="gpt2: not one of bert, roberta, albert, electra, modernbert"):
        architectures.get("gpt2")
    with pytest.raises(UserError, match="not one of .*modernbert"):
        select_architecture(make_model(tokens), "gpt2")


def test_registering_twice_under_one_name_is_refused(toy):
    with pytest.raises(ValueError, match="toybert"):
        architectures.register(dataclasses.replace(TOY))


def test_toy_architecture_round_trips_with_parity(toy, tokens, tokenizer_dir, tmp_path):
    model = make_model(tokens)
    assert select_architecture(model).arch == "bert"  # an unclaiming architecture is chosen only on request
    target = select_architecture(model, "toybert")
    assert (target.arch, target.hf_class) == ("toybert", "ToyForMaskedLM")
    out = export_pretrained(model, tokens, tokenizer_dir, tmp_path / "hf", CARD, arch="toybert")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "toybert" and config["architectures"] == ["ToyForMaskedLM"]
    assert "A ToyBERT encoder" in (out / "README.md").read_text()
    diffs = verify_parts(model, out, "toybert")
    assert max(diffs.values()) <= 1e-4, diffs

    hf_cfg = read_hf_config(out)
    assert isinstance(hf_cfg, ToyConfig)
    fresh = PretrainingModel(model_config_from_hf(hf_cfg, ModelConfig(**TINY)), model.objectives).eval()
    report = load_init_from(fresh, out)
    assert report == {"fresh": [], "unused": []}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name
    again = to_hf_state_dict(fresh, "toybert")
    written = load_file(out / "model.safetensors")
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)


def test_cli_arch_choices_follow_the_registry(toy):
    from pretrain.cli import build_parser

    assert build_parser().parse_args(["export", "runs/x", "--arch", "toybert"]).arch == "toybert"
    architectures.unregister("toybert")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "runs/x", "--arch", "toybert"])
