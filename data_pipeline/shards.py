"""Tokenized, memory-mapped corpus shards: the public entry point of the shard stages.

- `shard_format`: the directory layout, file names, format version, token dtype and content hashes;
- `shard_encode`: the worker processes that tokenize chunks of documents into shard files;
- `shard_build`: the resumable, locked build (cache key, verification of finished shards, manifest) and a
  mixture's manifest;
- `shard_read`: `ShardSet`, the verified, memory-mapped reader.

Other modules import from here, so the stages can move without their callers changing.
"""

from __future__ import annotations

from data_pipeline.shard_build import build_key, build_shards, replace_build, shards_current, write_mixture
from data_pipeline.shard_format import (
    BUILD_STATE,
    DONE,
    FORMAT_VERSION,
    MANIFEST,
    MIXTURE_KEY,
    SUFFIXES,
    TMP,
    mixture_hash,
    shard_name,
    shards_hash,
    token_dtype,
)
from data_pipeline.shard_read import ShardSet, reading_shards, unigram_cross_entropy, unigram_entropy

__all__ = [
    "BUILD_STATE",
    "DONE",
    "FORMAT_VERSION",
    "MANIFEST",
    "MIXTURE_KEY",
    "SUFFIXES",
    "TMP",
    "ShardSet",
    "reading_shards",
    "build_key",
    "build_shards",
    "mixture_hash",
    "replace_build",
    "shard_name",
    "shards_current",
    "shards_hash",
    "token_dtype",
    "unigram_cross_entropy",
    "unigram_entropy",
    "write_mixture",
]
