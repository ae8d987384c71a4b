"""Reading a finished shard directory: `ShardSet` verifies it against its manifest and memory-maps it for random
access by global document and token index; `unigram_entropy` of its tokens, and `unigram_cross_entropy` of
another corpus's tokens under its frequencies."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from data_pipeline.shard_format import (
    FORMAT_VERSION,
    MANIFEST,
    MIXTURE_KEY,
    SUFFIXES,
    mixture_hash,
    shards_hash,
)
from pretrain.core.errors import DataError
from pretrain.core.files import sha256_file
from pretrain.core.outputs import shared


def mappable_shards() -> int:
    """How many shards the ShardSets of this process together keep memory-mapped (the first they read): an eighth
    of what it may open.
    Each map holds a file descriptor (Python's mmap keeps a duplicate) and a memory map, two of each per shard, and
    mapping every shard of a large corpus ran out of open files (ulimit -n, 1024 on many systems: about 500 shards, a
    million documents at the default data.docs_per_shard) or of memory maps (vm.max_map_count, 65530 by default). The
    other shards are read with pread, holding nothing open: a few times a mapped read's cost, a fraction of a map's."""
    import resource

    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        maps = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        maps = 65530
    return max(1, min(maps, files if files != resource.RLIM_INFINITY else maps) // 16)


def _pread(path: str, dtype, lo: int, hi: int) -> np.ndarray:
    """Items lo:hi [hi - lo] of a file of `dtype`, read into a new array without keeping the file open."""
    out = np.empty(hi - lo, dtype)
    fd = os.open(path, os.O_RDONLY)
    try:
        read = os.preadv(fd, [out], lo * out.itemsize)
    finally:
        os.close(fd)
    if read != out.nbytes:
        raise DataError(f"{path} is shorter than its manifest says (file changed or truncated); rebuild the shards")
    return out


class ShardSet:
    """A verified shard directory, memory-mapped, addressed by global document and token index.

    Global token space = the tokens of all documents concatenated in shard order; `doc_offsets()` [D+1]
    gives each document's span in it.
    """

    # Shards mapped by every ShardSet of this process: `mappable_shards` is the process's share, and a mixture's
    # sources (one set each, as training reads them) mapped a share each, 8 sources x 2 x an eighth of the limit.
    _mapped_in_process = 0

    def __init__(
        self,
        directory: str | os.PathLike,
        verify: bool = True,
        expected_tokenizer_hash: str | tuple[str, ...] | None = None,
    ):
        self.dir = Path(directory)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise DataError(f"no {MANIFEST} in {self.dir} — build shards first")
        try:
            self.manifest: dict = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {path}: {e}") from e
        if not isinstance(self.manifest, dict):  # ([] was an AttributeError traceback)
            raise DataError(f"{path}: not a shard manifest (a JSON object); rebuild the shards")
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{path}: format_version {self.manifest.get('format_version')!r}, expected "
                f"{FORMAT_VERSION}; rebuild the shards"
            )
        if isinstance(expected_tokenizer_hash, str):
            expected_tokenizer_hash = (expected_tokenizer_hash,)  # (or the tokenizers an export's was exported from)
        if expected_tokenizer_hash is not None and self.manifest["tokenizer_hash"] not in expected_tokenizer_hash:
            raise DataError(
                f"{self.dir} was built with a different tokenizer (hash "
                f"{self.manifest['tokenizer_hash'][:12]}, expected {expected_tokenizer_hash[0][:12]}); "
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
        self._maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # shard -> (tokens, packed word starts)
        self._mappable = mappable_shards()

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
        return {**self.__dict__, "_maps": {}}

    def __del__(self) -> None:
        ShardSet._mapped_in_process -= len(self.__dict__.get("_maps", ()))  # its maps close with it

    def _read_shard(self, k: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens lo:hi of shard k [hi - lo] (a copy), and the packed word-start bytes that hold them: from its memory
        maps, or from its files once `mappable_shards` are mapped."""
        maps = self._maps.get(k)
        s = self.manifest["shards"][k]
        if maps is None and ShardSet._mapped_in_process < self._mappable:
            maps = self._maps[k] = (
                self._map(f"{s['name']}.tokens.bin", self.dtype, s["tokens"]),
                self._map(f"{s['name']}.words.bin", np.uint8, (s["tokens"] + 7) // 8),
            )
            ShardSet._mapped_in_process += 1
        if maps is not None:
            ids, packed = maps
            return ids[lo:hi].copy(), packed[lo // 8 : (hi + 7) // 8]
        return (
            _pread(f"{self.dir}/{s['name']}.tokens.bin", self.dtype, lo, hi),
            _pread(f"{self.dir}/{s['name']}.words.bin", np.uint8, lo // 8, (hi + 7) // 8),
        )

    def _map(self, filename: str, dtype, count: int) -> np.ndarray:
        # A plain ndarray view of the map (it keeps the map open): a slice of a np.memmap is a memmap, whose
        # construction cost as much as a sample's read.
        return np.memmap(self.dir / filename, dtype, "r", shape=(count,)).view(np.ndarray)

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
        if length == 0:  # also at the very end, where no shard starts (a packed chunk of only the last [SEP])
            return np.zeros(0, self.dtype), np.zeros(0, bool)
        bounds = self._shard_tok_start
        first = int(bounds.searchsorted(start, "right")) - 1
        last = int(bounds.searchsorted(end, "left"))  # exclusive shard bound
        tokens, words = [], []
        for k in range(first, max(first + 1, last)):
            base = int(bounds[k])
            lo, hi = max(start, base) - base, min(end, int(bounds[k + 1])) - base
            ids, packed = self._read_shard(k, lo, hi)
            tokens.append(ids)
            bits = np.unpackbits(packed)  # [8*bytes] uint8 0/1, a new array
            words.append(bits[lo % 8 : lo % 8 + (hi - lo)].view(bool))
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


def unigram_counts(shards, special_ids: tuple[int, ...] = (), max_tokens: int = 10_000_000, size: int = 0):
    """[max(size, largest id + 1)] float64 count of each token id over the first `max_tokens` tokens, specials 0."""
    n = min(shards.num_tokens, max_tokens)
    counts = np.bincount(shards.read_span(0, n)[0].astype(np.int64), minlength=size).astype(np.float64)
    counts[[i for i in special_ids if i < len(counts)]] = 0
    return counts


def unigram_entropy(shards, special_ids: tuple[int, ...] = (), max_tokens: int = 10_000_000) -> float:
    """Entropy (nats) of the corpus's token frequencies, specials left out, over its first `max_tokens` tokens: the
    masked-LM loss of a model that predicts every masked token from frequency alone, ignoring its context (the
    'unigram plateau' a short run sits on before it learns to use context)."""
    counts = unigram_counts(shards, special_ids, max_tokens)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def unigram_cross_entropy(
    train, heldout, vocab_size: int, special_ids: tuple[int, ...] = (), max_tokens: int = 10_000_000
) -> float:
    """Cross-entropy (nats) of `heldout`'s tokens under `train`'s token frequencies (add-one smoothed over the
    vocabulary, specials left out): the masked-LM loss on held-out text of a model that learned frequencies alone
    from `train`. It exceeds `heldout`'s own unigram entropy by the divergence of the two corpora's frequencies: a
    model trained on one corpus and scored on another sits on this plateau until it uses context."""
    seen = unigram_counts(train, special_ids, max_tokens, vocab_size)
    held = unigram_counts(heldout, special_ids, max_tokens, vocab_size)
    if max(len(seen), len(held)) > vocab_size or not held.sum():
        raise ValueError(f"token ids beyond the vocabulary of {vocab_size}, or no held-out tokens but specials")
    ids = np.setdiff1d(np.arange(vocab_size), special_ids)
    seen, held = seen[ids] + 1.0, held[ids]
    p = held / held.sum()
    return float(-(p[held > 0] * np.log(seen[held > 0] / seen.sum())).sum())


@contextlib.contextmanager
def reading_shards(shards_dir: str | os.PathLike):
    """Hold a shard directory (a mixture's, each source's too) `shared` while its shards are read: `ShardSet` opens
    their files by name as it goes, so a build that rewrote them meanwhile (`shard_build._clear`: another run's, or
    `pretrain shards --out` into them) would hand the reader new tokens at the old offsets. It is refused instead."""
    with contextlib.ExitStack() as held:
        sources = [p.parent for p in Path(shards_dir).glob("*/manifest.json") if not p.parent.name.startswith(".")]
        for directory in [Path(shards_dir), *sorted(sources)]:  # not a rebuild beside them (.rebuild): not read
            held.enter_context(shared(directory))
        yield
