"""Exported tokenizers type sentence pairs as pretraining did; `pretrain tokenizer` writes through a symlinked --out,
keeps the user's other files there and refuses `--out .`; a config that is not UTF-8 and a corpus with no usable
document are one-line errors saying why."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from data_pipeline.tokenizer import (
    copy_tokenizer_files,
    join_lines_as_the_pipeline,
    load_tokenizer,
    special_tokens,
    train_tokenizer,
)
from objectives import build_objectives
from objectives.sentence_head import assemble_pair
from pretrain.cli import main
from pretrain.core.config import ModelConfig
from pretrain.core.errors import DataError
from pretrain.hf.export import ExportError, export_pretrained
from pretrain.hf.interop import hf_config, lm_head_name, select_architecture
from pretrain.hf.tokenizer_check import check_pair_encoding
from pretrain.model.pretraining import PretrainingModel

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
CARD = {"objectives": ["mlm"], "corpus": "tiny", "tokens_seen": 10, "steps": 1, "final_loss": 1.0, "run_name": "t"}
MODERNBERT = dict(norm_placement="pre", position_embedding="rope", activation="geglu", use_bias=False)
A, B = "the people of the union", "freedom and liberty of the states"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first documents of the bundled corpus: enough text for every tokenizer kind to learn merges."""
    path = tmp_path_factory.mktemp("corpus") / "speeches.jsonl"
    lines = (ROOT / "data" / "us-speeches.public-domain.jsonl").read_text().splitlines()[:6]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizers(corpus, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tokenizers")
    for kind in ("wordpiece", "bpe", "unigram"):
        train_tokenizer([str(corpus)], out / kind, kind=kind, vocab_size=512, show_progress=False)
    return {kind: out / kind for kind in ("wordpiece", "bpe", "unigram")}


def tiny_model(tokens, objectives, **options) -> PretrainingModel:
    cfg = ModelConfig(
        vocab_size=tokens.vocab_size,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **options,
    )
    torch.manual_seed(0)
    model = PretrainingModel(cfg, build_objectives(objectives, tokens))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random everywhere: the type embeddings' rows must differ for the check to mean anything
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def export(tokenizer_dir: Path, out: Path, objectives=None, arch=None, **options) -> tuple[PretrainingModel, Path]:
    tokens = special_tokens(load_tokenizer(tokenizer_dir))
    model = tiny_model(tokens, objectives or {"mlm": {}, "nsp": {}}, **options)
    return model, export_pretrained(model, tokens, tokenizer_dir, out, CARD, arch=arch)


def pipeline_pair(tokenizer, a: str, b: str) -> dict[str, list[int]]:
    """[CLS] A [SEP] B [SEP] with its types, as an NSP/SOP sample builds it from the two segments' ids."""
    ids = [np.array(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (a, b)]
    words = [np.ones(len(i), bool) for i in ids]
    tokens = special_tokens(tokenizer)
    sample = assemble_pair(*ids, *words, tokens, len(ids[0]) + len(ids[1]) + 3, np.random.default_rng(0))
    return {k: sample[k].tolist() for k in ("input_ids", "token_type_ids")}


# ----------------------------------------------------------------------------------------------
# Sentence pairs in an export


def test_wordpiece_export_types_pairs_as_bert_tokenizer_fast(tokenizers, tmp_path):
    source = tokenizers["wordpiece"]
    before = hashlib.sha256((source / "tokenizer.json").read_bytes()).hexdigest()
    _, out = export(source, tmp_path / "hf")
    # BERT's own tokenizer on the same vocabulary (transformers 5 takes `vocab`; a `vocab_file=` is silently ignored)
    bert = transformers.BertTokenizerFast(vocab=load_tokenizer(source).get_vocab())
    ours = transformers.AutoTokenizer.from_pretrained(str(out))
    for a, b in (("a b", "c d"), (A, B), ("Liberty, Union!", "Of the PEOPLE.")):
        got, want = ours(a, b), bert(a, b)
        assert set(got) == {"input_ids", "token_type_ids", "attention_mask"}
        assert {k: got[k] for k in want} == dict(want), (a, b)
        assert {k: got[k] for k in ("input_ids", "token_type_ids")} == pipeline_pair(ours, a, b)
    batch = ours([A, "a"], [B, "b c"], padding=True, return_tensors="pt")  # padded rows keep their types
    assert torch.equal(
        batch["token_type_ids"], bert([A, "a"], [B, "b c"], padding=True, return_tensors="pt")["token_type_ids"]
    )
    check_pair_encoding(out)
    # the run's own tokenizer (and so its fingerprint) is untouched; the export carries the same tokenizer.json
    assert hashlib.sha256((source / "tokenizer.json").read_bytes()).hexdigest() == before
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert "model_input_names" not in json.loads((source / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_bpe_and_unigram_exports_type_pairs(tokenizers, kind, tmp_path):
    _, out = export(tokenizers[kind], tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    got = tok(A, B)
    want = pipeline_pair(tok, A, B)
    assert got["input_ids"] == want["input_ids"] and got["token_type_ids"] == want["token_type_ids"]
    assert 0 < sum(got["token_type_ids"]) < len(got["token_type_ids"])  # both segments present
    check_pair_encoding(out)


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_export_encodes_a_masked_word_as_the_shards_hold_it(tokenizers, kind, tmp_path):
    """A fill-mask input is the sentence as its shards hold it, the masked word's pieces replaced by one [MASK]. A
    byte-level BPE or Unigram export put a lone 'Ġ' / '▁' before it ("the [MASK] of": 'Ġthe', 'Ġ', '[MASK]'), the
    space the word's first piece carries, which pretraining never showed the model: the export's [MASK] takes the
    space before it (lstrip, as RoBERTa's <mask>). The run's own tokenizer.json, which its fingerprint hashes, is
    unchanged."""
    from data_pipeline.shard_build import build_shards
    from data_pipeline.shard_read import ShardSet

    source = tokenizers[kind]
    before = (source / "tokenizer.json").read_bytes()
    _, out = export(source, tmp_path / "hf", {"mlm": {}})
    words = "the people of the union and their liberty".split()
    corpus = tmp_path / "sentence.jsonl"
    corpus.write_text(json.dumps({"text": " ".join(words)}) + "\n")
    build_shards([str(corpus)], source, tmp_path / "shards", num_workers=0, show_progress=False)
    shards = ShardSet(tmp_path / "shards")
    ids, starts = shards.doc_tokens(0).tolist(), np.flatnonzero(shards.doc_word_starts(0)).tolist()
    assert len(starts) == len(words)
    bounds = [*starts, len(ids)]
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    for i in range(len(words)):
        text = " ".join([*words[:i], "[MASK]", *words[i + 1 :]])
        got = tok(text, add_special_tokens=False)["input_ids"]
        want = ids[: bounds[i]] + [tok.mask_token_id] + ids[bounds[i + 1] :]
        assert got == want, (text, tok.convert_ids_to_tokens(got))
    assert (source / "tokenizer.json").read_bytes() == before
    exported = json.loads((out / "tokenizer.json").read_text())
    mask = next(t for t in exported["added_tokens"] if t["content"] == "[MASK]")
    assert mask["lstrip"] == (kind != "wordpiece")  # WordPiece drops spaces before its pieces: its file is the run's
    mask["lstrip"] = False
    if kind != "wordpiece":  # and its line breaks read as the pipeline reads them (the test below)
        exported["normalizer"]["normalizers"] = exported["normalizer"]["normalizers"][:-2]
    assert exported == json.loads(before)  # nothing else differs


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_export_encodes_multi_line_text_as_the_shards_hold_it(tokenizers, kind, tmp_path):
    """The pipeline reads each line's sentences apart (stripped, each with its prefix space), so a byte-level BPE model
    never saw a newline piece 'Ċ'; the export gave one for every line break, and cut the next line's first word
    without its 'Ġ' (and a space at the end, BPE's or Unigram's, a lone space piece). Now the export's tokenizer
    gives the shards' ids for multi-line text, whatever the tokenizer."""
    from data_pipeline.shard_build import build_shards
    from data_pipeline.shard_read import ShardSet

    text = "  The people of the union.\nTheir liberty and\r\n\n\ttheir union. \n  Of the people  "
    corpus = tmp_path / "lines.jsonl"
    corpus.write_text(json.dumps({"text": text}) + "\n")
    build_shards([str(corpus)], tokenizers[kind], tmp_path / "shards", num_workers=0, show_progress=False)
    held = ShardSet(tmp_path / "shards").doc_tokens(0).tolist()
    _, out = export(tokenizers[kind], tmp_path / "hf", {"mlm": {}})
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    got = tok(text, add_special_tokens=False)["input_ids"]
    assert got == held, (tok.convert_ids_to_tokens(got), tok.convert_ids_to_tokens(held))
    again = tmp_path / "again"
    shutil.copytree(out, again)
    join_lines_as_the_pipeline(again)  # a second pass changes nothing
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_pair_logits_through_the_tokenizer_match_ours(tokenizers, tmp_path):
    model, out = export(tokenizers["wordpiece"], tmp_path / "hf")
    hf = transformers.BertForPreTraining.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    enc = tok([A, "a b"], [B, "c d"], padding=True, return_tensors="pt")
    rows = [pipeline_pair(tok, A, B), pipeline_pair(tok, "a b", "c d")]
    width = enc["input_ids"].shape[1]
    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows])
    types = torch.tensor([r["token_type_ids"] + [0] * (width - len(r["token_type_ids"])) for r in rows])
    assert torch.equal(enc["input_ids"], ids) and torch.equal(enc["token_type_ids"], types)
    with torch.no_grad():
        hidden = model.encoder(ids, types, enc["attention_mask"])
        nsp, mlm = model.heads["nsp"](hidden), model.get_submodule(lm_head_name(model))(hidden)
        got = hf(**enc)
        untyped = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    real = enc["attention_mask"].bool()
    assert (got.seq_relationship_logits - nsp).abs().max() <= 1e-4
    assert (got.prediction_logits[real] - mlm[real]).abs().max() <= 1e-4
    assert (untyped.seq_relationship_logits - nsp).abs().max() > 1e-2  # what the missing types cost


def test_each_architecture_gets_the_types_its_tokenizer_would(tokenizers, tmp_path):
    """bert / albert / electra: types, as BertTokenizer (and ALBERT's before transformers 5); roberta / modernbert, or
    a single type: none. The export's config decides (`copy_tokenizer_files(..., hf_config)`)."""
    source = tokenizers["wordpiece"]
    tokens = special_tokens(load_tokenizer(source))
    cases = {  # name: (objectives, model options, --arch, token types expected)
        "bert": ({"mlm": {}, "nsp": {}}, {}, None, True),
        "albert": ({"mlm": {}, "sop": {}}, {"embedding_size": 16, "share_layers": True}, None, True),
        "roberta": ({"mlm": {}}, {}, "roberta", False),
        "modernbert": ({"mlm": {}}, MODERNBERT, None, False),
        "bert-one-type": ({"mlm": {}}, {"type_vocab_size": 1}, None, False),
    }
    for name, (objectives, options, arch, typed) in cases.items():
        model = tiny_model(tokens, objectives, **options)
        config = hf_config(model, select_architecture(model, arch), tokens)
        where = tmp_path / name
        copy_tokenizer_files(source, where, config)  # what the export writes, in its order
        config.save_pretrained(where)
        enc = transformers.AutoTokenizer.from_pretrained(str(where))(A, B)
        assert ("token_type_ids" in enc) == typed, name
        check_pair_encoding(where)
    from pretrain.hf.electra import export_electra

    out = export_electra(tiny_model(tokens, {"rtd": {}}), tokens, source, tmp_path / "electra", CARD)
    for sub in ("", "generator"):
        enc = transformers.AutoTokenizer.from_pretrained(str(out / sub))(A, B)
        assert enc["token_type_ids"] == pipeline_pair(load_tokenizer(source), A, B)["token_type_ids"], sub
    check_pair_encoding(out)


def test_check_pair_encoding_catches_an_export_without_types(tokenizers, tmp_path):
    _, out = export(tokenizers["wordpiece"], tmp_path / "hf")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("model_input_names")  # an export written before the fix
    config_path.write_text(json.dumps(config))
    with pytest.raises(ExportError, match="token_type_ids None"):
        check_pair_encoding(out)
    config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    config_path.write_text(json.dumps(config))
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["post_processor"]["pair"][-2]["Sequence"]["type_id"] = 0  # B typed 0
    (out / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ExportError, match="token_type_ids"):
        check_pair_encoding(out)


def test_finetune_passes_token_types_for_a_pair_task(tokenizers, tmp_path, monkeypatch):
    """`pretrain finetune` on a sentence1/sentence2 task gives the model B's types, also from an export written
    before exports said so (no model_input_names)."""
    from pretrain.evaluation import finetune as ft

    _, out = export(tokenizers["wordpiece"], tmp_path / "hf")
    config_path = out / "tokenizer_config.json"
    config_path.write_text(
        json.dumps({k: v for k, v in json.loads(config_path.read_text()).items() if k != "model_input_names"})
    )
    task = tmp_path / "rte"
    task.mkdir()
    rows = [(A, B, 0), ("a b", "c d", 1), ("the union", "of states", 0), ("liberty", "the people", 1)]
    for split in ("train.tsv", "dev.tsv"):
        (task / split).write_text("sentence1\tsentence2\tlabel\n" + "".join(f"{a}\t{b}\t{y}\n" for a, b, y in rows))
    seen = []
    encode = ft._encode
    monkeypatch.setattr(ft, "_encode", lambda *args: seen.append(encode(*args)) or seen[-1])
    for mode in ("probe", "full"):
        assert ft.finetune(out, task, seeds=[0], mode=mode, epochs=1)["pair"]
    assert len(seen) == 4  # train and dev, each mode
    for enc in seen:
        expected = [pipeline_pair(load_tokenizer(out), a, b)["token_type_ids"] for a, b, _ in rows]
        got = [t[m.bool()].tolist() for t, m in zip(enc["token_type_ids"], enc["attention_mask"])]
        assert got == expected


# ----------------------------------------------------------------------------------------------
# pretrain tokenizer --out


def test_tokenizer_out_symlink_is_written_through(corpus, tmp_path, capsys):
    target, link = tmp_path / "real", tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)  # dangling at first: the target is created
    for _ in range(2):  # new, then replacing its own earlier tokenizer
        assert main(["tokenizer", str(corpus), "--out", str(link), "--vocab-size", "300"]) == 0
        assert link.is_symlink() and (target / "tokenizer.json").is_file()
    assert str(target) in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no .tmp / .old left beside it


def test_retraining_keeps_the_users_other_files(corpus, tmp_path, monkeypatch):
    """Training again into a tokenizer directory of ours swapped the whole directory, deleting the user's NOTES.md
    and eval/ there; now they are carried into the new one, and put back where they were if the swap fails."""
    import os

    from data_pipeline import tokenizer as tokenizer_module

    out = tmp_path / "tok"
    train_tokenizer([str(corpus)], out, vocab_size=300, show_progress=False)
    (out / "NOTES.md").write_text("mine")
    (out / "eval").mkdir()
    (out / "eval" / "scores.txt").write_text("0.9")
    train_tokenizer([str(corpus)], out, vocab_size=320, show_progress=False)
    assert (out / "NOTES.md").read_text() == "mine" and (out / "eval" / "scores.txt").read_text() == "0.9"
    assert load_tokenizer(out).vocab_size == 320
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]  # no .tmp / .old left beside it

    replace = os.replace

    def failing(src, dst):  # the new directory's rename into place fails (a full disk, a signal)
        if Path(src).name.startswith("tok.tmp-") and Path(dst) == out:
            raise OSError("no")
        return replace(src, dst)

    monkeypatch.setattr(tokenizer_module.os, "replace", failing)
    with pytest.raises(OSError, match="no"):
        train_tokenizer([str(corpus)], out, vocab_size=340, show_progress=False)
    assert (out / "NOTES.md").read_text() == "mine" and (out / "eval" / "scores.txt").read_text() == "0.9"
    assert load_tokenizer(out).vocab_size == 320
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


def test_tokenizer_out_dot_is_a_clear_error(corpus, tmp_path, monkeypatch, capsys):
    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["tokenizer", str(corpus), "--out", "."]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out . is the current directory") and "--out tokenizer" in err
    assert (
        err.count("\n") == 1 and list(here.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    )


def test_corpus_with_only_bad_documents_says_why(tmp_path, capsys):
    jsonl, txt = tmp_path / "bad.jsonl", tmp_path / "bad.txt"
    jsonl.write_bytes(b'{"text": "caf\xe9"}\n{"text": \n{"body": "x"}\n{"body": "y"}\n{"text": "  "}\n')
    txt.write_bytes(b"one \xff line\n\nand \xfe another\n")
    for extra in ([], ["--sample-docs", "10"]):
        out = tmp_path / "tok"
        assert main(["tokenizer", str(jsonl), str(txt), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"empty corpus: no usable documents in {jsonl}, {txt}" in err
        for part in (
            "skipped 7 documents: 3 with invalid UTF-8, 2 without text in field 'text', 1 empty, 1 with invalid JSON",
            "--text-field",
            "--on-bad error",
        ):
            assert part in err, (part, err)
        assert not out.exists()
    # beside documents it trains on, the skipped ones are said too: a corpus mostly skipped trained on the rest
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a usable document of words"}\n')
    assert main(["tokenizer", str(good), str(jsonl), "--out", str(tmp_path / "tok"), "--vocab-size", "64"]) == 0
    assert "[data] tokenizer: skipped 5 documents: 2 without text in field 'text'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Config files that are not UTF-8


@pytest.mark.parametrize("command", ["config", "train"])
def test_config_not_utf8_names_file_and_place(command, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    data = b"model:\n  hidden_size: 64\nname: caf\xe9\n"  # Latin-1, as an old editor saves it
    bad.write_bytes(data)
    assert main([command, str(bad)]) == 2
    err = capsys.readouterr().err
    offset = data.index(b"\xe9")
    assert err == f"error: {bad}:3:10: not UTF-8 text (byte 0xe9 at offset {offset}); save the file as UTF-8\n"
    child = tmp_path / "child.yaml"  # inherited: the message names the base file
    child.write_text("base: bad.yaml\n")
    assert main([command, str(child)]) == 2
    assert f"error: {bad}:3:10: not UTF-8" in capsys.readouterr().err


def test_config_with_bom_still_reads(tmp_path, capsys):
    good = tmp_path / "bom.yaml"
    good.write_bytes(b"\xef\xbb\xbfname: bom\n")
    assert main(["config", str(good)]) == 0
    assert "name: bom" in capsys.readouterr().out


def test_a_run_trains_its_tokenizer_again_when_its_settings_change_before_any_checkpoint(corpus, tmp_path, capsys):
    """A run stopped before its first checkpoint, then started with another vocabulary or casing: its tokenizer was
    kept as it was while config.yaml and the model card said the new settings. With nothing trained on it, it is
    trained again; once a checkpoint exists, the resume's fingerprint holds the run to it (not this stage)."""
    from pretrain.pipeline import stage_tokenizer
    from pretrain.train.setup import load_config

    def config(*overrides):
        return load_config("tiny", [f"output_dir={tmp_path}", "name=r", f"data.corpus=[{corpus}]", *overrides])

    out = stage_tokenizer(config("data.vocab_size=512"))
    assert len(load_tokenizer(out)) == 512
    stage_tokenizer(config("data.vocab_size=512"))
    assert "exists, skipped" in capsys.readouterr().err
    stage_tokenizer(config("data.vocab_size=1024", "data.lowercase=false"))
    said = capsys.readouterr().err
    assert "was trained with data.vocab_size=512 (now 1024), data.lowercase=True (now False)" in said, said
    tokenizer = load_tokenizer(out)
    assert len(tokenizer) == 1024 and tokenizer.tokenize("Freedom") != tokenizer.tokenize("freedom")
    # a checkpoint trained on it: kept, whatever the config says now
    from pretrain.train.state import TrainState

    (tmp_path / "r" / "checkpoints" / "step_00000001").mkdir(parents=True)
    TrainState(step=1).save(tmp_path / "r" / "checkpoints" / "step_00000001")
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step_00000001")
    stage_tokenizer(config("data.vocab_size=512"))
    assert "exists, skipped" in capsys.readouterr().err and len(load_tokenizer(out)) == 1024


def test_a_run_trains_its_tokenizer_again_when_what_it_was_trained_on_changes(corpus, tmp_path, capsys):
    """data.tokenizer_sample_docs, data.text_field and data.max_document_bytes decide which text the tokenizer learns
    from, but were not recorded: a change before the first checkpoint went on with the old tokenizer. data.corpus and
    data.sources are recorded as the config writes them (`train_tokenizer(recorded=...)`; their expanded files never
    equal a config's globs). A settings file of an older version, without these keys, compares the keys it has."""
    from pretrain.pipeline import _tokenizer_settings_changed, stage_tokenizer
    from pretrain.train.setup import load_config

    def config(*overrides):
        base = [f"output_dir={tmp_path}", "name=r", f"data.corpus=[{corpus}]", "data.vocab_size=512"]
        return load_config("tiny", [*base, *overrides])

    out = stage_tokenizer(config())
    assert _tokenizer_settings_changed(config()) == []
    assert json.loads((out / "training_settings.json").read_text())["corpus"] == [str(corpus)]  # the stage records it
    for override, said in (
        ("data.tokenizer_sample_docs=3", "data.tokenizer_sample_docs=0 (now 3)"),
        ("data.text_field=body", "data.text_field=text (now body)"),
        ("data.max_document_bytes=1000", "data.max_document_bytes=16777216 (now 1000)"),
    ):
        assert _tokenizer_settings_changed(config(override)) == [said]
    capsys.readouterr()
    stage_tokenizer(config("data.tokenizer_sample_docs=3"))
    assert "was trained with data.tokenizer_sample_docs=0 (now 3): training it again" in capsys.readouterr().err
    assert _tokenizer_settings_changed(config("data.tokenizer_sample_docs=3")) == []

    other = tmp_path / "other.jsonl"
    other.write_text(corpus.read_text())
    train_tokenizer(
        [str(corpus)], out, vocab_size=512, show_progress=False, recorded={"corpus": [str(corpus)], "sources": []}
    )
    assert _tokenizer_settings_changed(config()) == []
    said = f"data.corpus=['{corpus}'] (now ['{other}'])"
    assert _tokenizer_settings_changed(config(f"data.corpus=[{other}]")) == [said]
    mixed = config("data.corpus=[]", f"data.sources=[{{name: a, corpus: [{corpus}]}}]")
    assert f"data.sources=[] (now [{{'name': 'a', 'corpus': ['{corpus}'], 'weight': 1.0}}])" in (
        _tokenizer_settings_changed(mixed)
    )

    settings = out / "training_settings.json"  # as an older version wrote it
    recorded = json.loads(settings.read_text())
    keys = ("tokenizer_type", "vocab_size", "lowercase", "strip_accents", "min_frequency", "text_documents")
    settings.write_text(json.dumps({k: recorded[k] for k in keys}))
    assert _tokenizer_settings_changed(config("data.tokenizer_sample_docs=3", f"data.corpus=[{other}]")) == []
    assert _tokenizer_settings_changed(config("data.vocab_size=1024")) == ["data.vocab_size=512 (now 1024)"]


def test_a_run_trains_its_tokenizer_again_when_its_corpus_files_change(corpus, tmp_path, capsys):
    """A corpus edited under its name (or a file added to its directory) before the first checkpoint rebuilt the
    shards with the tokenizer fitted to the old text: the config's data.corpus had not changed. The files' sizes and
    times are recorded and compared; how a whole-corpus tokenizer's files are grouped and weighed is not (a weight
    tweak retrained it, byte-identical, over the whole corpus)."""
    from data_pipeline.tokenizer import tokenizer_hash
    from pretrain.pipeline import _tokenizer_settings_changed, stage_tokenizer
    from pretrain.train.setup import load_config

    data = tmp_path / "data"
    data.mkdir()
    text = corpus.read_text().splitlines()
    (data / "a.jsonl").write_text("\n".join(text[:3]) + "\n")
    base = [f"output_dir={tmp_path}", "name=r", "data.vocab_size=512"]

    def config(*overrides):
        return load_config("tiny", [*base, f"data.corpus=[{data}]", *overrides])

    out = stage_tokenizer(config())
    first = tokenizer_hash(out)
    assert _tokenizer_settings_changed(config()) == []
    (data / "a.jsonl").write_text("\n".join(text[3:]) + "\n")  # edited in place
    assert _tokenizer_settings_changed(config()) == [f"corpus files that changed since (edited: {data / 'a.jsonl'})"]
    capsys.readouterr()
    stage_tokenizer(config())
    assert "corpus files that changed since (edited:" in capsys.readouterr().err and tokenizer_hash(out) != first
    (data / "b.jsonl").write_text(text[0] + "\n")
    assert _tokenizer_settings_changed(config()) == [f"corpus files that changed since (added: {data / 'b.jsonl'})"]
    (data / "b.jsonl").unlink()
    # a touch, or the corpus moved (a copy that kept no times): the same files by name and size, no retraining
    os.utime(data / "a.jsonl", (1, 1))
    assert _tokenizer_settings_changed(config()) == []
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    assert _tokenizer_settings_changed(load_config("tiny", [*base, f"data.corpus=[{moved}]"])) == []

    def mixed(weight, sample_docs=0):
        sources = f"data.sources=[{{name: a, corpus: [{data}], weight: {weight}}}]"
        return config("data.corpus=[]", sources, f"data.tokenizer_sample_docs={sample_docs}")

    stage_tokenizer(mixed(1))
    assert _tokenizer_settings_changed(mixed(3)) == []  # the whole corpus read: its weight changes nothing
    assert _tokenizer_settings_changed(config()) == []  # nor grouping the same files as data.corpus
    stage_tokenizer(mixed(1, sample_docs=2))
    assert [c.split("=")[0] for c in _tokenizer_settings_changed(mixed(3, sample_docs=2))] == ["data.sources"]


def test_a_named_tokenizer_trained_otherwise_than_the_config_says_is_said(corpus, tmp_path, capsys):
    """data.tokenizer names a tokenizer used as it is: a config asking for cased BPE at 8192 ran on an uncased
    WordPiece of 512 with no word, and its config.yaml said cased BPE."""
    from pretrain.pipeline import stage_tokenizer
    from pretrain.train.setup import load_config

    own = stage_tokenizer(load_config("tiny", [f"output_dir={tmp_path}", "name=a", f"data.corpus=[{corpus}]"]))
    capsys.readouterr()

    def named(*overrides):
        base = [f"output_dir={tmp_path}", "name=b", f"data.corpus=[{corpus}]", f"data.tokenizer={own}"]
        stage_tokenizer(load_config("tiny", [*base, *overrides]))
        return capsys.readouterr().err

    assert "note:" not in named()  # trained with what this config gives
    said = named("data.tokenizer_type=bpe", "data.lowercase=false")
    assert f"note: data.tokenizer {own} was trained with tokenizer_type=wordpiece, lowercase=True: it is used" in said
    assert "the config's data.tokenizer_type=bpe, data.lowercase=False do not apply" in said


def test_a_tokenizer_a_run_trains_with_is_not_replaced_under_it(corpus, tmp_path, monkeypatch):
    """`pretrain tokenizer --out` into the data.tokenizer of a run training meanwhile went through: the run's later
    checkpoints and its export then carried the new tokenizer, 503 of 512 ids of another piece than the embeddings
    were trained on, and nothing said so. A trainer holds its tokenizer directory (`reading_data`): a tokenizer
    trained into it is refused before its training, and, were a run to start meanwhile, at the swap, where the one
    trained is kept beside it."""
    from data_pipeline import tokenizer as tokenizer_module
    from pretrain.train.setup import load_config
    from pretrain.train.trainer import reading_data

    out = tmp_path / "tok"
    train_tokenizer([str(corpus)], out, vocab_size=300, show_progress=False)
    before = (out / "tokenizer.json").read_bytes()
    cfg = load_config("tiny", [f"data.tokenizer={out}", f"data.shards={tmp_path / 'shards'}"])
    with reading_data(cfg):  # as the trainer holds its data while it trains
        with pytest.raises(DataError, match=r"tok holds the tokenizer a run is training with .* left as it was$"):
            train_tokenizer([str(corpus)], out, vocab_size=320, show_progress=False)
        monkeypatch.setattr(tokenizer_module, "_check_not_in_use", lambda out: None)  # the run started after it
        with pytest.raises(DataError, match=r"the tokenizer trained now is in .*tok\.tmp-\d+$") as refused:
            train_tokenizer([str(corpus)], out, vocab_size=320, show_progress=False)
    assert (out / "tokenizer.json").read_bytes() == before
    kept = Path(str(refused.value).rsplit(" is in ", 1)[1])
    assert load_tokenizer(kept).vocab_size == 320
    train_tokenizer([str(corpus)], out, vocab_size=320, show_progress=False)  # the run is gone: replaced
    assert load_tokenizer(out).vocab_size == 320


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_an_export_is_evaluated_on_the_shards_of_the_run_it_came_from(tokenizers, kind, tmp_path):
    """A BPE or Unigram export's tokenizer.json adds export-only steps, so its hash is not the one the run's shards
    were built with: `pretrain eval EXPORT --shards RUN/shards` was refused ("built with a different tokenizer ...
    rebuild the shards"), though the ids are the same. The export records the tokenizer it came from, and those shards
    are read; another tokenizer's still are not."""
    from data_pipeline.shard_build import build_shards
    from pretrain.evaluation.evaluate import evaluate_mlm

    _, out = export(tokenizers[kind], tmp_path / "hf", {"mlm": {}})
    corpus = tmp_path / "held-out.jsonl"
    corpus.write_text("\n".join([json.dumps({"text": "the people of the union and their liberty " * 4})] * 4) + "\n")
    build_shards([str(corpus)], tokenizers[kind], tmp_path / "run-shards", num_workers=0, show_progress=False)
    assert evaluate_mlm(out, shards=str(tmp_path / "run-shards"), max_samples=2, max_seq_len=32)["samples"] == 2
    other = "unigram" if kind != "unigram" else "bpe"
    build_shards([str(corpus)], tokenizers[other], tmp_path / "other-shards", num_workers=0, show_progress=False)
    with pytest.raises(DataError, match="was built with a different tokenizer"):
        evaluate_mlm(out, shards=str(tmp_path / "other-shards"), max_samples=2, max_seq_len=32)


def test_a_run_from_an_export_leaves_the_export_free_to_be_replaced(tokenizers, tmp_path):
    """A run with model.init_from an export reads its tokenizer there: held for the whole run, an export into that
    directory (`pretrain export` of the run it came from) waited until the run ended. A directory no tokenizer is
    trained into is not held (the run keeps the bytes it read)."""
    from pretrain.core.outputs import exclusive_if_free
    from pretrain.train.setup import load_config
    from pretrain.train.trainer import reading_data

    _, out = export(tokenizers["wordpiece"], tmp_path / "hf", {"mlm": {}})
    for tokenizer, free in ((out, True), (tokenizers["wordpiece"], False)):
        cfg = load_config("tiny", [f"data.tokenizer={tokenizer}", f"data.shards={tmp_path / 'shards'}"])
        with reading_data(cfg), exclusive_if_free(tokenizer) as held:
            assert held == free, tokenizer


def test_an_export_whose_tokenizer_was_replaced_reads_only_its_own_shards(tokenizers, tmp_path):
    """The record of the tokenizer an export came from is of the tokenizer.json written with it: another tokenizer
    copied in since is its own alone, and the run's shards are refused for it."""
    from data_pipeline.tokenizer import tokenizer_hash, tokenizer_hashes

    _, out = export(tokenizers["bpe"], tmp_path / "hf", {"mlm": {}})
    assert tokenizer_hashes(out) == (tokenizer_hash(out), tokenizer_hash(tokenizers["bpe"]))
    shutil.copy(tokenizers["unigram"] / "tokenizer.json", out / "tokenizer.json")
    assert tokenizer_hashes(out) == (tokenizer_hash(tokenizers["unigram"]),)
