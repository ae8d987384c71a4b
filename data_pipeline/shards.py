"""Tokenized, memory-mapped corpus shards: parallel, resumable build, manifest, verification, random access.

Layout of `out_dir` (n = tokens, d = documents, s = sentences of one shard):
    shard_00000.tokens.bin  [n] uint16/uint32 raw token ids, no special tokens
    shard_00000.docs.npy    [d+1] int64 token offsets of documents
    shard_00000.sents.npy   [s+1] int64 token offsets of sentences (document starts are sentence starts)
    shard_00000.words.bin   [ceil(n/8)] np.packbits of a bool per token: True where a word starts
    manifest.json           written last, atomically: a directory is complete iff it has one

Build protocol (safe against kill -9 at any instant):
- Shard i is documents [i*docs_per_shard, (i+1)*docs_per_shard) of the document stream, so a shard's
  content depends only on the inputs and settings, never on timing or the number of workers.
- The build's cache key (inputs' paths, sizes and mtimes; the tokenizer's hash; every setting that changes
  the output) goes to build.json first. A re-run with the same key resumes; another key clears the directory.
- Workers write a shard's files into `.tmp/` under their pid; the parent renames them into place, then
  writes `shard_i.done.json` with their checksums. A re-run re-reads the stream but skips every shard whose
  done record and files agree, so only missing shards are tokenized again. A file without a done record,
  or whose checksum disagrees with it, is redone: a half-written shard can never verify.
- The manifest is assembled from the done records and written last; then the records go.
- An flock on `.lock` refuses a second concurrent build into the same directory (released by the kernel
  even on kill -9); a directory holding anything else than a shard build of ours is refused, never cleared.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from data_pipeline.readers import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    describe_inputs,
    expand_inputs,
    input_fingerprint,
    iter_documents,
)
from data_pipeline.sentences import SPLITTER_VERSION, split_sentences
from data_pipeline.tokenizer import tokenizer_hash
from pretrain.core.errors import DataError
from pretrain.core.files import sha256_file, write_json_atomic
from pretrain.core.outputs import check_not_input, claim_output, exclusive, mark_output

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BUILD_STATE = "build.json"
DONE = ".done.json"
SUFFIXES = (".tokens.bin", ".docs.npy", ".sents.npy", ".words.bin")
TMP = ".tmp"


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ---------------------------------------------------------------------------------------------- workers

_worker: dict = {}
_ENCODE_DOCS = 256
"""Documents tokenized per encode_batch call. A tokenizers Encoding costs ~100 bytes per token; taking a
shard's documents in slices and keeping only compact numpy arrays bounds a worker's memory by the slice."""


# The characters the BERT normalizer turns into a space (Rust's char::is_whitespace minus the control
# characters, which it deletes instead): every other step of BERT normalization, pre-tokenization and
# WordPiece acts within a run of text between two of these, so such a run always tokenizes the same.
_BERT_SPACE = re.compile("[ \t\n\r\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")
# Characters Python's str.split() splits on but BERT deletes (controls): text without them can use the
# much faster str.split(), which splits on exactly the BERT spaces then.
_NOT_BERT_SPACE = re.compile("[\x0b\x0c\x1c-\x1f\x85]")
_WORD_CACHE_MAX = 200_000  # words -> ids kept per worker (~30 MB); cleared when full, so memory is bounded


def _word_fast_path(tok) -> np.ndarray | None:
    """[vocab] bool table of WordPiece continuation pieces ('##ing') when the tokenizer is BERT's pipeline
    (BertNormalizer, BertPreTokenizer, WordPiece), else None.

    For that pipeline (a) a token starts a word exactly when it is not a continuation piece, and (b) text
    can be tokenized one space-separated word at a time (see _BERT_SPACE). Natural text repeats its words
    (a 256-document slice has ~10x more words than distinct ones), so tokenizing only unseen words and
    gathering the rest with numpy is several times faster than encode_batch, and gives the same ids (the
    tests compare both paths). Other tokenizers (byte-level BPE and Metaspace keep the spaces in their
    tokens) go through encode_batch.
    """
    from tokenizers import models, normalizers, pre_tokenizers

    if not (
        isinstance(tok.model, models.WordPiece)
        and isinstance(tok.normalizer, normalizers.BertNormalizer)
        and isinstance(tok.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
    ):
        return None
    if any(" " in t.content for t in tok.get_added_tokens_decoder().values()):
        return None  # an added token spanning a space would be split by the word path
    prefix = tok.model.continuing_subword_prefix
    table = np.zeros(tok.get_vocab_size(with_added_tokens=True), bool)
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        table[i] = piece.startswith(prefix) and len(piece) > len(prefix)
    return table


def _init_worker(tokenizer_file: str, tmp_dir: str, dtype: str, threads: int, fast: bool = True) -> None:
    # Each process uses its share of the cores; rayon reads this before its pool first starts.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_file)
    tok.no_truncation()
    tok.no_padding()
    _worker.update(
        tok=tok, tmp=Path(tmp_dir), dtype=np.dtype(dtype), continuation=_word_fast_path(tok) if fast else None, cache={}
    )


def _encode_words(sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [n] and per-sentence token counts [S] of `sentences`, one distinct word at a time."""
    tok, dtype, cache = _worker["tok"], _worker["dtype"], _worker["cache"]
    words: list[str] = []
    counts = np.empty(len(sentences), np.int64)  # [S] words per sentence
    odd = any(_NOT_BERT_SPACE.search(s) for s in sentences)
    for i, sentence in enumerate(sentences):
        split = _BERT_SPACE.split(sentence) if odd else sentence.split()  # a "" at an end encodes to nothing
        counts[i] = len(split)
        words += split
    distinct = {w: k for k, w in enumerate(dict.fromkeys(words))}
    codes = np.fromiter(map(distinct.__getitem__, words), np.int64, len(words))  # [W] word -> distinct index
    missing = [w for w in distinct if w not in cache]
    if missing:
        if len(cache) + len(missing) > _WORD_CACHE_MAX:
            cache.clear()
        for w, e in zip(missing, tok.encode_batch_fast(missing, add_special_tokens=False)):
            cache[w] = e.ids
    pieces = [cache[w] for w in distinct]
    piece_lens = np.fromiter(map(len, pieces), np.int64, len(pieces))  # [U]
    flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype, int(piece_lens.sum()))  # [sum U]
    piece_starts = np.cumsum(piece_lens) - piece_lens  # [U]
    lens = piece_lens[codes]  # [W] tokens of each word occurrence
    n = int(lens.sum())
    out_starts = np.cumsum(lens) - lens  # [W]
    # Token t of the output belongs to word occurrence w: it is flat[piece_starts[codes[w]] + (t - out_starts[w])].
    index = np.arange(n) + np.repeat(piece_starts[codes] - out_starts, lens)  # [n]
    ends = np.concatenate([[0], np.cumsum(lens)])  # [W+1]
    bounds = np.concatenate([[0], np.cumsum(counts)])  # [S+1] word offsets of sentences
    return flat[index], ends[bounds[1:]] - ends[bounds[:-1]]


def _encode_slice(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token ids [n], word starts [n] bool, sentence lengths [S] and sentences per document [d] of `texts`."""
    tok, dtype, continuation = _worker["tok"], _worker["dtype"], _worker["continuation"]
    sentences = [split_sentences(t) for t in texts]
    flat = list(itertools.chain.from_iterable(sentences))
    doc_sents = np.array([len(s) for s in sentences], np.int64)
    if continuation is not None:
        ids, sent_lens = _encode_words(flat)
        return ids, ~continuation[ids], sent_lens, doc_sents
    encodings = tok.encode_batch(flat, add_special_tokens=False)
    sent_lens = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))  # [S]
    n = int(sent_lens.sum())
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype, n)  # [n]
    # Word ids restart per sentence; None (a token outside any word) is -1 and always a start.
    word = np.fromiter((-1 if w is None else w for e in encodings for w in e.word_ids), np.int64, n)  # [n]
    sent_starts = np.zeros(n + 1, bool)
    sent_starts[np.cumsum(sent_lens)[:-1]] = True  # the first token of each sentence (but the first)
    starts = np.ones(n, bool)  # [n]
    starts[1:] = (word[1:] != word[:-1]) | sent_starts[1:n] | (word[1:] < 0)
    return ids, starts, sent_lens, doc_sents


def _encode_shard(task: tuple[int, list[str]]) -> dict:
    """Tokenize one chunk of documents and write it as shard files in the tmp dir; return its counts."""
    index, texts = task
    parts = [_encode_slice(texts[lo : lo + _ENCODE_DOCS]) for lo in range(0, len(texts), _ENCODE_DOCS)]
    ids, starts, sent_lens, doc_sent_counts = (np.concatenate([p[k] for p in parts]) for k in range(4))
    n = len(ids)

    # Drop sentences that tokenize to nothing, and documents left with no tokens.
    sent_doc = np.repeat(np.arange(len(texts)), doc_sent_counts)  # [S] document of each sentence
    nonempty = sent_lens > 0
    doc_lens = np.bincount(sent_doc[nonempty], weights=sent_lens[nonempty], minlength=len(texts)).astype(np.int64)
    kept_docs = doc_lens > 0
    doc_offsets = np.concatenate([[0], np.cumsum(doc_lens[kept_docs])]).astype(np.int64)  # [d'+1]
    sent_offsets = np.concatenate([[0], np.cumsum(sent_lens[nonempty])]).astype(np.int64)  # [s'+1]

    name = shard_name(index)
    prefix = f"{name}.{os.getpid()}"  # a worker orphaned by a killed build never collides with a new one
    tmp = _worker["tmp"]
    files = {
        ".tokens.bin": lambda f: ids.tofile(f),
        ".docs.npy": lambda f: np.save(f, doc_offsets),
        ".sents.npy": lambda f: np.save(f, sent_offsets),
        ".words.bin": lambda f: np.packbits(starts).tofile(f),
    }
    sha = {}
    if kept_docs.any():  # a shard of no tokens gets no files (an empty file cannot be memory-mapped)
        for suffix, write in files.items():
            path = tmp / (prefix + suffix)
            with open(path, "wb") as f:
                write(f)
            sha[name + suffix] = sha256_file(path)
    return {
        "index": index,
        "name": name,
        "tmp_prefix": prefix,
        "documents": int(kept_docs.sum()),
        "sentences": int(nonempty.sum()),
        "tokens": n,
        "sha256": sha,
        "dropped_docs": int((~kept_docs).sum()),
        "input_docs": len(texts),
    }


# ---------------------------------------------------------------------------------------------- build


def build_key(paths: list[str], tok_hash: str, settings: dict) -> tuple[str, list]:
    """(sha256 cache key, input fingerprint) of a build: what its output is a pure function of."""
    fingerprint = [fp for p in expand_inputs(paths) for fp in input_fingerprint(p)]
    blob = json.dumps({"inputs": fingerprint, "tokenizer_hash": tok_hash, **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest(), fingerprint


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cached(out: Path, key: str, tok_hash: str) -> dict | None:
    manifest = _read_json(out / MANIFEST)
    if manifest is None or manifest.get("cache_key") != key:
        return None
    try:
        ShardSet(out, verify=True, expected_tokenizer_hash=tok_hash)
    except DataError:
        return None  # damaged: rebuild
    return manifest


def _is_build_file(p: Path) -> bool:
    return p.name.startswith("shard_") and (p.name.endswith(SUFFIXES + (DONE,)) or ".tmp-" in p.name)


def _clear(out: Path) -> None:
    """Remove a previous build's files, manifest first, so the directory never looks complete meanwhile."""
    (out / MANIFEST).unlink(missing_ok=True)
    (out / BUILD_STATE).unlink(missing_ok=True)
    shutil.rmtree(out / TMP, ignore_errors=True)
    for p in out.glob("shard_*"):
        if _is_build_file(p):
            p.unlink()


def _shard_ok(out: Path, record: dict, itemsize: int) -> bool:
    """Whether a done record's files are all there, of the right sizes and checksums."""
    if not record["documents"]:
        return True
    sizes = {".tokens.bin": record["tokens"] * itemsize, ".words.bin": (record["tokens"] + 7) // 8}
    for suffix in SUFFIXES:
        path = out / (record["name"] + suffix)
        if not path.is_file() or (suffix in sizes and path.stat().st_size != sizes[suffix]):
            return False
        if sha256_file(path) != record["sha256"].get(path.name):
            return False
    return True


def _completed(out: Path, itemsize: int) -> dict[int, dict]:
    """Shards a previous run of this build finished, by index; bad records are removed to be redone."""
    done = {}
    for path in sorted(out.glob(f"shard_*{DONE}")):
        record = _read_json(path)
        if record is not None and _shard_ok(out, record, itemsize):
            done[record["index"]] = record
        else:
            path.unlink()
    return done


def _chunks(docs, size: int) -> Iterator[tuple[int, list[str]]]:
    for index in itertools.count():
        texts = [d.text for d in itertools.islice(docs, size)]
        if not texts:
            return
        yield index, texts


def _settings(text_field: str, docs_per_shard: int, on_bad: str, max_document_bytes: int) -> dict:
    """The build settings a cache key covers, besides the inputs and the tokenizer."""
    return {
        "format_version": FORMAT_VERSION,
        "splitter_version": SPLITTER_VERSION,
        "text_field": text_field,
        "docs_per_shard": max(1, docs_per_shard),
        "on_bad": on_bad,
        "max_document_bytes": max_document_bytes,
    }


def shards_current(
    paths: list[str],
    tokenizer_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    text_field: str = "text",
    docs_per_shard: int = 2000,
    on_bad: str = "skip",
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
) -> bool:
    """Whether `build_shards` with these arguments would return the finished build in `out_dir` as it is (a cache
    hit, by the manifest's key alone: the files are verified when read) rather than build it again."""
    manifest = _read_json(Path(out_dir) / MANIFEST)
    if manifest is None:
        return False
    settings = _settings(text_field, docs_per_shard, on_bad, max_document_bytes)
    return manifest.get("cache_key") == build_key(paths, tokenizer_hash(tokenizer_dir), settings)[0]


def build_shards(
    paths: list[str],
    tokenizer_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    text_field: str = "text",
    num_workers: int = 2,
    docs_per_shard: int = 2000,
    on_bad: str = "skip",
    show_progress: bool = True,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
) -> dict:
    """Tokenize the corpus into shards in `out_dir` and return the manifest.

    A finished build with the same cache key is returned as is; an interrupted one is finished (see the
    module docstring). num_workers=0 tokenizes in this process (no pool). At most 2 chunks per worker are
    in flight, so memory stays bounded whatever the corpus size.
    """
    out = Path(out_dir)
    tok_file = Path(tokenizer_dir) / "tokenizer.json"
    tok_hash = tokenizer_hash(tokenizer_dir)
    docs_per_shard = max(1, docs_per_shard)
    settings = _settings(text_field, docs_per_shard, on_bad, max_document_bytes)
    key, fingerprint = build_key(paths, tok_hash, settings)
    check_not_input(
        out, {"the tokenizer directory": tokenizer_dir, **{f"the corpus file {p}": p for p in expand_inputs(paths)}}
    )
    claim_output(out, "shards", "the shard directory")
    cached = _cached(out, key, tok_hash)  # lock-free fast path: the manifest is written atomically
    if cached is not None:
        return cached
    mark_output(out, "shards")
    with exclusive(out, "building shards", ", or use another data.shards directory"):
        cached = _cached(out, key, tok_hash)  # another process may have finished it while we waited
        if cached is not None:
            return cached
        return _build_locked(paths, tok_file, tok_hash, out, key, fingerprint, settings, num_workers, show_progress)


def _build_locked(
    paths,
    tok_file: Path,
    tok_hash: str,
    out: Path,
    key: str,
    fingerprint: list,
    settings: dict,
    num_workers: int,
    show_progress: bool,
) -> dict:
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(tok_file)).get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    state = _read_json(out / BUILD_STATE)
    if state is None or state.get("cache_key") != key:
        _clear(out)  # a stale partial build (other inputs, tokenizer or settings), or a finished stale one
        write_json_atomic(out / BUILD_STATE, {"cache_key": key, "started": time.time(), **settings})
        done: dict[int, dict] = {}
    else:
        done = _completed(out, dtype.itemsize)
    tmp = out / TMP
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    skipped: collections.Counter = collections.Counter()
    docs = iter_documents(
        paths,
        text_field=settings["text_field"],
        on_bad=settings["on_bad"],
        skipped=skipped,
        max_document_bytes=settings["max_document_bytes"],
    )
    init_args = (str(tok_file), str(tmp), dtype.name, max(1, (os.cpu_count() or 1) // max(1, num_workers)))
    try:
        from tqdm import tqdm

        with tqdm(desc="tokenizing", unit=" docs", disable=not show_progress) as bar:

            def todo():  # chunks still to tokenize; finished ones are read past (cheap next to tokenizing)
                for index, texts in _chunks(docs, settings["docs_per_shard"]):
                    if index in done:
                        bar.update(len(texts))
                    else:
                        yield index, texts

            for result in _run(todo(), num_workers, init_args):
                bar.update(result["input_docs"])
                for suffix in SUFFIXES if result["documents"] else ():
                    os.replace(tmp / (result["tmp_prefix"] + suffix), out / (result["name"] + suffix))
                record = {k: v for k, v in result.items() if k != "tmp_prefix"}
                # Not fsynced: a resume re-hashes the files against this record anyway.
                write_json_atomic(out / (result["name"] + DONE), record, sync=False)
                done[result["index"]] = record
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    records = [done[i] for i in sorted(done)]
    shards = [
        {k: r[k] for k in ("name", "documents", "sentences", "tokens", "sha256")} for r in records if r["documents"]
    ]
    no_tokens = sum(r["dropped_docs"] for r in records)
    if no_tokens:
        skipped["no_tokens"] += no_tokens
    total = {k: sum(s[k] for s in shards) for k in ("documents", "sentences", "tokens")}
    if not total["documents"]:
        _clear(out)
        raise DataError(
            f"empty corpus: no usable documents in {describe_inputs(paths)}"
            + (f" (skipped: {dict(skipped)})" if skipped else "")
        )
    manifest = {
        "format_version": FORMAT_VERSION,
        "cache_key": key,
        "settings": settings,
        "tokenizer_hash": tok_hash,
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "text_field": settings["text_field"],
        "inputs": [fp[0] for fp in fingerprint],
        "input_bytes": [fp[1] for fp in fingerprint],
        "counts": {
            **total,
            "input_documents": sum(r["input_docs"] for r in records),
            "skipped": dict(sorted(skipped.items())),
        },
        "shards": shards,
        "created": time.time(),
    }
    write_json_atomic(out / MANIFEST, manifest)
    for r in records:  # the manifest now holds everything the done records said
        (out / (r["name"] + DONE)).unlink(missing_ok=True)
    (out / BUILD_STATE).unlink(missing_ok=True)
    return manifest


def _run(chunks, num_workers: int, init_args: tuple) -> Iterator[dict]:
    """Results of `_encode_shard` over `chunks`, in order, with a bounded number of chunks in flight.

    Pool.imap would pull the whole chunk generator into its task queue as fast as it can read it, so
    submission is windowed by hand instead.
    """
    if num_workers <= 0:
        _init_worker(*init_args)
        yield from map(_encode_shard, chunks)
        return
    with mp.get_context("spawn").Pool(num_workers, _init_worker, init_args) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_shard, (chunk,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---------------------------------------------------------------------------------------------- reading


# ---------------------------------------------------------------------------------------------- mixtures

MIXTURE_KEY = "sources"


def shards_hash(shards: list[dict]) -> str:
    """sha256 over the shard records' file checksums, in order (`ShardSet.content_hash` of one corpus)."""
    digest = hashlib.sha256()
    for shard in shards:
        for name in sorted(shard["sha256"]):
            digest.update(f"{name}:{shard['sha256'][name]}\n".encode())
    return digest.hexdigest()


def mixture_hash(sources: list[tuple[str, float, str]]) -> str:
    """sha256 of a mixture: (name, weight, content hash) of each source, in order. The weights are in it because
    they decide which samples a run trains on: a resume with others is refused like one on other data."""
    digest = hashlib.sha256(b"mixture\n")
    for name, weight, content in sources:
        digest.update(f"{name}:{float(weight)!r}:{content}\n".encode())
    return digest.hexdigest()


def write_mixture(out_dir: str | os.PathLike, sources: list[tuple[str, float, dict]]) -> dict:
    """The manifest of a mixture in `out_dir`, whose sources' shards were built in `out_dir/<name>`
    (`build_shards`): each source's shards are listed as `<name>/shard_XXXXX`, so `ShardSet(out_dir)` reads the
    mixture as one set (checked, counted and hashed as a whole) and `ShardSet.sources()` gives each. Written only
    when it changes; files a one-corpus build left in `out_dir` itself are removed."""
    out = Path(out_dir)
    manifests = [m for _, _, m in sources]
    if len({m["tokenizer_hash"] for m in manifests}) != 1:
        raise DataError(f"the sources in {out} were built with different tokenizers; rebuild the shards")
    skipped: collections.Counter = collections.Counter()
    for m in manifests:
        skipped.update(m["counts"].get("skipped", {}))
    keys = ("documents", "sentences", "tokens", "input_documents")
    manifest = {
        "format_version": FORMAT_VERSION,
        MIXTURE_KEY: [
            {"name": name, "weight": float(weight), "content_hash": shards_hash(m["shards"]), "counts": m["counts"]}
            for name, weight, m in sources
        ],
        "tokenizer_hash": manifests[0]["tokenizer_hash"],
        "vocab_size": manifests[0]["vocab_size"],
        "dtype": manifests[0]["dtype"],
        "text_field": manifests[0]["text_field"],
        "inputs": [p for m in manifests for p in m["inputs"]],
        "input_bytes": [b for m in manifests for b in m["input_bytes"]],
        "counts": {
            **{k: sum(m["counts"].get(k, 0) for m in manifests) for k in keys},
            "skipped": dict(sorted(skipped.items())),
        },
        "shards": [{**shard, "name": f"{name}/{shard['name']}"} for name, _, m in sources for shard in m["shards"]],
    }
    claim_output(out, "shards", "the shard directory")
    mark_output(out, "shards")
    with exclusive(out, "writing the mixture's manifest", ", or use another data.shards directory"):
        old = _read_json(out / MANIFEST) or {}
        if {k: v for k, v in old.items() if k != "created"} == manifest:
            return old
        if MIXTURE_KEY not in old:
            _clear(out)  # a one-corpus build here before: its shard files are not the mixture's
        manifest["created"] = time.time()
        write_json_atomic(out / MANIFEST, manifest)
    return manifest


class ShardSet:
    """A verified shard directory, memory-mapped, addressed by global document and token index.

    Global token space = the tokens of all documents concatenated in shard order; `doc_offsets()` [D+1]
    gives each document's span in it.
    """

    def __init__(self, directory: str | os.PathLike, verify: bool = True, expected_tokenizer_hash: str | None = None):
        self.dir = Path(directory)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise DataError(f"no {MANIFEST} in {self.dir} — build shards first")
        try:
            self.manifest: dict = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {path}: {e}") from e
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{path}: format_version {self.manifest.get('format_version')!r}, expected "
                f"{FORMAT_VERSION}; rebuild the shards"
            )
        if expected_tokenizer_hash is not None and self.manifest["tokenizer_hash"] != expected_tokenizer_hash:
            raise DataError(
                f"{self.dir} was built with a different tokenizer (hash "
                f"{self.manifest['tokenizer_hash'][:12]}, expected {expected_tokenizer_hash[:12]}); "
                "rebuild the shards"
            )
        self.dtype = np.dtype(self.manifest["dtype"])
        self._check_files(verify)

        shards = self.manifest["shards"]
        tok_counts = np.array([s["tokens"] for s in shards], np.int64)
        self._shard_tok_start = np.concatenate([[0], np.cumsum(tok_counts)])  # [K+1] global token offsets
        docs, sents = [], []
        for k, s in enumerate(shards):
            d, e = (self._load_offsets(f"{s['name']}{suffix}") for suffix in (".docs.npy", ".sents.npy"))
            if (len(d), len(e), d[-1], e[-1]) != (s["documents"] + 1, s["sentences"] + 1, s["tokens"], s["tokens"]):
                raise DataError(f"{self.dir}/{s['name']}: offsets disagree with {MANIFEST}; rebuild the shards")
            docs.append(d[:-1] + self._shard_tok_start[k])
            sents.append(e[:-1] + self._shard_tok_start[k])
        end = [self._shard_tok_start[-1:]]
        self._doc_offsets = np.concatenate(docs + end).astype(np.int64)  # [D+1]
        self._sent_offsets = np.concatenate(sents + end).astype(np.int64)  # [S+1]
        self._maps: list | None = None

    def _load_offsets(self, filename: str) -> np.ndarray:
        try:
            return np.load(self.dir / filename)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {self.dir / filename} ({e}); rebuild the shards") from e

    def _check_files(self, verify: bool) -> None:
        for s in self.manifest["shards"]:
            expected = {".tokens.bin": s["tokens"] * self.dtype.itemsize, ".words.bin": (s["tokens"] + 7) // 8}
            for suffix in SUFFIXES:
                path = self.dir / f"{s['name']}{suffix}"
                if not path.is_file():
                    raise DataError(f"missing shard file {path}; rebuild the shards")
                if suffix in expected and path.stat().st_size != expected[suffix]:
                    raise DataError(
                        f"size mismatch in {path}: {path.stat().st_size} bytes, expected "
                        f"{expected[suffix]} (file changed or truncated)"
                    )
                if verify and sha256_file(path) != s["sha256"][path.name]:
                    raise DataError(f"checksum mismatch in {path} (file changed or truncated)")

    # Memory maps open lazily and are not pickled, so a ShardSet travels cheaply to DataLoader workers.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def _mapped(self) -> list[tuple[np.ndarray, np.ndarray]]:
        if self._maps is None:
            self._maps = [
                (
                    np.memmap(self.dir / f"{s['name']}.tokens.bin", self.dtype, "r", shape=(s["tokens"],)),
                    np.memmap(self.dir / f"{s['name']}.words.bin", np.uint8, "r", shape=((s["tokens"] + 7) // 8,)),
                )
                for s in self.manifest["shards"]
            ]
        return self._maps

    @property
    def num_docs(self) -> int:
        return len(self._doc_offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self._doc_offsets[-1])

    def content_hash(self) -> str:
        """sha256 of what the shards hold (each file's checksum, in order): equal for equal tokens and boundaries,
        wherever and whenever they were built. A run records it to refuse resuming on other data. For a mixture,
        of every source's name, weight and content (`mixture_hash`)."""
        if not self.is_mixture:
            return shards_hash(self.manifest["shards"])
        return mixture_hash([(s["name"], s["weight"], h) for s, h in zip(self.manifest["sources"], self._hashes())])

    @property
    def is_mixture(self) -> bool:
        """Whether this directory holds weighted sources (`write_mixture`), one shard directory per source."""
        return MIXTURE_KEY in self.manifest

    def _hashes(self) -> list[str]:
        """Each source's content hash, from the shard records of this manifest (what was verified)."""
        groups: dict[str, list[dict]] = {s["name"]: [] for s in self.manifest["sources"]}
        for shard in self.manifest["shards"]:
            source, _, name = shard["name"].partition("/")
            groups[source].append({**shard, "name": name})
        return [shards_hash(groups[s["name"]]) for s in self.manifest["sources"]]

    def sources(self) -> list[tuple[str, float, ShardSet]]:
        """(name, weight, shard set) of each source of a mixture, in order; their files were checked by this set."""
        if not self.is_mixture:
            raise ValueError(f"{self.dir} holds one corpus, not a mixture of sources")
        out = []
        for s, expected in zip(self.manifest["sources"], self._hashes()):
            part = ShardSet(self.dir / s["name"], verify=False, expected_tokenizer_hash=self.manifest["tokenizer_hash"])
            if part.content_hash() != expected:
                raise DataError(f"{part.dir} changed since {self.dir / MANIFEST} was written; rebuild the shards")
            out.append((s["name"], float(s["weight"]), part))
        return out

    def doc_offsets(self) -> np.ndarray:
        """[D+1] int64 global token offsets of the documents (read-only view)."""
        view = self._doc_offsets.view()
        view.flags.writeable = False
        return view

    def sent_offsets(self) -> np.ndarray:
        """[S+1] int64 global token offsets of the sentences (read-only view)."""
        view = self._sent_offsets.view()
        view.flags.writeable = False
        return view

    def doc_lengths(self) -> np.ndarray:
        """[D] int64 tokens per document."""
        return np.diff(self._doc_offsets)

    def read_span(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [length] (file dtype) and word-start flags [length] bool of a global token span.

        The span may cross shard boundaries; the result is a copy, safe to modify.
        """
        end = start + length
        if start < 0 or length < 0 or end > self.num_tokens:
            raise IndexError(f"token span [{start}, {end}) outside [0, {self.num_tokens})")
        first = int(np.searchsorted(self._shard_tok_start, start, "right")) - 1
        last = int(np.searchsorted(self._shard_tok_start, end, "left"))  # exclusive shard bound
        tokens, words = [], []
        maps = self._mapped()
        for k in range(first, max(first + 1, last)):
            lo = max(start, self._shard_tok_start[k]) - self._shard_tok_start[k]
            hi = min(end, self._shard_tok_start[k + 1]) - self._shard_tok_start[k]
            ids, packed = maps[k]
            tokens.append(np.array(ids[lo:hi]))
            bits = np.unpackbits(packed[lo // 8 : (hi + 7) // 8])  # [8*bytes]
            words.append(bits[lo % 8 : lo % 8 + (hi - lo)].astype(bool))
        if len(tokens) == 1:
            return tokens[0], words[0]
        return np.concatenate(tokens), np.concatenate(words)

    def _doc_span(self, doc_index: int) -> tuple[int, int]:
        if not -self.num_docs <= doc_index < self.num_docs:
            raise IndexError(f"document {doc_index} outside [0, {self.num_docs})")
        doc_index %= self.num_docs
        return int(self._doc_offsets[doc_index]), int(self._doc_offsets[doc_index + 1])

    def doc_tokens(self, doc_index: int) -> np.ndarray:
        """[n] token ids (file dtype) of one document."""
        lo, hi = self._doc_span(doc_index)
        return self.read_span(lo, hi - lo)[0]

    def doc_word_starts(self, doc_index: int) -> np.ndarray:
        """[n] bool: True where a token starts a word."""
        lo, hi = self._doc_span(doc_index)
        return self.read_span(lo, hi - lo)[1]

    def doc_sentence_offsets(self, doc_index: int) -> np.ndarray:
        """[s+1] int64 offsets of the document's sentences, relative to its first token."""
        lo, hi = self._doc_span(doc_index)
        a, b = np.searchsorted(self._sent_offsets, [lo, hi])
        return self._sent_offsets[a : b + 1] - lo

    def doc_sentences(self, doc_index: int) -> list[np.ndarray]:
        """The document's sentences, each [n_i] token ids."""
        offsets = self.doc_sentence_offsets(doc_index)
        return np.split(self.doc_tokens(doc_index), offsets[1:-1])


def unigram_entropy(shards, special_ids: tuple[int, ...] = (), max_tokens: int = 10_000_000) -> float:
    """Entropy (nats) of the corpus's token frequencies, specials left out, over its first `max_tokens` tokens: the
    masked-LM loss of a model that predicts every masked token from frequency alone, ignoring its context (the
    'unigram plateau' a short run sits on before it learns to use context)."""
    n = min(shards.num_tokens, max_tokens)
    counts = np.bincount(shards.read_span(0, n)[0].astype(np.int64)).astype(np.float64)
    counts[[i for i in special_ids if i < len(counts)]] = 0
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
