"""The on-disk format of a shard directory: file names, the format version, the token dtype, and the content
hashes of shard records.

Layout of `out_dir` (n = tokens, d = documents, s = sentences of one shard):
    shard_00000.tokens.bin  [n] uint16/uint32 raw token ids, no special tokens
    shard_00000.docs.npy    [d+1] int64 token offsets of documents
    shard_00000.sents.npy   [s+1] int64 token offsets of sentences (document starts are sentence starts)
    shard_00000.words.bin   [ceil(n/8)] np.packbits of a bool per token: True where a word starts
    manifest.json           written last, atomically: a directory is complete iff it has one

A mixture's manifest (`shard_build.write_mixture`) lists its sources under MIXTURE_KEY and their shards as
`<source>/shard_XXXXX`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BUILD_STATE = "build.json"
DONE = ".done.json"
SUFFIXES = (".tokens.bin", ".docs.npy", ".sents.npy", ".words.bin")
TMP = ".tmp"
MIXTURE_KEY = "sources"


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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
