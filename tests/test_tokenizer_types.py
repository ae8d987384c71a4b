"""What each tokenizer kind (WordPiece, byte-level BPE, Unigram) puts into the shards for text that spells its control
tokens or holds tabs, and which min_frequency a unigram tokenizer takes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from data_pipeline.shard_build import build_shards
from data_pipeline.shard_read import ShardSet
from data_pipeline.tokenizer import load_tokenizer, special_tokens, train_tokenizer
from pretrain.cli import main
from pretrain.core.errors import DataError
from tests.helpers import run_args, small_corpus

KINDS = ("wordpiece", "bpe", "unigram")
# A paper about BERT: the control tokens, and a filler's name, as plain text
CONTROLS = "BERT appends [SEP] after each segment and predicts [MASK] tokens; [PAD] [UNK] [CLS] see [unused0] here."


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """Speeches with no '[' in them, and the same with a document that spells the control tokens ('[' known)."""
    where = tmp_path_factory.mktemp("corpora")
    plain = small_corpus(where, slice(0, 6))
    brackets = where / "brackets.jsonl"
    brackets.write_text(plain.read_text() + json.dumps({"text": CONTROLS}) + "\n")
    return {"plain": plain, "brackets": brackets}


@pytest.fixture(scope="module")
def cased(corpora, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Cased tokenizers of each kind on each corpus: '[SEP]' is not lowercased away from the special's name."""
    out = tmp_path_factory.mktemp("tokenizers")
    dirs = {}
    for kind in KINDS:
        for name, path in corpora.items():
            dirs[kind, name] = out / f"{kind}-{name}"
            options = dict(kind=kind, vocab_size=500, lowercase=False, strip_accents=False, show_progress=False)
            train_tokenizer([str(path)], dirs[kind, name], **options)
    return dirs


def shard_tokens(tokenizer_dir: Path, texts: list[str], where: Path) -> list[list[int]]:
    """Each document's ids as the shards hold them."""
    corpus = where / "docs.jsonl"
    where.mkdir(parents=True, exist_ok=True)
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    build_shards([str(corpus)], tokenizer_dir, where / "shards", num_workers=0, show_progress=False)
    shards = ShardSet(where / "shards")
    return [shards.doc_tokens(i).tolist() for i in range(shards.num_docs)]


# ----------------------------------------------------------------------------------------------
# Control tokens spelled in the text


@pytest.mark.parametrize("corpus", ["brackets", "plain"])
@pytest.mark.parametrize("kind", KINDS)
def test_text_spelling_control_tokens_never_gives_their_ids(cased, kind, corpus, tmp_path):
    """The shards never hold [PAD] [UNK] [CLS] [SEP] [MASK] or an [unusedN] filler for text that spells them. A cased
    Unigram did: the specials are also its model pieces, of score 0.0 (the best), and a filler beat a run of unknown
    characters ('[' unseen in training). Only where a character is unknown is there an [UNK]."""
    source = cased[kind, corpus]
    before = hashlib.sha256((source / "tokenizer.json").read_bytes()).hexdigest()
    tokenizer = load_tokenizer(source)
    tokens = special_tokens(tokenizer)
    controls = set(range(tokens.vocab_size)) - set(tokens.replaceable.tolist())  # specials and fillers
    assert len(controls) > 5  # fillers among them (vocab 500, padded to 512)
    (ids,) = shard_tokens(source, [CONTROLS], tmp_path)
    names = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    assert not controls - {tokens.unk} & set(ids), names
    assert corpus == "plain" or tokens.unk not in ids, names  # every character known: no [UNK] either
    # the saved tokenizer is as it was: HF still reads "[SEP]" typed by a user as the special token
    assert hashlib.sha256((source / "tokenizer.json").read_bytes()).hexdigest() == before
    assert tokenizer("a [SEP] b", add_special_tokens=False)["input_ids"][-2] == tokens.sep


def test_unigram_shards_hold_the_tokenizer_s_own_ids_for_other_text(cased, corpora, tmp_path):
    """Renaming the control pieces in the shard workers' copy changes nothing else: ordinary text has the ids the saved
    tokenizer gives it."""
    source = cased["unigram", "brackets"]
    texts = [json.loads(line)["text"].split("\n")[0] for line in corpora["plain"].read_text().splitlines()]
    saved = Tokenizer.from_file(str(source / "tokenizer.json"))
    assert shard_tokens(source, texts, tmp_path) == [saved.encode(t, add_special_tokens=False).ids for t in texts]


# ----------------------------------------------------------------------------------------------
# Whitespace


def test_unigram_splits_words_at_tabs_and_newlines(cased, tmp_path):
    """Metaspace splits at ' ' only: "one\\twith" was '▁one', [UNK], 'w', ... one word with an [UNK] inside. A new
    unigram tokenizer maps every run of whitespace to one space first."""
    source = cased["unigram", "plain"]
    spaced, tabbed = "New one with tab and line.", "New one\twith tab  \t and\nline."
    tokenizer = load_tokenizer(source)
    assert tokenizer.tokenize(tabbed) == tokenizer.tokenize(spaced)
    shards = shard_tokens(source, [spaced, tabbed], tmp_path)
    assert shards[0] == shards[1] and tokenizer.unk_token_id not in shards[1]


# ----------------------------------------------------------------------------------------------
# min_frequency


def test_unigram_refuses_a_min_frequency_it_would_ignore(corpora, tmp_path, capsys):
    """UnigramTrainer has no min_frequency: 1, 2 and 500 gave the same file. The default trains; another value is a
    one-line error naming data.min_frequency, from `pretrain run` as from `pretrain tokenizer`, before anything is
    written."""
    with pytest.raises(DataError, match=r"data\.min_frequency=5 has no effect on a unigram tokenizer"):
        train_tokenizer([str(corpora["plain"])], tmp_path / "tok", kind="unigram", min_frequency=5)
    assert not (tmp_path / "tok").exists()
    args = run_args(tmp_path, corpora["plain"], "data.tokenizer_type=unigram", "data.min_frequency=1")
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if not line.startswith("[pretrain]")] == [
        "error: data.min_frequency=1 has no effect on a unigram tokenizer (its trainer keeps pieces by likelihood, "
        "not by count): leave it at 2, or train wordpiece or bpe"
    ], err
    assert not (tmp_path / "r" / "tokenizer" / "tokenizer.json").exists()
    out = tmp_path / "cli"
    args = ["tokenizer", str(corpora["plain"]), "--out", str(out), "--type", "unigram", "--min-frequency", "3"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.min_frequency=3") and err.count("\n") == 1 and not out.exists()


def test_a_given_tokenizer_without_the_tokens_pretraining_needs_is_refused_before_the_shards(corpora, tmp_path, capsys):
    """A data.tokenizer without a [CLS] (its config naming none) was refused only after `pretrain run` had built the
    shards with it: hours on a real corpus."""
    tok = tmp_path / "tok"
    train_tokenizer([str(corpora["plain"])], tok, vocab_size=300, show_progress=False)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tok / name).is_file():
            config = json.loads((tok / name).read_text())
            config.pop("cls_token", None)
            (tok / name).write_text(json.dumps(config))
    args = run_args(tmp_path, corpora["plain"], f"data.tokenizer={tok}")
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert "has no cls token: pretraining needs a pad, unk, cls, sep and mask token" in err, err
    assert not (tmp_path / "r" / "shards").exists()
