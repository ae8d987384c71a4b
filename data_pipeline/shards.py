"""Tokenized, memory-mapped corpus shards: parallel build, manifest, verification and random access.

Layout of `out_dir` (n = tokens, d = documents, s = sentences of one shard):
    shard_00000.tokens.bin  [n] uint16/uint32 raw token ids, no special tokens
    shard_00000.docs.npy    [d+1] int64 token offsets of documents
    shard_00000.sents.npy   [s+1] int64 token offsets of sentences (document starts are sentence starts)
    shard_00000.words.bin   [ceil(n/8)] np.packbits of a bool per token: True where a word starts
    manifest.json           written last, atomically: a directory is complete iff it has one

Workers load only `tokenizers` (not transformers) and write their shard into `out_dir/.tmp/`; the parent
renames each finished shard into place in order, then writes the manifest.
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing as mp
import os
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np

from pretrain.errors import DataError
from data_pipeline.readers import describe_inputs, expand_inputs, iter_documents
from data_pipeline.sentences import split_sentences
from data_pipeline.tokenizer import sha256_file, tokenizer_hash

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUFFIXES = (".tokens.bin", ".docs.npy", ".sents.npy", ".words.bin")
TMP = ".tmp"


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ---------------------------------------------------------------------------------------------- workers

_worker: dict = {}


def _init_worker(tokenizer_file: str, tmp_dir: str, dtype: str, threads: int) -> None:
    # Each process uses its share of the cores; rayon reads this before its pool first starts.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_file)
    tok.no_truncation()
    tok.no_padding()
    _worker.update(tok=tok, tmp=Path(tmp_dir), dtype=np.dtype(dtype))


def _encode_shard(task: tuple[int, list[str]]) -> dict:
    """Tokenize one chunk of documents and write it as shard files in the tmp dir; return its counts."""
    index, texts = task
    tok, dtype = _worker["tok"], _worker["dtype"]
    sentences = [split_sentences(t) for t in texts]
    encodings = tok.encode_batch(list(itertools.chain.from_iterable(sentences)), add_special_tokens=False)
    sent_lens = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))  # [S]
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype, int(sent_lens.sum()))  # [n]
    # Word ids restart per sentence; None (a token outside any word) is -1 and always a start.
    word = np.fromiter((-1 if w is None else w for e in encodings for w in e.word_ids), np.int64, len(ids))  # [n]
    sent_starts = np.zeros(len(ids) + 1, bool)
    sent_starts[np.cumsum(sent_lens)[:-1]] = True  # the first token of each sentence (but the first)
    starts = np.ones(len(ids), bool)  # [n]
    starts[1:] = (word[1:] != word[:-1]) | sent_starts[1:len(ids)] | (word[1:] < 0)

    # Drop sentences that tokenize to nothing, and documents left with no tokens.
    doc_sent_counts = np.array([len(s) for s in sentences], np.int64)  # [d] sentences before dropping
    sent_doc = np.repeat(np.arange(len(texts)), doc_sent_counts)  # [S] document of each sentence
    nonempty = sent_lens > 0
    doc_lens = np.bincount(sent_doc[nonempty], weights=sent_lens[nonempty], minlength=len(texts)).astype(np.int64)
    kept_docs = doc_lens > 0
    doc_offsets = np.concatenate([[0], np.cumsum(doc_lens[kept_docs])]).astype(np.int64)  # [d'+1]
    sent_offsets = np.concatenate([[0], np.cumsum(sent_lens[nonempty])]).astype(np.int64)  # [s'+1]

    name = shard_name(index)
    tmp = _worker["tmp"]
    files = {
        ".tokens.bin": lambda f: ids.tofile(f),
        ".docs.npy": lambda f: np.save(f, doc_offsets),
        ".sents.npy": lambda f: np.save(f, sent_offsets),
        ".words.bin": lambda f: np.packbits(starts).tofile(f),
    }
    sha = {}
    for suffix, write in files.items():
        path = tmp / (name + suffix)
        with open(path, "wb") as f:
            write(f)
        sha[name + suffix] = sha256_file(path)
    return {"name": name, "documents": int(kept_docs.sum()), "sentences": int(nonempty.sum()),
            "tokens": int(len(ids)), "sha256": sha, "dropped_docs": int((~kept_docs).sum()),
            "input_docs": len(texts)}


# ---------------------------------------------------------------------------------------------- build

def _inputs_fingerprint(paths: list[str]) -> tuple[list[str], list[int]]:
    files = expand_inputs(paths)
    return [str(p.resolve()) for p in files], [p.stat().st_size for p in files]


def _cached(out: Path, tok_hash: str, inputs: list[str], sizes: list[int], text_field: str) -> dict | None:
    if not (out / MANIFEST).is_file():
        return None
    try:
        shard_set = ShardSet(out, verify=True, expected_tokenizer_hash=tok_hash)
    except DataError:
        return None  # stale or damaged: rebuild
    m = shard_set.manifest
    if m.get("inputs") != inputs or m.get("input_bytes") != sizes or m.get("text_field") != text_field:
        return None
    return m


def _clear(out: Path) -> None:
    """Remove a previous build's files, manifest first, so the directory never looks complete meanwhile."""
    (out / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(out / TMP, ignore_errors=True)
    for p in out.glob("shard_*"):
        if p.name.endswith(SUFFIXES):
            p.unlink()


def _chunks(docs, size: int) -> Iterator[tuple[int, list[str]]]:
    for index in itertools.count():
        texts = [d.text for d in itertools.islice(docs, size)]
        if not texts:
            return
        yield index, texts


def build_shards(paths: list[str], tokenizer_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                 text_field: str = "text", num_workers: int = 2, docs_per_shard: int = 2000,
                 on_bad: str = "skip", show_progress: bool = True) -> dict:
    """Tokenize the corpus into shards in `out_dir` and return the manifest (cached if already built).

    num_workers=0 tokenizes in this process (no pool). At most 2 chunks per worker are in flight, so
    memory stays bounded whatever the corpus size.
    """
    from tokenizers import Tokenizer

    out = Path(out_dir)
    tok_file = Path(tokenizer_dir) / "tokenizer.json"
    tok_hash = tokenizer_hash(tokenizer_dir)
    inputs, sizes = _inputs_fingerprint(paths)
    cached = _cached(out, tok_hash, inputs, sizes, text_field)
    if cached is not None:
        return cached

    vocab_size = Tokenizer.from_file(str(tok_file)).get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    _clear(out)
    tmp = out / TMP
    tmp.mkdir()
    skipped: collections.Counter = collections.Counter()
    chunks = _chunks(iter_documents(paths, text_field=text_field, on_bad=on_bad, skipped=skipped),
                     max(1, docs_per_shard))
    init_args = (str(tok_file), str(tmp), dtype.name, max(1, (os.cpu_count() or 1) // max(1, num_workers)))
    shards: list[dict] = []
    try:
        from tqdm import tqdm

        with tqdm(desc="tokenizing", unit=" docs", disable=not show_progress) as bar:
            for result in _run(chunks, num_workers, init_args):
                bar.update(result["input_docs"])
                if result["dropped_docs"]:
                    skipped["no_tokens"] += result["dropped_docs"]
                if not result["documents"]:
                    continue  # every document tokenized to nothing: no shard (an empty file cannot be mapped)
                for suffix in SUFFIXES:
                    os.replace(tmp / (result["name"] + suffix), out / (result["name"] + suffix))
                shards.append({k: result[k] for k in ("name", "documents", "sentences", "tokens", "sha256")})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    total = {k: sum(s[k] for s in shards) for k in ("documents", "sentences", "tokens")}
    if not total["documents"]:
        _clear(out)
        raise DataError(f"empty corpus: no usable documents in {describe_inputs(paths)}"
                        + (f" (skipped: {dict(skipped)})" if skipped else ""))
    manifest = {
        "format_version": FORMAT_VERSION, "tokenizer_hash": tok_hash, "vocab_size": vocab_size,
        "dtype": dtype.name, "text_field": text_field, "inputs": inputs, "input_bytes": sizes,
        "counts": {**total, "skipped": dict(skipped)}, "shards": shards, "created": time.time(),
    }
    _write_json_atomic(out / MANIFEST, manifest)
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


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- reading

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
            raise DataError(f"{path}: format_version {self.manifest.get('format_version')!r}, expected "
                            f"{FORMAT_VERSION}; rebuild the shards")
        if expected_tokenizer_hash is not None and self.manifest["tokenizer_hash"] != expected_tokenizer_hash:
            raise DataError(f"{self.dir} was built with a different tokenizer (hash "
                            f"{self.manifest['tokenizer_hash'][:12]}, expected {expected_tokenizer_hash[:12]}); "
                            "rebuild the shards")
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
                    raise DataError(f"size mismatch in {path}: {path.stat().st_size} bytes, expected "
                                    f"{expected[suffix]} (file changed or truncated)")
                if verify and sha256_file(path) != s["sha256"][path.name]:
                    raise DataError(f"checksum mismatch in {path} (file changed or truncated)")

    # Memory maps open lazily and are not pickled, so a ShardSet travels cheaply to DataLoader workers.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def _mapped(self) -> list[tuple[np.ndarray, np.ndarray]]:
        if self._maps is None:
            self._maps = [
                (np.memmap(self.dir / f"{s['name']}.tokens.bin", self.dtype, "r", shape=(s["tokens"],)),
                 np.memmap(self.dir / f"{s['name']}.words.bin", np.uint8, "r", shape=((s["tokens"] + 7) // 8,)))
                for s in self.manifest["shards"]]
        return self._maps

    @property
    def num_docs(self) -> int:
        return len(self._doc_offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self._doc_offsets[-1])

    @property
    def num_sentences(self) -> int:
        return len(self._sent_offsets) - 1

    def doc_offsets(self) -> np.ndarray:
        """[D+1] int64 global token offsets of the documents (read-only view)."""
        view = self._doc_offsets.view()
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
            bits = np.unpackbits(packed[lo // 8:(hi + 7) // 8])  # [8*bytes]
            words.append(bits[lo % 8:lo % 8 + (hi - lo)].astype(bool))
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
        return self._sent_offsets[a:b + 1] - lo

    def doc_sentences(self, doc_index: int) -> list[np.ndarray]:
        """The document's sentences, each [n_i] token ids."""
        offsets = self.doc_sentence_offsets(doc_index)
        return np.split(self.doc_tokens(doc_index), offsets[1:-1])
