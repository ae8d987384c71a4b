"""Tests of data_pipeline: readers, sentence splitting, tokenizers, shards and packed samples."""

from __future__ import annotations

import collections
import gzip
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import make_docs, snapshot, write_jsonl

from data_pipeline.readers import Document, expand_inputs, iter_documents
from data_pipeline.samples import PackedSequences
from data_pipeline.sentences import split_sentences
from data_pipeline.shards import ShardSet, build_shards
from data_pipeline.tokenizer import load_tokenizer, special_tokens, tokenizer_hash, train_tokenizer
from pretrain.core.errors import DataError, UserError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    return write_jsonl(d / "docs.jsonl", make_docs(300))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("tok") / "wordpiece"
    train_tokenizer([str(corpus)], out, vocab_size=200, show_progress=False)
    return out


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, corpus, tok_dir):
    out = tmp_path_factory.mktemp("shards") / "shards"
    build_shards([str(corpus)], tok_dir, out, num_workers=2, docs_per_shard=70, show_progress=False)
    return out


# ---------------------------------------------------------------------------------------------- readers


def test_reads_jsonl_gz_txt_dir_and_glob(tmp_path):
    docs = make_docs(5)
    write_jsonl(tmp_path / "a.jsonl", docs[:2])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": docs[2]}) + "\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "c.txt").write_text("First document line one.\nline two.\n\n\n  \nSecond document.\n")
    (sub / "ignored.csv").write_text("x")

    got = list(iter_documents([str(tmp_path)]))
    assert [d.text for d in got[:3]] == docs[:3]
    assert got[3:] == [
        Document("First document line one.\nline two.", str(sub / "c.txt"), 1),
        Document("Second document.", str(sub / "c.txt"), 6),
    ]
    assert expand_inputs([str(tmp_path / "*.json*")]) == [tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"]
    assert got[1].line == 2 and got[1].source == str(tmp_path / "a.jsonl")


def test_a_directory_gives_each_corpus_file_once(tmp_path):
    """Symlinked folders are followed (each real one once), hidden ones (.ipynb_checkpoints) are not; a file reached
    twice (a link, another spelling) is read once; suffixes in capitals count; a named file of no corpus type is an
    error rather than a file of invalid JSON lines."""
    big = tmp_path / "big" / "wiki"
    big.mkdir(parents=True)
    write_jsonl(big / "w.jsonl", ["wiki"])
    corpus = tmp_path / "corpus"
    (corpus / "local").mkdir(parents=True)
    write_jsonl(corpus / "local" / "l.jsonl", ["local"])
    (corpus / ".ipynb_checkpoints").mkdir()
    write_jsonl(corpus / ".ipynb_checkpoints" / "l-checkpoint.jsonl", ["a stale copy"])
    (corpus / "wiki").symlink_to(big)
    (corpus / "loop").symlink_to(corpus)  # a link to a folder above: followed once
    (corpus / "BOOK.TXT").write_text("A book in capitals.\n")
    expected = [corpus / "BOOK.TXT", corpus / "local" / "l.jsonl", corpus / "wiki" / "w.jsonl"]
    assert expand_inputs([str(corpus)]) == expected
    again = expand_inputs([str(corpus), str(tmp_path / "big" / "wiki" / "w.jsonl"), str(corpus / "local/../local")])
    assert len(again) == 3
    assert [d.text for d in iter_documents([str(corpus)])] == ["A book in capitals.", "local", "wiki"]
    (tmp_path / "notes.text").write_text("words\n")
    with pytest.raises(DataError, match=r"notes.text' is not one of the types read .* rename it"):
        expand_inputs([str(tmp_path / "notes.text")])


def test_a_recursive_pattern_over_symlink_loops_returns_each_file_once(tmp_path):
    """glob's `**` follows a link to a folder above again and again: with two such links it never returned."""
    import signal

    corpus = tmp_path / "corpus"
    for sub in ("a", "b"):
        (corpus / sub).mkdir(parents=True)
        (corpus / sub / "up").symlink_to(corpus)
    write_jsonl(corpus / "a" / "x.jsonl", ["x"])
    write_jsonl(corpus / "top.jsonl", ["top"])

    def too_long(*_):  # not a TimeoutError: glob takes any OSError for an unreadable folder and goes on
        raise AssertionError("the pattern did not return within 20 s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(20)
    try:
        found = expand_inputs([str(corpus / "**" / "*.jsonl")])
        below_b = expand_inputs([str(corpus / "b" / "**" / "*.jsonl")])  # through b/up, spelled as reached
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert found == [corpus / "a" / "x.jsonl", corpus / "top.jsonl"]
    assert below_b == [corpus / "b" / "up" / "a" / "x.jsonl", corpus / "b" / "up" / "top.jsonl"]


def test_the_order_inputs_are_given_in_never_changes_the_documents_order(tmp_path):
    """A file reached twice (here through a link) was named by whichever spelling came first, and the files sorted by
    those names: [corpus, link] read a then b, [link, corpus] b then a, so other shards and another cache key."""
    from data_pipeline.shard_build import build_key

    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "a.jsonl", ["first"])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", ["second"])
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "x.jsonl").symlink_to(tmp_path / "corpus" / "a.jsonl")
    orders = [[str(tmp_path / "corpus"), str(tmp_path / "links" / "x.jsonl")]]
    orders.append(orders[0][::-1])
    for paths in orders:
        assert expand_inputs(paths) == [tmp_path / "corpus" / "a.jsonl", tmp_path / "corpus" / "b.jsonl"]
        assert [d.text for d in iter_documents(paths)] == ["first", "second"]
    assert build_key(orders[0], "tok", {}) == build_key(orders[1], "tok", {})


def test_a_path_that_exists_is_read_as_itself_and_a_pattern_stays_out_of_our_outputs(tmp_path):
    """'part[1].jsonl' was a pattern matching part1.jsonl: that file read in its place (and, from a directory, the
    bracketed file never read, as the list found was expanded again when read); a directory 'run[2024]' was not
    found. A glob over a corpus directory read the shards and tokenizer kept in it, as a walk of it does not."""
    from pretrain.core.outputs import mark_output

    for folder in ("br", "run[2024]"):
        (tmp_path / folder).mkdir()
    write_jsonl(tmp_path / "br" / "part[1].jsonl", ["from the bracketed file"])
    write_jsonl(tmp_path / "br" / "part1.jsonl", ["from part1"])
    write_jsonl(tmp_path / "run[2024]" / "a.jsonl", ["in a bracketed directory"])
    assert expand_inputs([str(tmp_path / "br" / "part[1].jsonl")]) == [tmp_path / "br" / "part[1].jsonl"]
    assert [d.text for d in iter_documents([str(tmp_path / "br")])] == ["from part1", "from the bracketed file"]
    assert [d.text for d in iter_documents([str(tmp_path / "run[2024]")])] == ["in a bracketed directory"]
    assert expand_inputs([str(tmp_path / "br" / "part?.jsonl")]) == [tmp_path / "br" / "part1.jsonl"]  # a pattern

    (tmp_path / "br" / "shards").mkdir()
    (tmp_path / "br" / "shards" / "manifest.json").write_text("{}")
    mark_output(tmp_path / "br" / "shards", "shards")
    assert expand_inputs([str(tmp_path / "br")]) == expand_inputs([str(tmp_path / "br" / "*")])
    assert expand_inputs(
        [str(tmp_path / "br" / "**" / "*.json*")],
    ) == [
        tmp_path / "br" / "part1.jsonl",
        tmp_path / "br" / "part[1].jsonl",
    ]


def test_files_a_walk_or_pattern_does_not_read_are_said(tmp_path, capsys):
    """Files of other types in a corpus directory were left out unsaid (a .ndjson dump, a .csv), and a pattern
    matching only such files read nothing and said nothing of them."""
    (tmp_path / "c").mkdir()
    write_jsonl(tmp_path / "c" / "a.jsonl", ["read"])
    for name in ("dump.ndjson", "table.csv", "more.csv"):
        (tmp_path / "c" / name).write_text("x\n")
    for _ in range(2):  # a run expands its inputs several times: said once
        assert expand_inputs([str(tmp_path / "c")]) == [tmp_path / "c" / "a.jsonl"]
    err = capsys.readouterr().err
    assert err.count("not read") == 1 and "3 file(s) not read" in err and "(.csv: 2, .ndjson: 1)" in err
    with pytest.raises(DataError, match=r"'.*\*\.csv' matches only files of types not read \(\.csv: 2\)"):
        expand_inputs([str(tmp_path / "c" / "*.csv")])


def test_plain_text_with_one_document_per_line(tmp_path, capsys, tok_dir):
    """Dumps of one document per line with no blank lines: by default one document of every line (and past
    max_document_bytes none at all), which the reader now says; data.text_documents=lines reads each line."""
    lines = [f"Document number {i} says something of its own." for i in range(1200)]
    path = tmp_path / "one_per_line.txt"
    path.write_text("\n".join(lines[:600]) + "\n\n" + "\n".join(lines[600:]) + "\n")
    docs = [d.text for d in iter_documents([str(path)])]
    assert len(docs) == 2 and "text_documents=lines" not in capsys.readouterr().err  # 600 lines: paragraphs
    path.write_text("\n".join(lines) + "\n")
    assert len(list(iter_documents([str(path)]))) == 1
    assert "a document of 1,200 lines with no blank line between them" in capsys.readouterr().err
    by_line = list(iter_documents([str(path)], text_documents="lines"))
    assert [d.text for d in by_line] == lines and by_line[5].line == 6
    with pytest.raises(DataError, match="text_documents: 'words' is not one of paragraphs, lines"):
        list(iter_documents([str(path)], text_documents="words"))
    # shards: a setting of the cache key (the default's key is as before it existed)
    quiet = dict(num_workers=0, show_progress=False)
    paragraphs = build_shards([str(path)], tok_dir, tmp_path / "p", **quiet)
    each = build_shards([str(path)], tok_dir, tmp_path / "l", **quiet, text_documents="lines")
    assert (paragraphs["counts"]["documents"], each["counts"]["documents"]) == (1, 1200)
    assert "text_documents" not in paragraphs["settings"] and each["settings"]["text_documents"] == "lines"


def test_bad_lines_skipped_and_counted_or_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"text": "good one"}\n{"text": "bad \xff byte"}\n{not json\n'
        b'{"body": "x"}\n{"text": "   "}\n\n{"text": "good two"}\n'
    )
    skipped = collections.Counter()
    assert [d.text for d in iter_documents([str(path)], skipped=skipped)] == ["good one", "good two"]
    assert skipped == {"invalid_utf8": 1, "invalid_json": 1, "missing_field": 1, "empty": 1}
    with pytest.raises(DataError, match=rf"{path}:2: invalid UTF-8"):
        list(iter_documents([str(path)], on_bad="error"))

    path.write_bytes(b'{"text": "ok"}\n{"body": "x", "id": 3}\n')
    with pytest.raises(DataError, match=rf"{path}:2: no field 'text' \(keys: body, id\)"):
        list(iter_documents([str(path)], on_bad="error"))


def test_a_lone_surrogate_is_a_bad_document(tmp_path):
    """json.loads accepts "\\ud800", which no UTF-8 holds: it crashed tokenizer training (UnicodeEncodeError) and the
    shard build (TypeError in a worker), naming neither file nor line, whatever on_bad_document said."""
    path = tmp_path / "lone.jsonl"
    good = [f"document {i} about the union and its states." for i in range(20)]
    lines = [json.dumps({"text": t}) for t in good]
    lines.insert(1, '{"text": "half a pair \\ud800 here"}')
    lines.insert(3, '{"text": "a pair \\ud83d\\ude00 is fine"}')
    path.write_text("\n".join(lines) + "\n")
    skipped = collections.Counter()
    docs = list(iter_documents([str(path)], skipped=skipped))
    assert [d.text for d in docs] == [good[0], good[1], "a pair \U0001f600 is fine", *good[2:]]
    assert skipped == {"invalid_utf8": 1}
    with pytest.raises(DataError, match=rf"{path}:2: invalid UTF-8: 'text' holds a lone surrogate \(U\+D800 at"):
        list(iter_documents([str(path)], on_bad="error"))
    tok = tmp_path / "tok"
    train_tokenizer([str(path)], tok, vocab_size=120, show_progress=False)
    manifest = build_shards([str(path)], tok, tmp_path / "shards", num_workers=0, show_progress=False)
    assert manifest["counts"]["documents"] == 21 and manifest["counts"]["skipped"] == {"invalid_utf8": 1}


def test_a_byte_order_mark_is_not_text(tmp_path):
    """Windows editors start UTF-8 files with a BOM: it cost a JSONL file its first record (invalid JSON), and began a
    text file's first document with U+FEFF."""
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfFirst paragraph.\n\nSecond one.\n")
    skipped = collections.Counter()
    docs = [d.text for d in iter_documents([str(tmp_path / "bom.jsonl"), str(tmp_path / "bom.txt")], skipped=skipped)]
    assert docs == ["first", "second", "First paragraph.", "Second one."] and not skipped


def test_a_byte_order_mark_does_not_count_against_the_line_limit(tmp_path):
    """The BOM was stripped after the first line was read to max_document_bytes: a first line near the limit was cut
    in two, and counted twice as invalid JSON."""
    first = '{"text": "abcdefgh"}'  # 20 bytes
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + first.encode() + b'\n{"text": "second"}\n')
    skipped = collections.Counter()
    docs = [d.text for d in iter_documents([str(path)], skipped=skipped, max_document_bytes=len(first))]
    assert docs == ["abcdefgh", "second"] and not skipped
    path.write_bytes(b"\xef\xbb\xbf" + first.encode() + b"x\n")  # one byte over: too long, once
    assert not list(iter_documents([str(path)], skipped=skipped, max_document_bytes=len(first)))
    assert skipped == {"too_long": 1}


def test_missing_path_and_empty_dir(tmp_path):
    with pytest.raises(DataError, match="corpus path '.*nope.jsonl' not found"):
        expand_inputs([str(tmp_path / "nope.jsonl")])
    with pytest.raises(DataError, match="no corpus files"):
        expand_inputs([str(tmp_path)])


def test_split_sentences():
    text = (
        'Mr. Smith went to Washington. He met Dr. Jones, e.g. at the U.S. Capitol! "Why?" she asked.\n'
        "John F. Kennedy spoke in 1961. 42 people came.\n\nNew paragraph"
    )
    assert split_sentences(text) == [
        "Mr. Smith went to Washington.",
        "He met Dr. Jones, e.g. at the U.S. Capitol!",
        '"Why?" she asked.',
        "John F. Kennedy spoke in 1961.",
        "42 people came.",
        "New paragraph",
    ]
    assert split_sentences("  \n\n ") == []
    # other scripts: a capital of any, a letter of a script without case, and CJK's full-width ends (no space after)
    assert split_sentences("Привет. Как дела? Хорошо.") == ["Привет.", "Как дела?", "Хорошо."]
    assert split_sentences("今天天气很好。我们去公园吧！你好吗？") == ["今天天气很好。", "我们去公园吧！", "你好吗？"]
    assert split_sentences("「こんにちは。」と言った。次です。") == ["「こんにちは。」と言った。", "次です。"]
    assert split_sentences("मैं घर गया। वह आया।") == ["मैं घर गया।", "वह आया।"]
    # Latin text splits as version 1 split it (English shards, and resumes on them, stay as they were): before an
    # ASCII capital or digit only
    assert split_sentences("He met Émile. Émile was late. ² is squared.") == [
        "He met Émile. Émile was late. ² is squared."
    ]
    long = "This is a sentence. " * 20000  # one line: the abbreviation check looks back over its word, not the line
    assert len(split_sentences(long)) == 20000


# ---------------------------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_train_tokenizer_kinds(tmp_path, corpus, kind):
    from transformers import AutoTokenizer

    out = tmp_path / kind
    train_tokenizer([str(corpus)], out, kind=kind, vocab_size=300, show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [kind]  # no tmp dir left behind
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) % 64 == 0
    specials = [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id]
    assert specials == [0, 1, 2, 3, 4]
    ids = tok("The senator debated the budget.", "Congress agreed.")["input_ids"]
    assert ids[0] == 2 and ids[-1] == 3 and ids.count(3) == 2
    st = special_tokens(tok)
    assert st.vocab_size == len(tok)
    vocab = tok.get_vocab()
    fillers = {i for t, i in vocab.items() if t.startswith("[unused")}
    assert set(st.replaceable.tolist()).isdisjoint(fillers | {0, 1, 2, 3, 4})
    assert len(st.replaceable) == len(tok) - 5 - len(fillers)
    assert tokenizer_hash(out) == tokenizer_hash(out) and len(tokenizer_hash(out)) == 64


def test_fill_mask_pipeline_uses_tokenizer(tok_dir):
    from transformers import BertConfig, BertForMaskedLM, pipeline

    tok = load_tokenizer(tok_dir)
    model = BertForMaskedLM(
        BertConfig(
            vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
    )
    out = pipeline("fill-mask", model=model, tokenizer=tok)("The senator [MASK] the budget.", top_k=2)
    assert len(out) == 2


def test_empty_corpus_and_missing_tokenizer(tmp_path):
    path = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match="empty corpus.*empty.jsonl"):
        train_tokenizer([str(path)], tmp_path / "tok", show_progress=False)
    assert not (tmp_path / "tok").exists()
    with pytest.raises(DataError, match="no tokenizer.json in .*missing"):
        load_tokenizer(tmp_path / "missing")
    # a .txt whose only text is Unicode spaces: a document to the reader, no line to the trainer (Unigram's
    # traceback, WordPiece's useless tokenizer)
    spaces = tmp_path / "spaces.txt"
    spaces.write_text(" \u3000 \n\n\u2003\n", encoding="utf-8")
    for kind in ("wordpiece", "bpe", "unigram"):
        with pytest.raises(DataError, match=r"empty corpus: the documents of .*spaces\.txt hold only whitespace"):
            train_tokenizer([str(spaces)], tmp_path / "tok", kind=kind, show_progress=False)
        assert not (tmp_path / "tok").exists()


# ---------------------------------------------------------------------------------------------- shards


def test_shard_round_trip(corpus, tok_dir, shard_dir):
    tok = load_tokenizer(tok_dir)
    shards = ShardSet(shard_dir, expected_tokenizer_hash=tokenizer_hash(tok_dir))
    docs = [d.text for d in iter_documents([str(corpus)])]
    m = shards.manifest
    assert len(m["shards"]) == 5 and shards.num_docs == len(docs) == m["counts"]["documents"] == 300
    assert shards.num_tokens == m["counts"]["tokens"] == shards.doc_lengths().sum()
    assert shards.dtype == np.uint16 and m["vocab_size"] == len(tok)
    for i in [0, 69, 70, 150, 299]:
        sents = split_sentences(docs[i])
        want = [tok(s, add_special_tokens=False)["input_ids"] for s in sents]
        assert [s.tolist() for s in shards.doc_sentences(i)] == want
        assert shards.doc_tokens(i).tolist() == sum(want, [])
    # A span crossing a shard boundary equals the two documents side by side.
    a, b = shards.doc_tokens(69), shards.doc_tokens(70)
    ids, _ = shards.read_span(int(shards.doc_offsets()[69]), len(a) + len(b))
    assert ids.tolist() == a.tolist() + b.tolist()


def test_word_starts(tmp_path, tok_dir):
    tok = load_tokenizer(tok_dir)
    text = "An unbelievable proposal, said Mr. Smith."
    pieces = tok.tokenize(text)
    assert len([p for p in tok.tokenize("unbelievable")]) > 1  # the word is split, so the test means something
    path = write_jsonl(tmp_path / "one.jsonl", [text])
    build_shards([str(path)], tok_dir, tmp_path / "s", num_workers=0, show_progress=False)
    starts = ShardSet(tmp_path / "s").doc_word_starts(0)
    assert starts.tolist() == [not p.startswith("##") for p in pieces]


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_text_that_spells_a_control_token_is_text_in_the_shards(tmp_path, corpus, kind):
    """ "[SEP]" in a paper about BERT: encoded as the pieces of its characters (what the tokenizer gives with special
    tokens parsed as text), never as the control id, which would end a segment or pad inside a sample."""
    tok_dir = tmp_path / "tok"
    train_tokenizer([str(corpus)], tok_dir, kind=kind, vocab_size=300, show_progress=False)
    text = "The token [SEP] ends a segment and [MASK] hides one; [CLS] and [PAD] too."
    build_shards(
        [str(write_jsonl(tmp_path / "one.jsonl", [text]))], tok_dir, tmp_path / "s", num_workers=0, show_progress=False
    )
    ids = ShardSet(tmp_path / "s").doc_tokens(0).tolist()
    assert not set(ids) & {0, 2, 3, 4}  # [PAD], [CLS], [SEP], [MASK]
    tok = load_tokenizer(tok_dir)
    plain = tok.backend_tokenizer
    plain.encode_special_tokens = True
    assert ids == plain.encode(text, add_special_tokens=False).ids


def test_checksum_and_truncation_detected(tmp_path, corpus, tok_dir):
    out = tmp_path / "s"
    build_shards([str(corpus)], tok_dir, out, num_workers=0, docs_per_shard=100, show_progress=False)
    victim = out / "shard_00001.tokens.bin"
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"checksum mismatch in {victim} \(file changed or truncated\)"):
        ShardSet(out)
    ShardSet(out, verify=False)  # sizes still agree: only the checksum sees the flip
    victim.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match=rf"{victim}.*truncated"):
        ShardSet(out, verify=False)
    with pytest.raises(DataError, match="no manifest.json in .*build shards first"):
        ShardSet(tmp_path)


def test_cache_hit_and_rebuild(tmp_path, corpus, tok_dir, shard_dir):
    mtimes = {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()}
    start = time.perf_counter()
    # docs_per_shard is part of the cache key; the worker count is not (it never changes the output)
    m = build_shards([str(corpus)], tok_dir, shard_dir, num_workers=0, docs_per_shard=70, show_progress=False)
    assert time.perf_counter() - start < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()} == mtimes
    assert m == json.loads((shard_dir / "manifest.json").read_text())
    with pytest.raises(DataError, match="different tokenizer"):
        ShardSet(shard_dir, expected_tokenizer_hash="0" * 64)


def test_a_torn_tokenizer_is_named_before_a_shard_directory_is_made(tmp_path, corpus, tok_dir):
    """The tokenizers library's bare Exception ('EOF while parsing a string'), after the shard directory was claimed."""
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes()[:500])
    for broken in (None, b"{}"):
        if broken is not None:
            (torn / "tokenizer.json").write_bytes(broken)
        with pytest.raises(DataError, match=r"torn/tokenizer.json: not a tokenizer the tokenizers library reads"):
            build_shards([str(corpus)], torn, tmp_path / "shards", num_workers=0, show_progress=False)
        assert not (tmp_path / "shards").exists()
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "manifest.json").write_text("[]")  # an AttributeError traceback
    with pytest.raises(DataError, match=r"listed/manifest.json: not a shard manifest"):
        ShardSet(tmp_path / "listed")


def test_shards_a_run_reads_are_not_rebuilt_under_it(tmp_path, corpus, tok_dir):
    """Two runs on one data.shards: the second, on another corpus, would rewrite the files the first's loader workers
    open by name (old offsets over new tokens, no error). A trainer holds its shard directories shared, and a build
    that would rewrite them is refused, leaving them whole; once the trainer is gone it goes ahead."""
    from data_pipeline.shards import reading_shards

    out = tmp_path / "shards"
    build_shards([str(corpus)], tok_dir, out, num_workers=0, show_progress=False)
    before = snapshot(out)
    other = write_jsonl(tmp_path / "other.jsonl", make_docs(8, seed=3))
    with reading_shards(out):
        with pytest.raises(DataError, match="holds shards another process is reading now"):
            build_shards([str(other)], tok_dir, out, num_workers=0, show_progress=False)
        assert snapshot(out) == before
        build_shards([str(corpus)], tok_dir, out, num_workers=0, show_progress=False)  # the same build: a cache hit
    build_shards([str(other)], tok_dir, out, num_workers=0, show_progress=False)
    assert ShardSet(out).num_docs == 8


def test_empty_corpus_leaves_no_manifest(tmp_path, tok_dir):
    path = write_jsonl(tmp_path / "empty.jsonl", [" ", ""])
    with pytest.raises(DataError, match="empty corpus.*empty.jsonl"):
        build_shards([str(path)], tok_dir, tmp_path / "s", num_workers=0, show_progress=False)
    assert not (tmp_path / "s" / "manifest.json").exists()
    assert not (tmp_path / "s" / ".tmp").exists()


def test_shardset_pickles_without_data(shard_dir):
    import pickle

    shards = ShardSet(shard_dir)
    shards.doc_tokens(0)  # opens the memory maps
    clone = pickle.loads(pickle.dumps(shards))
    assert len(pickle.dumps(shards)) < 100_000
    assert clone.doc_tokens(299).tolist() == shards.doc_tokens(299).tolist()


# ---------------------------------------------------------------------------------------------- samples


@pytest.mark.parametrize("max_seq_len", [16, 64])
def test_packed_sequences_reproduce_stream(shard_dir, max_seq_len):
    shards = ShardSet(shard_dir)
    packed = PackedSequences(shards, max_seq_len, cls_id=2, sep_id=3)
    stream = np.concatenate([np.append(shards.doc_tokens(d).astype(np.int64), 3) for d in range(shards.num_docs)])
    whole = stream
    inner, starts = [], []
    for i in range(len(packed)):
        s = packed[i]
        ids = s["input_ids"]
        assert ids[0] == 2 and ids[-1] == 3 and len(ids) <= max_seq_len
        assert s["input_ids"].dtype == np.int64 and not s["token_type_ids"].any()
        assert s["special_mask"].tolist() == [t in (2, 3) for t in ids]  # the corpus has no literal [CLS]/[SEP]
        assert s["word_starts"][s["special_mask"]].all()
        inner.append(ids[1:-1])
        starts.append(s["word_starts"][1:-1])
    assert all(len(row) == max_seq_len - 2 for row in inner)  # every sample fills the window
    got = np.concatenate(inner)
    want_starts = np.concatenate([np.append(shards.doc_word_starts(d), True) for d in range(shards.num_docs)])
    tail = len(stream) % (max_seq_len - 2)
    if tail >= max_seq_len // 4:  # the last chunk is completed from the start of the stream
        stream, want_starts = (np.concatenate([a, a[: max_seq_len - 2 - tail]]) for a in (stream, want_starts))
    else:  # only a short tail is dropped
        stream, want_starts = stream[: len(stream) - tail], want_starts[: len(want_starts) - tail]
    assert got.tolist() == stream.tolist()
    assert np.concatenate(starts).tolist() == want_starts.tolist()
    with pytest.raises(IndexError):
        packed[len(packed)]

    # for evaluation: every token of the stream once, in order, the last chunk as short as it is (it was filled from
    # the stream's start, scoring those tokens twice, or dropped where under a quarter of a window)
    once = PackedSequences(shards, max_seq_len, cls_id=2, sep_id=3, each_token_once=True)
    rows = [once[i]["input_ids"] for i in range(len(once))]
    assert all(row[0] == 2 and row[-1] == 3 for row in rows)
    assert np.concatenate([row[1:-1] for row in rows]).tolist() == whole.tolist()
    assert len(rows[-1]) == 2 + (len(whole) % (max_seq_len - 2) or max_seq_len - 2)


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_tokenizer_training_is_byte_identical(tmp_path, kind):
    """The same corpus and settings give the same files: WordPiece's '##x' ids and Unigram's float scores used to
    depend on hash-map order (two trainings here differed every time)."""
    corpus = Path(__file__).resolve().parent.parent / "data" / "us-speeches.public-domain.jsonl"
    outputs = []
    for i in range(3):
        train_tokenizer([str(corpus)], tmp_path / str(i), kind=kind, vocab_size=2048, show_progress=False)
        outputs.append({p.name: p.read_bytes() for p in (tmp_path / str(i)).iterdir()})
    assert outputs[0] == outputs[1] == outputs[2]
    vocab = json.loads(outputs[0]["tokenizer.json"])
    assert [t["content"] for t in vocab["added_tokens"]] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_outputs_are_replaced_only_when_ours(tmp_path, tok_dir):
    from pretrain.core.outputs import check_not_input, claim_output, mark_output

    claim_output(tmp_path / "absent", "tokenizer")
    (tmp_path / "empty").mkdir()
    claim_output(tmp_path / "empty", "export")
    claim_output(tok_dir, "tokenizer")  # marked by train_tokenizer
    with pytest.raises(UserError, match="is a tokenizer directory of this tool, not a shards directory"):
        claim_output(tok_dir, "shards")
    # written by a version before the marker: recognised by its signature, a hub tokenizer is not
    legacy = tmp_path / "legacy"
    shutil.copytree(tok_dir, legacy)
    (legacy / ".bert-pretrain.json").unlink()
    claim_output(legacy, "tokenizer")
    spec = json.loads((legacy / "tokenizer.json").read_text())
    spec["added_tokens"][0]["id"] = 100  # BERT-base's [PAD] is 0 but its [UNK] is 100: not one of ours
    spec["added_tokens"][0], spec["added_tokens"][1] = spec["added_tokens"][1], spec["added_tokens"][0]
    (legacy / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match="did not write"):
        claim_output(legacy, "tokenizer")
    hub = tmp_path / "bert-base-uncased"
    hub.mkdir()
    for name in ("config.json", "model.safetensors", "README.md"):
        (hub / name).write_text("{}")
    with pytest.raises(UserError, match="did not write"):
        claim_output(hub, "export")
    (hub / "README.md").write_text("# run\n\n- Objective(s): mlm ()\n")  # our model card: an export of ours
    claim_output(hub, "export")
    mark_output(tmp_path / "run", "run")
    with pytest.raises(UserError, match=r"--out .*/run holds the corpus \("):
        check_not_input(tmp_path / "run", {"the corpus": tmp_path / "run" / "data" / "c.jsonl"})
    check_not_input(tmp_path / "run" / "tok", {"the corpus": tmp_path / "run" / "c.jsonl"})  # beside it: fine


class _Tokens:
    """What the unigram measures read of a ShardSet: num_tokens and read_span(start, n)[0]."""

    def __init__(self, ids):
        self.ids = np.asarray(ids, dtype=np.uint16)
        self.num_tokens = len(self.ids)

    def read_span(self, start, n):
        return self.ids[start : start + n], None


def test_unigram_plateaus_by_hand():
    from data_pipeline.shards import unigram_cross_entropy, unigram_entropy

    # specials (0, 1) are left out: a, b, b, c -> entropy of (1/4, 1/2, 1/4)
    train = _Tokens([0, 2, 3, 3, 4, 1])
    assert unigram_entropy(train, (0, 1)) == pytest.approx(1.5 * math.log(2))
    # held-out 2, 5 under train's add-one counts over ids 2..5: (2, 3, 2, 1) / 8
    held = _Tokens([0, 2, 5, 1])
    expected = -(0.5 * math.log(2 / 8) + 0.5 * math.log(1 / 8))
    assert unigram_cross_entropy(train, held, vocab_size=6, special_ids=(0, 1)) == pytest.approx(expected)
    # on its own corpus it is the entropy plus what smoothing costs; never below the held-out's own entropy
    assert unigram_cross_entropy(held, held, 6, (0, 1)) >= unigram_entropy(held, (0, 1))
    with pytest.raises(ValueError, match="beyond the vocabulary of 4"):
        unigram_cross_entropy(train, held, vocab_size=4, special_ids=(0, 1))


CHINESE = "我们今天去公园散步。他们明天要来学校看书。天气很好，大家都很高兴。"
HINDI = "हिन्दी भाषा बहुत सुंदर है"  # 5 words, with vowel signs (Mc) and a virama (Mn) inside them


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_word_starts_of_unspaced_and_marked_scripts(tmp_path, kind):
    """Whole-word masking's words, for every tokenizer kind as BERT's makes them: each CJK ideograph a word (Chinese
    written without spaces was one word per sentence for byte-level BPE, one per paragraph for Unigram, so a sample
    was masked whole or not at all), and a combining mark inside the word it marks (byte-level BPE cut Hindi words at
    each vowel sign). The default strip_accents removes only nonspacing marks, as BertNormalizer does (StripAccents took
    Hindi's vowel signs too)."""
    from tokenizers.normalizers import BertNormalizer
    from transformers import AutoTokenizer

    english = [d for d in make_docs(30, seed=3)]
    path = write_jsonl(tmp_path / "c.jsonl", english + [CHINESE, HINDI] * 5)
    train_tokenizer([str(path)], tmp_path / "tok", kind=kind, vocab_size=512, show_progress=False)
    normalized = AutoTokenizer.from_pretrained(tmp_path / "tok").backend_tokenizer.normalizer.normalize_str(HINDI)
    assert normalized == BertNormalizer(strip_accents=True).normalize_str(HINDI) == "हिनदी भाषा बहत सदर ह"  # Mn only
    docs = write_jsonl(tmp_path / "d.jsonl", [CHINESE, HINDI])
    build_shards([str(docs)], tmp_path / "tok", tmp_path / "s", num_workers=0, show_progress=False)
    shards = ShardSet(tmp_path / "s")
    ideographs = sum("\u4e00" <= c <= "\u9fff" for c in CHINESE)
    chinese = shards.doc_word_starts(0)
    bounds = np.flatnonzero(np.append(chinese, True))
    # at most a character's 3 bytes and a space piece each
    assert chinese.sum() >= ideographs and np.diff(bounds).max() <= 4, (kind, chinese.astype(int).tolist())
    assert shards.doc_word_starts(1).sum() == 5, (kind, shards.doc_word_starts(1).astype(int).tolist())


PUNCTUATED = "Stop—it is 3.5% of the people (they said), causes. The dog's bone,  and  a tab\\there"


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_a_punctuation_mark_is_a_word_and_spaces_alone_are_none_for_every_tokenizer_kind(tmp_path, kind):
    """Whole-word and span masking's words, as BERT's pre-tokenizer makes them: a punctuation mark is a word of its
    own. A Unigram tokenizer's words were Metaspace's, split at spaces only ("causes." and "people," one word each,
    masked or kept together), where WordPiece's and byte-level BPE's split the mark off. A piece of spaces alone (a
    double space's 'Ġ') was a word to mask by itself; it goes with the word after it. Checked at every boundary
    between two tokens of the text: a space or a punctuation mark on either side starts a word (the spaces' own token
    where they have one), a letter or digit against another continues one."""
    import unicodedata

    from tokenizers import Tokenizer

    def punct(c: str) -> bool:
        return (not c.isalnum() and not c.isspace()) or unicodedata.category(c).startswith("P")

    path = write_jsonl(tmp_path / "c.jsonl", [d for d in make_docs(30, seed=3)] + [PUNCTUATED] * 5)
    train_tokenizer([str(path)], tmp_path / "tok", kind=kind, vocab_size=512, show_progress=False)
    docs = write_jsonl(tmp_path / "d.jsonl", [PUNCTUATED])
    build_shards([str(docs)], tmp_path / "tok", tmp_path / "s", num_workers=0, show_progress=False)
    shards = ShardSet(tmp_path / "s")
    starts = shards.doc_word_starts(0)
    enc = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json")).encode(PUNCTUATED, add_special_tokens=False)
    assert shards.doc_tokens(0).tolist() == enc.ids  # one sentence: the shards' tokens are these
    text, end, checked = PUNCTUATED, 0, 0
    blank = [not text[a:b].strip() for a, b in enc.offsets]  # spaces alone (or nothing: Metaspace's lone '▁')
    for t, (a, b) in enumerate(enc.offsets):
        new = text[max(a, end) : b]
        end, start = max(end, b), max(a, end)
        if t == 0 or not new.strip():  # a byte of the character before, or spaces alone: judged with the next
            continue
        at = start + len(new) - len(new.lstrip())  # the first character this token brings
        if blank[t - 1]:  # the spaces' token starts the word, and this one goes with it
            assert starts[t - 1] and not starts[t], (kind, enc.tokens[t - 1 : t + 1])
        elif text[at - 1].isspace() or punct(text[at - 1]) or punct(text[at]):
            assert starts[t], (kind, enc.tokens[t - 1 : t + 1])
        else:
            assert not starts[t], (kind, enc.tokens[t - 1 : t + 1])
        checked += 1
    assert checked >= 25 and (kind == "wordpiece" or any(blank)), (checked, enc.tokens)


def test_byte_fallback_pieces_are_not_punctuation():
    """A Unigram with byte fallback whose decoder lacks ByteFallback decodes '<0xC3>' as that text: every byte piece
    read as punctuation, a word of its own ('caf', '<0xC3>', '<0xA9>' for "café": three words where it was one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from data_pipeline import shard_encode

    pieces = [("<unk>", 0.0), ("▁caf", -1.0), ("<0xC3>", -2.0), ("<0xA9>", -2.0), (",", -1.0), ("▁", -1.0)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    first, last, blank = shard_encode._piece_edges(tok)
    ids = {p: tok.token_to_id(p) for p, _ in pieces}
    assert not first[ids["<0xC3>"]] and not last[ids["<0xA9>"]] and not blank[ids["<0xC3>"]]
    assert first[ids[","]] and last[ids[","]] and blank[ids["▁"]] and not first[ids["▁caf"]]
