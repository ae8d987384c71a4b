"""Tests of the data pipeline at scale: more input formats, bad input, resumable shard builds (a real
kill -9), cache keys, document-bounded packing, multi-worker/multi-rank loading and `pretrain data inspect`."""

from __future__ import annotations

import collections
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import zstandard
from helpers import CORPUS, make_docs, small_corpus, write_jsonl

from data_pipeline import shard_encode
from data_pipeline.readers import expand_inputs, iter_documents, iter_documents_sample
from data_pipeline.samples import DocPackedSequences, build_samples, builder_kind, doc_chunk_starts
from data_pipeline.shards import ShardSet, build_key, build_shards
from data_pipeline.tokenizer import load_tokenizer, special_tokens, tokenizer_hash, train_tokenizer
from pretrain.core.errors import DataError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl", make_docs(400, seed=1))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("tok") / "wordpiece"
    train_tokenizer([str(corpus)], out, vocab_size=256, show_progress=False)
    return out


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, corpus, tok_dir):
    out = tmp_path_factory.mktemp("shards") / "shards"
    build_shards([str(corpus)], tok_dir, out, num_workers=0, docs_per_shard=90, show_progress=False)
    return out


# ---------------------------------------------------------------------------------------------- readers


def test_zstd_parquet_arrow_and_datasets_dir(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(12, seed=2)
    (tmp_path / "a.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress("".join(json.dumps({"text": d}) + "\n" for d in docs[:3]).encode())
    )
    pq.write_table(pa.table({"id": list(range(4)), "body": docs[3:7]}), tmp_path / "b.parquet", row_group_size=2)
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"body": docs[7:12]}).save_to_disk(str(tmp_path / "c_ds"))

    got = list(iter_documents([str(tmp_path / "a.jsonl.zst")]))
    assert [d.text for d in got] == docs[:3] and got[2].line == 3
    got = list(iter_documents([str(tmp_path)], text_field="body", on_bad="skip"))
    # the zstd file has no 'body' field: 3 counted skips; then 4 Parquet rows and the dataset's 5 rows
    assert [d.text for d in got] == docs[3:12]
    assert got[5].line == 2 and got[5].source.endswith(".arrow")  # row numbers are per arrow file
    assert expand_inputs([str(tmp_path)]) == [tmp_path / "a.jsonl.zst", tmp_path / "b.parquet", tmp_path / "c_ds"]
    # a pattern into the dataset directory reads it as one input, not its state.json as JSON Lines
    assert expand_inputs([str(tmp_path / "c_ds" / "*")]) == [tmp_path / "c_ds"]

    with pytest.raises(DataError, match=r"b\.parquet: no column 'text' \(columns: id, body\); set data.text_field"):
        list(iter_documents([str(tmp_path / "b.parquet")]))
    with pytest.raises(DataError, match=r"c_ds.*data-00000-of-00001\.arrow: no column 'text'"):
        list(iter_documents([str(tmp_path / "c_ds")]))

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict \(splits: train\); name one split directory"):
        expand_inputs([str(tmp_path / "dd")])
    assert [d.text for d in iter_documents([str(tmp_path / "dd" / "train")])] == ["x"]


def test_outputs_inside_a_corpus_directory_are_not_corpus(tmp_path):
    """A tokenizer and shards written inside the corpus directory they are built from: the walk does not read their
    .json files as corpus (it skips this tool's marked outputs), so the same build again is the cache hit it was."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", make_docs(30, seed=4))
    train_tokenizer([str(corpus)], corpus / "tok", vocab_size=256, show_progress=False)
    first = build_shards([str(corpus)], corpus / "tok", corpus / "shards")
    (corpus / "shards" / "notes.json").write_text('{"text": "the user\'s, in an output of ours"}')
    assert expand_inputs([str(corpus)]) == [corpus / "a.jsonl"]
    again = build_shards([str(corpus)], corpus / "tok", corpus / "shards")
    assert again == first and again["counts"]["documents"] == 30


def test_parquet_null_and_corrupt_zstd_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", None, "  ", "four"]}), tmp_path / "n.parquet")
    skipped = collections.Counter()
    assert [d.line for d in iter_documents([str(tmp_path / "n.parquet")], skipped=skipped)] == [1, 4]
    assert skipped == {"missing_field": 1, "empty": 1}
    with pytest.raises(DataError, match=r"n\.parquet: row 2: 'text' is null"):
        list(iter_documents([str(tmp_path / "n.parquet")], on_bad="error"))
    # dictionary-encoded text (pandas' categorical): its values, not "not text"
    labels = pa.array(["same words", "other words", "same words"]).dictionary_encode()
    pq.write_table(pa.table({"text": labels}), tmp_path / "d.parquet")
    words = [d.text for d in iter_documents([str(tmp_path / "d.parquet")])]
    assert words == ["same words", "other words", "same words"]
    pq.write_table(pa.table({"text": pa.array([1, 2]).dictionary_encode()}), tmp_path / "i.parquet")
    with pytest.raises(DataError, match=r"i\.parquet: column 'text' is int64, not text"):
        list(iter_documents([str(tmp_path / "i.parquet")]))

    blob = zstandard.ZstdCompressor().compress(b"".join(b'{"text": "doc %d"}\n' % i for i in range(5000)))
    (tmp_path / "t.jsonl.zst").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataError, match=r"t\.jsonl\.zst: cannot decompress after line \d+.*truncated or corrupt"):
        list(iter_documents([str(tmp_path / "t.jsonl.zst")]))


def test_zstd_cut_anywhere_inside_a_frame_is_named(tmp_path):
    """Concatenated frames (one with a checksum and no content size) and a skippable frame read through; a file cut
    anywhere but between frames is an error naming the frame, never a quiet end (zstandard's stream_reader ends
    quietly there, and the frame walk that catches it reads headers only)."""
    records = [b"".join(b'{"text": "doc %d %d"}\n' % (f, i) for i in range(400)) for f in range(3)]
    frames = [zstandard.ZstdCompressor().compress(r) for r in records[:2]]
    frames.insert(1, (0x184D2A5A).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"notes")  # skippable
    frames.append(zstandard.ZstdCompressor(write_checksum=True, write_content_size=False).compress(records[2]))
    whole = b"".join(frames)
    ends = list(itertools.accumulate(map(len, frames)))
    docs_before = {end: 400 * sum(1 for e in ends[: i + 1] if e != ends[1]) for i, end in enumerate(ends)}
    path = tmp_path / "m.jsonl.zst"
    path.write_bytes(whole)
    assert len(list(iter_documents([str(path)]))) == 1200
    for cut in sorted(set(range(1, len(whole), 37)) | {len(whole) - k for k in range(1, 6)} | set(ends)):
        path.write_bytes(whole[:cut])
        if cut in docs_before:
            assert len(list(iter_documents([str(path)]))) == docs_before[cut]
            continue
        with pytest.raises(DataError, match=r"ends inside the zstd frame that starts at byte \d+.*truncated"):
            list(iter_documents([str(path)]))


def test_truncated_arrow_stream_is_named(tmp_path, capfd):
    """An Arrow stream cut at a record-batch boundary read short with no word (pyarrow takes the end of the file for
    the end of the stream; the format's end marker is optional, so it is read, and said); a cut inside a batch
    raised pyarrow's ArrowInvalid: a DataError naming the file."""
    import io

    import pyarrow as pa

    table = pa.table({"text": [f"document {i} has some text." for i in range(100)], "n": list(range(100))})
    sink, ends = io.BytesIO(), []
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=10):
            writer.write_batch(batch)
            ends.append(sink.tell())
    data = sink.getvalue()
    whole = tmp_path / "whole.arrow"
    whole.write_bytes(data)
    assert len(list(iter_documents([str(whole)]))) == 100
    assert "end-of-stream" not in capfd.readouterr().err
    at_a_batch = tmp_path / "at_a_batch.arrow"
    at_a_batch.write_bytes(data[: ends[4]])
    assert len(list(iter_documents([str(at_a_batch)]))) == 50
    err = capfd.readouterr().err
    assert f"{at_a_batch}: the Arrow stream ends after 5 record batch(es) without its end-of-stream" in err
    assert "truncated" in err
    inside = tmp_path / "inside.arrow"
    inside.write_bytes(data[: ends[4] + 40])
    with pytest.raises(DataError, match=rf"{inside}: .*truncated"):
        list(iter_documents([str(inside)]))


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "jsonl.zst"])
def test_huge_line_bounded_memory(tmp_path, fmt):
    """A 16 MiB line without a newline, limit 1 MiB: skipped and counted (or an error naming file:line),
    never read whole (memory is a few times the limit, not the line), and the documents after it come through.
    Compressed too: zstd makes a few KiB of that line, which zstandard's decompressobj handed back whole."""
    huge = "x" * (16 << 20)
    path = tmp_path / f"big.{fmt}"
    if fmt == "txt":
        path.write_text("before\n\n" + huge + "\nmore of it\n\nafter")
    else:
        text = json.dumps({"text": "before"}) + "\n" + json.dumps({"text": huge}) + "\n" + json.dumps({"text": "after"})
        path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()) if fmt.endswith(".zst") else text.encode())
    skipped = collections.Counter()
    tracemalloc.start()
    docs = [d.text for d in iter_documents([str(path)], skipped=skipped, max_document_bytes=1 << 20)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert docs == ["before", "after"] and skipped == {"too_long": 1}
    assert peak < 5 << 20, f"peak {peak} bytes: the long line was held whole"
    with pytest.raises(DataError, match=rf"{path}:\d: document of .* exceeds max_document_bytes=1048576"):
        list(iter_documents([str(path)], on_bad="error", max_document_bytes=1 << 20))


def test_tokenizer_sample_spreads_over_files(tmp_path):
    for name in "abc":
        write_jsonl(tmp_path / f"{name}.jsonl", [f"{name} document {i}." for i in range(50)])
    got = [Path(d.source).stem for d in iter_documents_sample([str(tmp_path)], 9)]
    assert got == ["a"] * 3 + ["b"] * 3 + ["c"] * 3


@pytest.fixture(scope="module")
def speech_tokenizers(tmp_path_factory):
    """A tokenizer of each kind trained on real text (the embedded corpus): its numbers, dates and quotes are what
    split a byte-level BPE word in two ('16th': 'Ġ16', 'th')."""
    out = tmp_path_factory.mktemp("speech_tok")
    corpus = small_corpus(out, slice(0, 40))
    # runs of spaces and tabs, so that byte-level BPE learns pieces of several ('ĠĠ'): a run split apart shows
    spaced = [f"the  \tnation {i}   shall\t\t be  \t free \t \tof\t \tit." for i in range(200)]
    spaced = write_jsonl(out / "spaced.jsonl", spaced)
    for kind in ("wordpiece", "bpe", "unigram"):
        train_tokenizer([str(corpus), str(spaced)], out / kind, kind=kind, vocab_size=1000, show_progress=False)
    # a tokenizer of no normalizer (GPT-2's) and one of an empty Sequence (falsy: its length is 0)
    for kind, normalizer in (("bpe", None), ("unigram", {"type": "Sequence", "normalizers": []})):
        spec = json.loads((out / kind / "tokenizer.json").read_text())
        (out / f"{kind}-unnormalized").mkdir()
        (out / f"{kind}-unnormalized" / "tokenizer.json").write_text(json.dumps(dict(spec, normalizer=normalizer)))
    return out


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram", "bpe-unnormalized", "unigram-unnormalized"])
def test_word_fast_path_matches_encode_batch(speech_tokenizers, kind, monkeypatch):
    """The distinct-word paths (WordPiece's words, byte-level BPE's and Metaspace's chunks) give exactly the ids and
    word starts of encode_batch + word_ids, on real text and on text made to break them: runs of spaces of every
    kind, spaces before a mark, accents that NFKC turns into a space and a mark, scripts decided by their characters."""
    spaces = "".join(chr(c) for c in range(0x3100) if chr(c).isspace()) + "\u200b\u180e\ufeff"
    texts = (
        [json.loads(line)["text"][:4000] for line in CORPUS.read_text().splitlines()[40:52]]
        + [
            "Caf\u00e9 na\u00efve \u00c9COLE  two  spaces\ttab \u4e2d\u6587 x\u200by [MASK]word e\u0301 \u0130stanbul "
            "\U0001f600!!! hello,world foo-bar's (x) unbelievably",
            "  \u00a0 leading",
            "a \u00b4 b  x\u00b4 y \u00a8z the 16th of May, '60s  \n  end  ",
            "the  \tnation   shall\t\t be  \t free  \t \t. ",
            # no run of spaces: these take str.split's way to chunks, where a space after a tab was taken for a start
            "a\t \tb x\u2028\u00b4 x\u0085\u00a8 x\u2028 \u2028y",
            "x\u2028\u00b4",
            "\u0939\u093f\u0928\u094d\u0926\u0940 \u092d\u093e\u0937\u093e and \u4e2d\u6587\u5b57 mixed . \u0301x",
        ]
        + [f"ab{c}cd ef{c}{c}gh {c}ij{c} kl." for c in spaces]
    )
    tokenizer = str(speech_tokenizers / kind / "tokenizer.json")
    monkeypatch.setattr(shard_encode, "_NEW_WORDS_MAX", 1.0)  # the word path for every slice, however new its words
    results = []
    for fast in (True, False):
        shard_encode._worker.clear()
        shard_encode._init_worker(tokenizer, "/tmp", "uint16", 1, fast)
        path = shard_encode._worker["continuation" if kind == "wordpiece" else "chunked"]
        assert (path is not None) == fast
        parts = [shard_encode._encode_slice(texts[i : i + 7]) for i in range(0, len(texts), 7)]
        results.append([np.concatenate([p[k] for p in parts]) for k in range(4)])
    shard_encode._worker.clear()
    for fast, slow in zip(*results):
        assert fast.tolist() == slow.tolist()


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_words_that_rarely_repeat_go_through_encode_batch(speech_tokenizers, kind, monkeypatch):
    """A cache pays only for words that repeat: slices of hashes (every word new) go through encode_batch, trying the
    word path again every 8th slice; prose stays on it, its first slice (an empty cache) included."""
    calls = []
    encode_words = shard_encode._encode_words
    monkeypatch.setattr(shard_encode, "_encode_words", lambda sentences: calls.append(1) or encode_words(sentences))
    rng = np.random.default_rng(0)
    hashes = [[" ".join(rng.bytes(6).hex() for _ in range(40)) + "." for _ in range(20)] for _ in range(10)]
    prose = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:20]]
    shard_encode._worker.clear()
    shard_encode._init_worker(str(speech_tokenizers / kind / "tokenizer.json"), "/tmp", "uint16", 1)
    took = []
    for texts in hashes + [prose] * 10:
        calls.clear()
        shard_encode._encode_slice(texts)
        took.append(len(calls))
    shard_encode._worker.clear()
    assert took[:10] == [1, 0, 0, 0, 0, 0, 0, 0, 1, 0]  # (the first slice finds out, the 9th tries again)
    assert took[10:] == [0] * 6 + [1] * 4  # prose waits for the next try, then stays
    # whichever way a slice goes, its shards are the same: a mark after punctuation, where encode_batch's word rules
    # (a combining mark continues a word) are not WordPiece's (its pieces say where words start)
    marks = ["\u0939\u093f\u0928\u094d\u0926\u0940 (\u093f\u0915) -\u093e and, the text."]
    shard_encode._init_worker(str(speech_tokenizers / kind / "tokenizer.json"), "/tmp", "uint16", 1)
    by_words = shard_encode._encode_slice(marks)
    shard_encode._encode_slice(hashes[0])  # (new words: the next slice goes through encode_batch)
    calls.clear()
    by_batch = shard_encode._encode_slice(marks)
    shard_encode._worker.clear()
    assert not calls and all(a.tolist() == b.tolist() for a, b in zip(by_words, by_batch))


def test_ascii_normalizer_gives_the_tokenizers_text(speech_tokenizers):
    """On ASCII text the Python normalizer of the chunked path gives exactly the text the tokenizers library's does,
    for each kind's normalizer and steps a user's tokenizer may hold; a step it does not know: left to the library."""
    from tokenizers import Regex, Tokenizer
    from tokenizers import normalizers as n

    rng = np.random.default_rng(0)
    texts = ["".join(map(chr, range(128))), *("".join(map(chr, rng.integers(0, 128, 60))) for _ in range(200))]
    texts += ["The  Nation\t\tSHALL \x1c\x1d be\r\n\x0b\x0cfree ab AB"]
    kinds = [Tokenizer.from_file(str(speech_tokenizers / k / "tokenizer.json")).normalizer for k in ("bpe", "unigram")]
    steps = [n.NFKC(), n.Replace("ab", "x"), n.Lowercase(), n.Replace(Regex(r"\s+"), "_"), n.StripAccents(), n.NFD()]
    for normalizer in [*kinds, n.Sequence(steps), n.Lowercase(), None]:
        python = shard_encode._ascii_normalizer(normalizer)
        for text in texts:
            assert python(text) == (normalizer.normalize_str(text) if normalizer else text), (normalizer, text)
    for unknown in (n.Strip(), n.Replace(Regex("[a-c]"), ""), n.Replace(" ", "\u2581"), n.Sequence([n.Prepend("_")])):
        assert shard_encode._ascii_normalizer(unknown) is None


def test_word_cache_cleared_mid_batch_encodes_every_word(tok_dir, monkeypatch):
    """A batch whose new words overflow the word cache clears it: the words it had cached are encoded again."""
    monkeypatch.setattr(shard_encode, "_WORD_CACHE_MAX", 10)
    texts = ["one two three four five six seven eight.", "one two three nine ten eleven twelve."]
    got = []
    for fast in (True, False):
        shard_encode._worker.clear()
        shard_encode._init_worker(str(tok_dir / "tokenizer.json"), "/tmp", "uint16", 1, fast)
        got.append([shard_encode._encode_slice([t])[0].tolist() for t in texts])
    shard_encode._worker.clear()
    assert got[0] == got[1]


# ---------------------------------------------------------------------------------------------- shards


def test_cache_key_covers_inputs_tokenizer_and_settings(tmp_path, corpus, tok_dir):
    settings = dict(
        format_version=1,
        splitter_version=1,
        text_field="text",
        docs_per_shard=10,
        on_bad="skip",
        max_document_bytes=1 << 20,
    )
    key, _ = build_key([str(corpus)], "t" * 64, settings)
    assert build_key([str(corpus)], "t" * 64, dict(settings))[0] == key
    for change in (
        {"docs_per_shard": 11},
        {"text_field": "body"},
        {"on_bad": "error"},
        {"max_document_bytes": 2 << 20},
        {"splitter_version": 2},
    ):
        assert build_key([str(corpus)], "t" * 64, {**settings, **change})[0] != key, change
    assert build_key([str(corpus)], "u" * 64, settings)[0] != key
    copy = tmp_path / "docs.jsonl"
    copy.write_bytes(corpus.read_bytes())
    assert build_key([str(copy)], "t" * 64, settings)[0] != key  # another path (and mtime)
    os.utime(copy, ns=(1, 1))
    key_copy = build_key([str(copy)], "t" * 64, settings)[0]
    os.utime(copy, ns=(2, 2))
    assert build_key([str(copy)], "t" * 64, settings)[0] != key_copy  # touched


def test_stale_partial_build_is_cleared_and_setting_change_rebuilds(tmp_path, corpus, tok_dir):
    out = tmp_path / "s"
    out.mkdir()
    (out / "build.json").write_text(json.dumps({"cache_key": "0" * 64}))
    (out / "shard_00007.tokens.bin").write_bytes(b"stale")
    (out / "shard_00007.done.json").write_text("{}")
    m = build_shards([str(corpus)], tok_dir, out, num_workers=0, docs_per_shard=200, show_progress=False)
    assert not (out / "shard_00007.tokens.bin").exists() and not (out / "shard_00007.done.json").exists()
    assert not (out / "build.json").exists() and not list(out.glob("*.done.json"))
    assert [s["name"] for s in m["shards"]] == ["shard_00000", "shard_00001"]
    m2 = build_shards([str(corpus)], tok_dir, out, num_workers=0, docs_per_shard=150, show_progress=False)
    assert m2["cache_key"] != m["cache_key"] and len(m2["shards"]) == 3
    assert sorted(p.name for p in out.glob("shard_*.tokens.bin")) == [f"shard_0000{i}.tokens.bin" for i in range(3)]


def test_kill_9_mid_build_then_resume_matches_uninterrupted(tmp_path, tok_dir):
    corpus = write_jsonl(tmp_path / "big.jsonl", make_docs(6000, seed=4))
    args = dict(num_workers=2, docs_per_shard=25, show_progress=False)
    out = tmp_path / "killed"
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); from data_pipeline.shards import build_shards; "
        f"build_shards([{str(corpus)!r}], {str(tok_dir)!r}, {str(out)!r}, **{args!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list(out.glob("*.done.json"))) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the builder and its pool workers, as an OOM killer or scancel would
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the build finished before it could be killed: make it bigger"
    assert not (out / "manifest.json").exists()
    with pytest.raises(DataError, match="no manifest.json"):
        ShardSet(out)
    done_before = {p.name.split(".")[0] for p in out.glob("*.done.json")}
    mtimes = {n: (out / f"{n}.tokens.bin").stat().st_mtime_ns for n in done_before}
    assert 4 <= len(done_before) < 240

    resumed = build_shards([str(corpus)], tok_dir, out, **args)
    for n, mtime in mtimes.items():  # finished shards were not tokenized again
        assert (out / f"{n}.tokens.bin").stat().st_mtime_ns == mtime
    clean = build_shards([str(corpus)], tok_dir, tmp_path / "clean", **args)
    assert resumed["shards"] == clean["shards"] and resumed["counts"] == clean["counts"]
    assert resumed["cache_key"] == clean["cache_key"]
    assert not (out / ".tmp").exists() and not list(out.glob("*.done.json")) and not (out / "build.json").exists()
    ShardSet(out, verify=True)


def test_damaged_done_shard_is_redone_and_bit_flip_named(tmp_path, corpus, tok_dir):
    out = tmp_path / "s"
    args = dict(num_workers=0, docs_per_shard=100, show_progress=False)
    build_shards([str(corpus)], tok_dir, out, **args)
    good = (out / "shard_00001.tokens.bin").read_bytes()
    # Simulate a crash after shard 1 was recorded, then a damaged file: the re-run must redo shard 1 only.
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").unlink()
    (out / "build.json").write_text(json.dumps({"cache_key": manifest["cache_key"]}))
    for i, s in enumerate(manifest["shards"]):
        (out / f"{s['name']}.done.json").write_text(
            json.dumps({**s, "index": i, "dropped_docs": 0, "input_docs": s["documents"]})
        )
    (out / "shard_00001.tokens.bin").write_bytes(good[:-2])
    build_shards([str(corpus)], tok_dir, out, **args)
    assert (out / "shard_00001.tokens.bin").read_bytes() == good

    flipped = bytearray(good)
    flipped[3] ^= 0x10
    (out / "shard_00001.tokens.bin").write_bytes(bytes(flipped))
    with pytest.raises(DataError, match=r"checksum mismatch in .*shard_00001\.tokens\.bin"):
        ShardSet(out, verify=True, expected_tokenizer_hash=tokenizer_hash(tok_dir))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts this process's open files in /proc")
def test_a_corpus_of_more_shards_than_the_process_may_open_is_read_whole(tmp_path, tok_dir):
    """Every shard memory-mapped at the first read held two file descriptors per shard: 120 shards under a limit of 200
    more open files (a million documents under ulimit -n 1024, at the default docs_per_shard) failed with 'Too many
    open files'. A few are mapped, the rest read with pread; what is read is the same."""
    import resource

    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs(120, seed=5))
    build_shards([str(corpus)], tok_dir, tmp_path / "s", num_workers=0, docs_per_shard=1, show_progress=False)
    names = [s["name"] for s in json.loads((tmp_path / "s" / "manifest.json").read_text())["shards"]]
    files = [np.fromfile(tmp_path / "s" / f"{n}.tokens.bin", np.uint16) for n in names]
    bits = [
        np.unpackbits(np.fromfile(tmp_path / "s" / f"{n}.words.bin", np.uint8))[: len(f)] for n, f in zip(names, files)
    ]
    want_ids, want_words = np.concatenate(files), np.concatenate(bits).astype(bool)
    open_files = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files + 200, hard))
    try:
        shards = ShardSet(tmp_path / "s")
        assert len(names) == 120
        spans = [(int(a), int(b - a)) for a, b in zip(shards.doc_offsets()[:-1], shards.doc_offsets()[1:])]
        spans += [(0, shards.num_tokens), (3, 61), (shards.num_tokens - 50, 50)]  # across shards, unaligned bits
        spans += [(0, 0), (int(shards.doc_offsets()[7]), 0), (shards.num_tokens, 0)]  # empty, the end's too
        for start, length in spans:
            ids, words = shards.read_span(start, length)
            assert ids.tolist() == want_ids[start : start + length].tolist()
            assert words.tolist() == want_words[start : start + length].tolist()
        assert len(os.listdir("/proc/self/fd")) - open_files <= 2 * ((open_files + 200) // 16)  # an eighth of them
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---------------------------------------------------------------------------------------------- samples


def test_doc_packed_never_crosses_a_document(shard_dir, tok_dir):
    shards = ShardSet(shard_dir)
    tokens = special_tokens(load_tokenizer(tok_dir))
    for L in (12, 40, 128):
        ds = build_samples(builder_kind("packed", "doc_bounded"), shards, L, tokens, seed=0)
        assert isinstance(ds, DocPackedSequences)
        starts, docs, sents = ds._starts, shards.doc_offsets(), shards.sent_offsets()
        assert starts[0] == 0 and starts[-1] == shards.num_tokens and np.all(np.diff(starts) > 0)
        assert set(docs.tolist()) <= set(starts.tolist())  # every document starts a sample
        doc_of_first = np.searchsorted(docs, starts[:-1], "right") - 1
        doc_of_last = np.searchsorted(docs, starts[1:] - 1, "right") - 1
        assert np.array_equal(doc_of_first, doc_of_last)  # ... and no sample spans two
        assert ds.chunk_lengths().max() <= L - 2
        # A cut inside a document is at a sentence boundary unless that sentence alone exceeds a chunk.
        inner = np.setdiff1d(starts, docs)
        off_sentence = np.setdiff1d(inner, sents)
        sent_lens = np.diff(sents)
        owner = np.searchsorted(sents, off_sentence, "right") - 1
        assert np.all(sent_lens[owner] > L - 2)
        for i in (0, len(ds) // 2, len(ds) - 1):
            s = ds[i]
            lo, hi = starts[i], starts[i + 1]
            assert s["input_ids"][1:-1].tolist() == shards.read_span(int(lo), int(hi - lo))[0].tolist()
            assert s["input_ids"][0] == tokens.cls and s["input_ids"][-1] == tokens.sep
            assert s["special_mask"].tolist() == [True] + [False] * int(hi - lo) + [True]
    with pytest.raises(ValueError, match="data.packing"):
        builder_kind("packed", "nope")
    assert builder_kind("pairs", "doc_bounded") == "pairs"


def test_doc_chunk_starts_long_sentence():
    docs = np.array([0, 3, 25, 30])
    sents = np.array([0, 3, 5, 22, 25, 30])  # document 1 has a 17-token sentence
    assert doc_chunk_starts(docs, sents, 6).tolist() == [0, 3, 5, 11, 17, 22, 25, 30]


# ---------------------------------------------------------------------------------------------- loader


def _batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch_equal(a[k], b[k]), k


def torch_equal(x, y):
    import torch

    return x.shape == y.shape and bool(torch.equal(x, y))


def test_loader_workers_resume_and_world_size(shard_dir, tok_dir):
    from data_pipeline.loader import PretrainDataset, build_loader
    from objectives import build_objectives

    tokens = special_tokens(load_tokenizer(tok_dir))
    objectives = build_objectives({"mlm": {}}, tokens)
    ds = PretrainDataset(build_samples("packed", ShardSet(shard_dir), 32, tokens, 7), objectives, seed=7)
    # start 2 batches before the end of epoch 0, so the batches cross into epoch 1 (a new order and masks)
    first = (len(ds) // 8 - 2) * 8
    ref = _batches(build_loader(ds, tokens.pad, first, 8, 1, 0, 1, num_workers=0), 6)
    multi = _batches(build_loader(ds, tokens.pad, first, 8, 1, 0, 1, num_workers=2), 6)
    for a, b in zip(ref, multi):
        _same(a, b)
    assert ref[0]["mlm_labels"].ne(-100).any()
    # epoch 1 is another order of the same samples (the workers agreeing with the main process cannot show it)
    orders = [[ds.place(e * len(ds) + i)[2] for i in range(len(ds))] for e in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(len(ds))) and orders[0] != orders[1]
    # resume 3 steps later (in epoch 1): O(1), the same next batches
    for a, b in zip(ref[3:], _batches(build_loader(ds, tokens.pad, first + 24, 8, 1, 0, 1, num_workers=2), 3)):
        _same(a, b)
    # 2 ranks x micro 2 x accum 2 == 1 rank x micro 8: each step's union of micro-batches is the same samples
    ranks = [_batches(build_loader(ds, tokens.pad, first, 2, 2, r, 2, num_workers=0), 8) for r in range(2)]
    for step in range(4):
        parts = [ranks[r][step * 2 + a] for a in range(2) for r in range(2)]  # micro-step a, rank r order
        # widths differ (each micro-batch pads to its own longest sample): compare the real tokens
        got = sorted(tuple(row[m].tolist()) for p in parts for row, m in zip(p["input_ids"], p["attention_mask"]))
        want = sorted(tuple(row[m].tolist()) for row, m in zip(ref[step]["input_ids"], ref[step]["attention_mask"]))
        assert got == want and sum(len(p["input_ids"]) for p in parts) == 8


# ---------------------------------------------------------------------------------------------- inspect


def test_data_inspect_cli(tmp_path, shard_dir, tok_dir, capsys):
    from pretrain.cli import main

    png = tmp_path / "hist.png"
    rc = main(
        [
            "data",
            "inspect",
            "tiny",
            f"data.shards={shard_dir}",
            f"data.tokenizer={tok_dir}",
            "data.max_seq_len=32",
            "--out",
            str(png),
            "--samples",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    counts = json.loads((shard_dir / "manifest.json").read_text())["counts"]
    assert f"tokens {counts['tokens']:,}" in out and f"documents  {counts['documents']:,}" in out
    assert "* packed" in out and "doc_packed" in out and str(png) in out
    assert out.count("position ") == 2 and "[MASK](" in out
    rc = main(["data", "inspect", str(tmp_path)])
    assert rc == 2 and "not a shard directory" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts this process's open files in /proc")
def test_a_mixtures_sources_together_map_at_most_the_process_share(tmp_path, tok_dir):
    """Each ShardSet mapped up to an eighth of the process's open-file limit: a mixture's sources are one set each
    (`sources()`, as training reads them), so 8 sources of 30 shards under a limit of 200 more open files mapped
    8 x 2 x 12 and failed with 'Too many open files'. The share is the process's, whichever sets hold the maps."""
    import resource

    from data_pipeline.shard_build import write_mixture
    from pretrain.core.outputs import mark_output

    mark_output(tmp_path / "m", "shards")  # as `pretrain shards` does before it builds the sources inside
    built = []
    for i in range(8):
        corpus = write_jsonl(tmp_path / f"c{i}.jsonl", make_docs(30, seed=i))
        manifest = build_shards(
            [str(corpus)], tok_dir, tmp_path / "m" / f"s{i}", num_workers=0, docs_per_shard=1, show_progress=False
        )
        built.append((f"s{i}", 1.0, manifest))
    write_mixture(tmp_path / "m", built)
    want = [
        np.concatenate([np.fromfile(f, np.uint16) for f in sorted((tmp_path / "m" / name).glob("*.tokens.bin"))])
        for name, _, _ in built
    ]
    open_files = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files + 200, hard))
    try:
        parts = [part for _, _, part in ShardSet(tmp_path / "m").sources()]
        for part, tokens in zip(parts, want):
            assert part.read_span(0, part.num_tokens)[0].tolist() == tokens.tolist()
        assert len(os.listdir("/proc/self/fd")) - open_files <= 2 * ((open_files + 200) // 16)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_epochs_order_is_the_same_permutation_at_half_the_memory():
    """Every loader worker of every rank holds its epoch's order: int64 was 8 bytes a sample (1.6 GB per worker for
    200M samples); uint32 keeps the very same order (runs in flight resume into the same samples) at 4."""
    from data_pipeline import loader

    n = 1_000_003
    order = loader.epoch_order(n, seed=7, epoch=2)
    assert order.dtype == np.uint32 and order.nbytes == 4 * n
    before = np.random.default_rng([7, loader._ORDER_STREAM, 2]).permutation(n)  # int64, as it was
    assert np.array_equal(order, before)
    assert np.array_equal(np.sort(order), np.arange(n))
