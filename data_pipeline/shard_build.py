"""Building a shard directory: the cache key, resumable parallel build, verification of finished shards, the
manifest, and a mixture's manifest over several built sources.

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
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.readers import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    describe_inputs,
    describe_skipped,
    expand_inputs,
    input_fingerprint,
    iter_documents,
)
from data_pipeline.sentences import SPLITTER_VERSION
from data_pipeline.shard_encode import run_workers
from data_pipeline.shard_format import (
    BUILD_STATE,
    DONE,
    FORMAT_VERSION,
    MANIFEST,
    MIXTURE_KEY,
    SUFFIXES,
    TMP,
    read_json,
    shards_hash,
    token_dtype,
)
from data_pipeline.shard_read import ShardSet
from data_pipeline.tokenizer import tokenizer_hash
from pretrain.core.errors import DataError
from pretrain.core.files import sha256_file, write_json_atomic
from pretrain.core.outputs import (
    LOCK,
    MARKER,
    check_not_input,
    claim_output,
    exclusive,
    exclusive_if_free,
    mark_output,
)


def build_key(paths: list[str], tok_hash: str, settings: dict) -> tuple[str, list]:
    """(sha256 cache key, input fingerprint) of a build: what its output is a pure function of."""
    fingerprint = [fp for p in expand_inputs(paths) for fp in input_fingerprint(p)]
    blob = json.dumps({"inputs": fingerprint, "tokenizer_hash": tok_hash, **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest(), fingerprint


def _cached(out: Path, key: str, tok_hash: str) -> dict | None:
    manifest = read_json(out / MANIFEST)
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
    """Remove a previous build's files, manifest first, so the directory never looks complete meanwhile. Not while a
    trainer reads them (it holds the directory `shared`: its loader workers open the files by name, and would read
    the new tokens at the old offsets): a DataError then, and nothing removed."""
    if not (out / MANIFEST).is_file() and not any(out.glob("shard_*")):
        return
    with exclusive_if_free(out) as free:
        if not free:
            raise DataError(
                f"{out} holds shards another process is reading now (a run training on them, an evaluation): build "
                "these into another directory (--out, data.shards); the shards were left as they were"
            )
        _remove_build_files(out)


def _remove_build_files(out: Path) -> None:
    """A build's own files in `out`, manifest first (the directory never looks complete meanwhile); nothing else."""
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
        record = read_json(path)
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


def _settings(
    text_field: str, docs_per_shard: int, on_bad: str, max_document_bytes: int, text_documents: str = "paragraphs"
) -> dict:
    """The build settings a cache key covers, besides the inputs and the tokenizer (text_documents only where it is
    not the default, so that the shards built before it existed stay a cache hit)."""
    settings = {
        "format_version": FORMAT_VERSION,
        "splitter_version": SPLITTER_VERSION,
        "text_field": text_field,
        "docs_per_shard": max(1, docs_per_shard),
        "on_bad": on_bad,
        "max_document_bytes": max_document_bytes,
    }
    return settings if text_documents == "paragraphs" else {**settings, "text_documents": text_documents}


def shards_current(
    paths: list[str],
    tokenizer_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    text_field: str = "text",
    docs_per_shard: int = 2000,
    on_bad: str = "skip",
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    text_documents: str = "paragraphs",
) -> bool:
    """Whether `build_shards` with these arguments would return the finished build in `out_dir` as it is (a cache
    hit, by the manifest's key alone: the files are verified when read) rather than build it again."""
    manifest = read_json(Path(out_dir) / MANIFEST)
    if manifest is None:
        return False
    settings = _settings(text_field, docs_per_shard, on_bad, max_document_bytes, text_documents)
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
    text_documents: str = "paragraphs",
) -> dict:
    """Tokenize the corpus into shards in `out_dir` and return the manifest.

    A finished build with the same cache key is returned as is; an interrupted one is finished (see the
    module docstring). num_workers=0 tokenizes in this process (no pool). At most 2 chunks per worker are
    in flight, so memory stays bounded whatever the corpus size.
    """
    if docs_per_shard < 1:
        raise DataError(f"docs_per_shard must be >= 1, got {docs_per_shard}")
    out = Path(out_dir)
    tok_hash = tokenizer_hash(tokenizer_dir)
    settings = _settings(text_field, docs_per_shard, on_bad, max_document_bytes, text_documents)
    key, fingerprint = build_key(paths, tok_hash, settings)
    check_not_input(
        out, {"the tokenizer directory": tokenizer_dir, **{f"the corpus file {p}": p for p in expand_inputs(paths)}}
    )
    claim_output(out, "shards", "the shard directory")
    cached = _cached(out, key, tok_hash)  # lock-free fast path: the manifest is written atomically
    if cached is not None:
        return cached
    _check_readable(Path(tokenizer_dir) / "tokenizer.json")
    mark_output(out, "shards")
    with exclusive(out, "building shards", ", or use another data.shards directory"):
        cached = _cached(out, key, tok_hash)  # another process may have finished it while we waited
        if cached is not None:
            return cached
        tok_file = Path(tokenizer_dir) / "tokenizer.json"
        build = Build(paths, tok_file, tok_hash, out, key, fingerprint, settings, num_workers, show_progress)
        return _build_locked(build)


def _check_readable(tok_file: Path) -> None:
    """The tokenizer, read before the shard directory is claimed: a torn tokenizer.json was the tokenizers library's
    bare Exception ('EOF while parsing...'), and left a shard directory holding its marker and lock alone."""
    from tokenizers import Tokenizer

    try:  # (its presence: tokenizer_hash's)
        Tokenizer.from_file(str(tok_file))
    except Exception as err:  # the library raises a bare Exception for every kind of bad file
        raise DataError(f"{tok_file}: not a tokenizer the tokenizers library reads ({err})") from None


@dataclass(frozen=True)
class Build:
    """One shard build, decided before the directory is locked: its inputs, tokenizer, output, cache key (and the
    input fingerprint and settings the key covers), and how it runs."""

    paths: list[str]
    tok_file: Path
    tok_hash: str
    out: Path
    key: str
    fingerprint: list
    settings: dict
    num_workers: int = 2
    show_progress: bool = True


def _build_locked(build: Build) -> dict:
    """Resume or start the build, tokenize the shards it lacks, then write the manifest (the build holds the lock)."""
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(build.tok_file)).get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    done = _resume(build, dtype.itemsize)
    skipped: collections.Counter = collections.Counter()
    _tokenize_missing(build, dtype, done, skipped)
    return _write_manifest(build, vocab_size, dtype, [done[i] for i in sorted(done)], skipped)


def _resume(build: Build, itemsize: int) -> dict[int, dict]:
    """The shards an interrupted run of this same build finished, by index; any other build's files are cleared."""
    state = read_json(build.out / BUILD_STATE)
    if state is not None and state.get("cache_key") == build.key:
        return _completed(build.out, itemsize)
    _clear(build.out)  # a stale partial build (other inputs, tokenizer or settings), or a finished stale one
    write_json_atomic(build.out / BUILD_STATE, {"cache_key": build.key, "started": time.time(), **build.settings})
    return {}


def _tokenize_missing(build: Build, dtype: np.dtype, done: dict[int, dict], skipped: collections.Counter) -> None:
    """Tokenize every shard not in `done` through the workers, move its files into place and record it as done."""
    out, settings = build.out, build.settings
    tmp = out / TMP
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    docs = iter_documents(
        build.paths,
        text_field=settings["text_field"],
        on_bad=settings["on_bad"],
        skipped=skipped,
        max_document_bytes=settings["max_document_bytes"],
        text_documents=settings.get("text_documents", "paragraphs"),
    )
    threads = max(1, (os.cpu_count() or 1) // max(1, build.num_workers))  # each worker gets its share of cores
    init_args = (str(build.tok_file), str(tmp), dtype.name, threads)
    try:
        from tqdm import tqdm

        with tqdm(desc="tokenizing", unit=" docs", disable=not build.show_progress) as bar:

            def todo():  # chunks still to tokenize; finished ones are read past (cheap next to tokenizing)
                for index, texts in _chunks(docs, settings["docs_per_shard"]):
                    if index in done:
                        bar.update(len(texts))
                    else:
                        yield index, texts

            for result in run_workers(todo(), build.num_workers, init_args):
                bar.update(result["input_docs"])
                for suffix in SUFFIXES if result["documents"] else ():
                    os.replace(tmp / (result["tmp_prefix"] + suffix), out / (result["name"] + suffix))
                record = {k: v for k, v in result.items() if k != "tmp_prefix"}
                # Not fsynced: a resume re-hashes the files against this record anyway.
                write_json_atomic(out / (result["name"] + DONE), record, sync=False)
                done[result["index"]] = record
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_manifest(
    build: Build, vocab_size: int, dtype: np.dtype, records: list[dict], skipped: collections.Counter
) -> dict:
    """Assemble the manifest from the done records (in shard order), write it last, then drop the records."""
    out, settings = build.out, build.settings
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
            f"empty corpus: no usable documents in {describe_inputs(build.paths)}: "
            + describe_skipped(skipped, settings["text_field"])
        )
    manifest = {
        "format_version": FORMAT_VERSION,
        "cache_key": build.key,
        "settings": settings,
        "tokenizer_hash": build.tok_hash,
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "text_field": settings["text_field"],
        "inputs": [fp[0] for fp in build.fingerprint],
        "input_bytes": [fp[1] for fp in build.fingerprint],
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
        old = read_json(out / MANIFEST) or {}
        if {k: v for k, v in old.items() if k != "created"} == manifest:
            return old
        if MIXTURE_KEY not in old:
            _clear(out)  # a one-corpus build here before: its shard files are not the mixture's
        manifest["created"] = time.time()
        write_json_atomic(out / MANIFEST, manifest)
    return manifest


def replace_build(new: Path, out: Path) -> None:
    """Put the finished build in `new` (built beside `out`) in place of the build in `out`, file by file: only the
    files a build writes (and a mixture's source directories) are replaced; anything else in `out` stays, and a
    symlinked `out` stays a link to the same place. The manifest goes first and comes back last, so a crash
    between leaves `out` incomplete (built again when next used), never a mix that looks finished. The caller holds
    `out` exclusively."""
    out = Path(out)
    old = read_json(out / MANIFEST) or {}
    _remove_build_files(out)
    for source in old.get(MIXTURE_KEY, []):  # named by the manifest that listed their shards: ours
        shutil.rmtree(out / source["name"], ignore_errors=True)
    for p in new.iterdir():
        if p.name not in (MANIFEST, MARKER, LOCK):
            os.replace(p, out / p.name)
    os.replace(new / MANIFEST, out / MANIFEST)
    mark_output(out, "shards")
    shutil.rmtree(new, ignore_errors=True)
