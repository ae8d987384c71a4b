"""sentence-transformers export: SentenceTransformer loads the directory offline, and its embeddings of a padded batch
are our encoder's pooled states (mean over real tokens or [CLS], normalised when asked), for each architecture."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import transformers

from objectives import build_objectives
from pretrain.core.config import ModelConfig
from pretrain.core.errors import UserError
from pretrain.hf.electra import export_electra
from pretrain.hf.export import export_pretrained
from pretrain.hf.sentence_transformers import export_sentence_transformers
from pretrain.model.pretraining import PretrainingModel

sentence_transformers = pytest.importorskip("sentence_transformers")  # the `test` extra installs it

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 128  # = conftest.TINY_VOCAB, which the `tokens` fixture uses
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = "the a of and to in is was we our nation people government freedom liberty union states".split()
CARD = {"objectives": ["mlm"], "corpus": "tiny", "tokens_seen": 10, "steps": 1, "final_loss": 1.0, "run_name": "t"}
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
MODERNBERT = dict(norm_placement="pre", position_embedding="rope", activation="geglu", use_bias=False)
# Different lengths, so the batch SentenceTransformer encodes is padded
SENTENCES = [
    "we the people",
    "the government of the people and the union of states was our freedom",
    "liberty",
    "a nation in liberty is a nation of freedom",
]
# name: objectives, model options, --arch
ARCHS = {
    "bert": ({"mlm": {}}, {}, None),
    "bert-pretraining": ({"mlm": {}, "nsp": {}}, {}, None),  # its export has a pooler, which is left out
    "roberta": ({"mlm": {}}, {"type_vocab_size": 1}, "roberta"),
    "albert": ({"mlm": {}, "sop": {}}, {"embedding_size": 16, "share_layers": True}, None),
    "modernbert": ({"mlm": {}}, {**MODERNBERT, "type_vocab_size": 1}, None),
    "electra": ({"rtd": {}}, {}, None),  # the discriminator's directory
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    chars = sorted(set("".join(WORDS)) - set(WORDS))
    vocab = SPECIALS + WORDS + chars + [f"##{c}" for c in sorted(set("".join(WORDS)))]
    vocab += [f"[unused{i}]" for i in range(VOCAB - len(vocab))]
    path = tmp_path_factory.mktemp("tokenizer")
    transformers.BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}).save_pretrained(str(path))
    return path


def make_model(tokens, objectives, **options) -> PretrainingModel:
    torch.manual_seed(0)
    model = PretrainingModel(ModelConfig(**{**BASE, **options}), build_objectives(objectives, tokens))
    with torch.no_grad():  # zero biases and unit LayerNorms (the init) would hide a dropped or swapped tensor
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return model.eval()


def export(name, tokens, tokenizer_dir, out):
    objectives, options, arch = ARCHS[name]
    model = make_model(tokens, objectives, **options)
    if "rtd" in objectives:
        return model, export_electra(model, tokens, tokenizer_dir, out, CARD)
    return model, export_pretrained(model, tokens, tokenizer_dir, out, CARD, arch=arch)


@torch.no_grad()
def our_embeddings(model, hf_dir, sentences, pooling, normalize) -> torch.Tensor:
    """Our encoder on the batch the export's tokenizer makes (padded to the longest), pooled as asked."""
    batch = transformers.AutoTokenizer.from_pretrained(str(hf_dir))(sentences, padding=True, return_tensors="pt")
    mask = batch["attention_mask"]
    assert (mask == 0).any(), "the batch should have padding"
    types = batch.get("token_type_ids", torch.zeros_like(mask))
    hidden = model.encoder(batch["input_ids"], types, mask)
    if pooling == "mean":
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    else:
        pooled = hidden[:, 0]
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def encode(directory, sentences) -> torch.Tensor:
    model = sentence_transformers.SentenceTransformer(str(directory), device="cpu")
    return model.encode(sentences, batch_size=len(sentences), convert_to_tensor=True)


@pytest.mark.parametrize(
    "name,pooling,normalize",
    [
        ("bert", "mean", False),
        ("bert", "cls", False),
        ("bert", "mean", True),
        ("bert-pretraining", "cls", True),
        ("roberta", "mean", False),
        ("albert", "mean", False),
        ("modernbert", "mean", False),
        ("electra", "cls", False),
    ],
)
def test_embeddings_match_our_encoder(name, pooling, normalize, tokens, tokenizer_dir, tmp_path, monkeypatch):
    connections = []

    def no_network(sock, address):  # loading must not reach for the Hub
        connections.append(address)
        raise OSError(f"no network in this test (tried {address})")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    model, hf_dir = export(name, tokens, tokenizer_dir, tmp_path / "hf")
    out = export_sentence_transformers(hf_dir, tmp_path / "st", pooling=pooling, normalize=normalize)

    modules = json.loads((out / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling", *(["2_Normalize"] if normalize else [])]
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["word_embedding_dimension"] == 32
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] <= 40
    card = (out / "README.md").read_text()
    assert "# t\n" in card and "SentenceTransformer(" in card  # titled with the run's name, as the export's card
    assert not (out / "generator").exists()

    got = encode(out, SENTENCES)
    expected = our_embeddings(model, hf_dir, SENTENCES, pooling, normalize)
    assert got.shape == expected.shape == (len(SENTENCES), 32)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    # one sentence alone (no padding) embeds the same as within the padded batch
    assert torch.allclose(encode(out, SENTENCES[:1])[0], got[0], atol=1e-5, rtol=0)
    assert connections == []


@pytest.mark.parametrize("name", ["bert-pretraining", "electra"])
def test_encoder_loads_without_missing_or_unexpected_weights(name, tokens, tokenizer_dir, tmp_path):
    _, hf_dir = export(name, tokens, tokenizer_dir, tmp_path / "hf")
    out = export_sentence_transformers(hf_dir, tmp_path / "st")
    model_args = json.loads((out / "sentence_bert_config.json").read_text()).get("model_args", {})
    _, info = transformers.AutoModel.from_pretrained(str(out), output_loading_info=True, **model_args)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_max_seq_length_truncates(tokens, tokenizer_dir, tmp_path):
    _, hf_dir = export("bert", tokens, tokenizer_dir, tmp_path / "hf")
    out = export_sentence_transformers(hf_dir, tmp_path / "st", max_seq_length=8)
    model = sentence_transformers.SentenceTransformer(str(out), device="cpu")
    assert model.max_seq_length == 8
    with pytest.raises(UserError, match="outside 2..40"):
        export_sentence_transformers(hf_dir, tmp_path / "st2", max_seq_length=41)


def test_refusals(tokens, tokenizer_dir, tmp_path):
    _, hf_dir = export("bert", tokens, tokenizer_dir, tmp_path / "hf")
    with pytest.raises(UserError, match="pooling 'max' is not one of mean, cls"):
        export_sentence_transformers(hf_dir, tmp_path / "st", pooling="max")
    with pytest.raises(UserError, match=f"{tokenizer_dir} is not an exported HuggingFace model directory"):
        export_sentence_transformers(tokenizer_dir, tmp_path / "st")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="notes.txt"):
        export_sentence_transformers(hf_dir, foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    with pytest.raises(UserError, match="an input of this command"):
        export_sentence_transformers(hf_dir, tmp_path)  # would hold the export it reads
    # a second conversion replaces the first one, which is ours
    first = export_sentence_transformers(hf_dir, tmp_path / "st", normalize=True)
    assert (first / "2_Normalize").is_dir()
    again = export_sentence_transformers(hf_dir, tmp_path / "st", pooling="cls")
    assert again == first and not (again / "2_Normalize").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_a_conversion_again_keeps_the_users_files_and_writes_through_a_link(tokens, tokenizer_dir, tmp_path):
    """A conversion replaces its own entries only, as an export does: the user's evaluation folder and notes (beside
    ours, and inside 1_Pooling) stay. A symlinked output is written through, the link kept, every time; the link an
    older version renamed aside (`.old-NAME`) is left alone and in nobody's way."""
    _, hf_dir = export("bert", tokens, tokenizer_dir, tmp_path / "hf")
    out = export_sentence_transformers(hf_dir, tmp_path / "st", normalize=True)
    (out / "my-eval").mkdir()
    (out / "my-eval" / "scores.txt").write_text("0.81")
    (out / "1_Pooling" / "why.txt").write_text("mean pooling")
    again = export_sentence_transformers(hf_dir, out, pooling="cls")
    assert (again / "my-eval" / "scores.txt").read_text() == "0.81"
    assert (again / "1_Pooling" / "why.txt").read_text() == "mean pooling"
    assert json.loads((again / "1_Pooling" / "config.json").read_text())["pooling_mode_cls_token"]
    assert not (again / "2_Normalize").exists()
    assert sentence_transformers.SentenceTransformer(str(again), device="cpu").encode(SENTENCES[:2]).shape[0] == 2

    storage, link = tmp_path / "storage", tmp_path / "links" / "st"
    storage.mkdir()
    link.parent.mkdir()
    link.symlink_to(storage)
    (link.parent / ".old-st").symlink_to(storage)  # what the swapping version left after failing on a link
    for pooling in ("mean", "cls"):
        assert export_sentence_transformers(hf_dir, link, pooling=pooling) == storage
        assert link.is_symlink() and (storage / "modules.json").is_file()
    assert (link.parent / ".old-st").is_symlink() and sorted(p.name for p in link.parent.iterdir()) == [".old-st", "st"]


@pytest.mark.slow
def test_export_format_flag_through_the_cli(tmp_path):
    """`pretrain export RUN --format sentence-transformers`: beside the HF export, truncating at the run's length,
    and the same embeddings as the HF export's encoder under the chosen pooling."""
    from helpers import run_args, run_cli, small_corpus

    run_cli("run", *run_args(tmp_path, small_corpus(tmp_path)), "--no-demo", cwd=tmp_path)
    proc = run_cli("export", tmp_path / "r", "--format", "sentence-transformers", "--pooling", "cls", cwd=tmp_path)
    st_dir = tmp_path / "r" / "sentence-transformers"
    assert str(st_dir) in proc.stderr
    model = sentence_transformers.SentenceTransformer(str(st_dir), device="cpu")
    assert model.max_seq_length == 64  # the tiny preset's data.max_seq_len
    hf = transformers.AutoModel.from_pretrained(str(tmp_path / "r" / "hf")).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "r" / "hf"))
    batch = tok(SENTENCES[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        cls = hf(**batch).last_hidden_state[:, 0]
    torch.testing.assert_close(torch.from_numpy(model.encode(SENTENCES[:2])), cls, rtol=1e-4, atol=1e-5)
    push_the_converted_directory(tmp_path / "r", st_dir)


def push_the_converted_directory(run, st_dir):
    """--push-to-hub with --format sentence-transformers uploads the converted directory (it uploaded the
    transformers export, before converting), its files only, private and on a branch where asked."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from pretrain.cli import main

    calls = []

    class FakeApi:
        def __init__(self, token=None):
            pass

        def __getattr__(self, name):  # create_repo, create_branch, upload_folder
            return lambda **kwargs: calls.append((name, kwargs))

    (st_dir / "notes.txt").write_text("mine")
    (st_dir / "1_Pooling" / "draft.json").write_text("{}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_TOKEN", "hf_test_token")
        patch.setattr(huggingface_hub, "HfApi", FakeApi)
        args = ["--format", "sentence-transformers", "--normalize", "--push-to-hub", "me/st", "--private"]
        assert main(["export", str(run), *args, "--revision", "v1"]) == 0
    calls = dict(calls)
    assert calls["create_repo"]["private"] is True and calls["create_branch"]["branch"] == "v1"
    upload = calls["upload_folder"]
    assert upload["folder_path"] == str(st_dir) and upload["revision"] == "v1"
    present = sorted(str(p.relative_to(st_dir)) for p in st_dir.rglob("*") if p.is_file())
    sent = list(filter_repo_objects(present, allow_patterns=upload["allow_patterns"]))
    assert {"modules.json", "1_Pooling/config.json", "sentence_bert_config.json", "model.safetensors"} <= set(sent)
    assert "notes.txt" not in sent and "1_Pooling/draft.json" not in sent
    assert upload["delete_patterns"] == upload["allow_patterns"]  # ours only: a file of the user's there stays


@pytest.mark.slow
def test_cli_truncates_at_the_length_of_the_checkpoints_last_phase(tmp_path):
    """Under a schedule the run's config.yaml holds phase 0's data.max_seq_len; a checkpoint whose last step trained
    in a later phase truncates at that phase's length (bert-base-two-phase: 128, then 512), as its model card says."""
    from helpers import run_args, run_cli, small_corpus

    phases = "schedule.phases=[{start: 2, max_seq_len: 32}]"  # step 3 of 3 trains at 32, config.yaml says 64
    run_cli("run", *run_args(tmp_path, small_corpus(tmp_path), phases), "--no-demo", cwd=tmp_path)
    assert "max_seq_len: 64" in (tmp_path / "r" / "config.yaml").read_text()
    run_cli("export", tmp_path / "r", "--format", "sentence-transformers", cwd=tmp_path)
    st_dir = tmp_path / "r" / "sentence-transformers"
    assert json.loads((st_dir / "sentence_bert_config.json").read_text())["max_seq_length"] == 32
    assert "max_seq_len: 32" in (tmp_path / "r" / "hf" / "README.md").read_text()
