"""Training samples from shards: RoBERTa FULL-SENTENCES and DOC-SENTENCES packing.

FULL-SENTENCES (`PackedSequences`, builder "packed", data.packing=full_sentences): the stream is every document
followed by one [SEP], in shard order. Sample i is [CLS] + stream[i*C : (i+1)*C] + [SEP] with C = max_seq_len - 2,
so a sample may span documents and every corpus token is seen once per epoch. A final partial chunk shorter than
max_seq_len // 4 is dropped; a longer one is completed from the start of the stream (its first tokens are then seen
twice), so that every sample fills the window: a batch never needs a key mask, and a compiled model meets one shape
and one attention form (the epoch's one short sample recompiled BERT-base's layers on a GPU, 17.7 s). A stream shorter
than one window stays one short sample. Random access is O(log D) via searchsorted, with no per-token Python loop.

DOC-SENTENCES (`DocPackedSequences`, builder "doc_packed", data.packing=doc_bounded): no sample crosses a
document boundary. Each document is cut greedily into chunks of whole sentences of at most C tokens; a
sentence longer than C is cut at C tokens. A short document is one short sample of its own: packing several
whole documents together would put them in one attention window, which is what this mode exists to avoid
(RoBERTa's DOC-SENTENCES). The cost is padding, which `pretrain data inspect` reports as packing efficiency.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from data_pipeline.shards import ShardSet


class SampleBuilder(Protocol):
    """What the loader needs of a sample builder: how many samples an epoch has, and sample `index` as a dict of
    numpy arrays. `rng` is the sample's own generator (seed, epoch, index: `loader.sample_rng`); a builder whose
    samples are fixed ignores it, one whose samples are random (segment pairs) draws from it."""

    def __len__(self) -> int: ...

    def sample(self, index: int, rng: np.random.Generator) -> dict[str, np.ndarray]: ...


class _Chunks:
    """What both packings share: [CLS] + up to max_seq_len - 2 tokens + [SEP] per sample."""

    def __init__(self, shards: ShardSet, max_seq_len: int, cls_id: int, sep_id: int):
        if max_seq_len < 3:
            raise ValueError(f"max_seq_len must be >= 3 for [CLS] x [SEP], got {max_seq_len}")
        self.shards = shards
        self.max_seq_len = max_seq_len
        self.cls_id, self.sep_id = int(cls_id), int(sep_id)
        self.chunk = max_seq_len - 2

    def sample(self, index: int, rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
        """Sample `index` (the packings are fixed: `rng` is not used)."""
        return self[index]


class PackedSequences(_Chunks):
    """Map-style dataset of packed samples: dicts of numpy arrays, all [n] with n <= max_seq_len."""

    def __init__(self, shards: ShardSet, max_seq_len: int, cls_id: int, sep_id: int, each_token_once: bool = False):
        """For training the last chunk, where at least a quarter of a window, is filled from the stream's start, a
        shorter one dropped (every sample a full window); `each_token_once` (evaluation) keeps it as it is, short:
        no token scored twice, none left out, and a corpus shorter than a window still one sample."""
        super().__init__(shards, max_seq_len, cls_id, sep_id)
        offsets = shards.doc_offsets()  # [D+1]
        # Stream position of the [SEP] closing document d: its tokens end there, shifted by the d earlier SEPs.
        self._sep_pos = offsets[1:] + np.arange(shards.num_docs, dtype=np.int64)  # [D]
        self.stream_len = int(offsets[-1]) + shards.num_docs
        self.each_token_once = each_token_once
        full, rest = divmod(self.stream_len, self.chunk)
        self._len = full + int(rest > 0 and (each_token_once or rest >= max_seq_len // 4))

    def __len__(self) -> int:
        return self._len

    def stream_span(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ids [m] int64, word starts [m] bool and SEP flags [m] bool of stream[start:end]."""
        d0, d1 = np.searchsorted(self._sep_pos, [start, end])  # SEPs inside the span: documents d0..d1-1
        seps = self._sep_pos[d0:d1] - start  # [k] positions in the span
        # Tokens before `start` = start minus the d0 SEPs before it; the span holds (end-start-k) tokens.
        ids, words = self.shards.read_span(start - int(d0), end - start - len(seps))
        if not len(seps):  # most spans: no document ends inside
            return ids.astype(np.int64), words, np.zeros(len(ids), bool)
        # Tokens around the SEPs by a mask: np.insert's bookkeeping cost more than the copies
        is_sep = np.zeros(end - start, bool)
        is_sep[seps] = True
        tokens = ~is_sep
        out_ids = np.full(end - start, self.sep_id, np.int64)
        out_ids[tokens] = ids
        out_words = np.ones(end - start, bool)
        out_words[tokens] = words
        return out_ids, out_words, is_sep

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not -self._len <= index < self._len:
            raise IndexError(f"sample {index} outside [0, {self._len})")
        index %= self._len
        start = index * self.chunk
        ids, words, is_sep = self.stream_span(start, min(start + self.chunk, self.stream_len))
        fill = start + self.chunk - self.stream_len  # tokens past the stream's end: taken from its start
        if fill > 0 and start > 0 and not self.each_token_once:  # start >= chunk > fill: no overlap with the head
            head = self.stream_span(0, fill)
            ids, words, is_sep = (np.concatenate(pair) for pair in zip((ids, words, is_sep), head))
        n = len(ids) + 2
        input_ids = np.empty(n, np.int64)  # [n]
        input_ids[0], input_ids[1:-1], input_ids[-1] = self.cls_id, ids, self.sep_id
        special = np.ones(n, bool)  # [n] CLS and every SEP
        special[1:-1] = is_sep
        word_starts = np.ones(n, bool)  # [n] specials count as word starts
        word_starts[1:-1] = words
        return {
            "input_ids": input_ids,
            "token_type_ids": np.zeros(n, np.int64),
            "word_starts": word_starts,
            "special_mask": special,
        }


class DocPackedSequences(_Chunks):
    """Map-style dataset of document-bounded samples [CLS] chunk [SEP], chunk within one document."""

    def __init__(self, shards: ShardSet, max_seq_len: int, cls_id: int, sep_id: int):
        super().__init__(shards, max_seq_len, cls_id, sep_id)
        # Chunks tile every document, and documents tile the token space, so chunk i is simply
        # [starts[i], starts[i+1]): one int64 per sample.
        self._starts = doc_chunk_starts(shards.doc_offsets(), shards.sent_offsets(), self.chunk)  # [N+1]

    def __len__(self) -> int:
        return len(self._starts) - 1

    def chunk_lengths(self) -> np.ndarray:
        """[N] tokens of each sample's chunk ([CLS] and [SEP] not counted)."""
        return np.diff(self._starts)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} outside [0, {len(self)})")
        index %= len(self)
        lo, hi = int(self._starts[index]), int(self._starts[index + 1])
        ids, words = self.shards.read_span(lo, hi - lo)
        n = len(ids) + 2
        input_ids = np.empty(n, np.int64)  # [n]
        input_ids[0], input_ids[1:-1], input_ids[-1] = self.cls_id, ids, self.sep_id
        special = np.zeros(n, bool)  # [n]
        special[0] = special[-1] = True
        word_starts = np.ones(n, bool)  # [n]
        word_starts[1:-1] = words
        return {
            "input_ids": input_ids,
            "token_type_ids": np.zeros(n, np.int64),
            "word_starts": word_starts,
            "special_mask": special,
        }


def doc_chunk_starts(doc_offsets: np.ndarray, sent_offsets: np.ndarray, chunk: int) -> np.ndarray:
    """[N+1] global token offsets of greedy whole-sentence chunks of at most `chunk` tokens per document.

    doc_offsets [D+1] and sent_offsets [S+1] are global token offsets (document starts are sentence starts).
    Vectorized over documents: round k cuts the k-th chunk of every document still open, so the number of
    numpy passes is the chunk count of the longest document, not the number of samples.
    """
    pos = doc_offsets[:-1].astype(np.int64)  # [D] where each open document's next chunk starts
    end = doc_offsets[1:].astype(np.int64)  # [D]
    cuts = [pos.copy()]
    active = np.flatnonzero(pos < end)
    while len(active):
        p, e = pos[active], end[active]
        target = np.minimum(p + chunk, e)
        # The last sentence boundary at or before target; if it is not past p, the sentence is longer than
        # a chunk and is cut at target.
        b = sent_offsets[np.searchsorted(sent_offsets, target, "right") - 1]
        b = np.where(b > p, b, target)
        pos[active] = b
        cuts.append(b[b < e])  # document ends are already in `cuts` as the next document's start
        active = active[b < e]
    cuts.append(doc_offsets[-1:])
    return np.unique(np.concatenate(cuts))


PACKING = {"full_sentences": "packed", "doc_bounded": "doc_packed"}
"""data.packing -> the sample builder that token-level objectives use."""
FULL_WINDOWS = ("packed", "full_sentences")
"""The builders whose rows fill the whole window (but where the stream is shorter than one): batches without padding."""


def builder_kind(objective_kind: str, packing: str = "full_sentences") -> str:
    """The builder to use: segment pairs when the objectives need them, else the configured packing."""
    if packing not in PACKING:
        raise ValueError(f"data.packing: '{packing}' is not one of {', '.join(PACKING)}")
    return PACKING[packing] if objective_kind == "packed" else objective_kind


def build_samples(kind: str, shards: ShardSet, max_seq_len: int, tokens, seed: int):
    """The sample builder a run's objectives asked for (see `objectives.sample_builder_for`, `builder_kind`).

    "packed" (or "full_sentences") = FULL-SENTENCES; "doc_packed" (or "doc_bounded") = DOC-SENTENCES;
    "pairs" = segment pairs for NSP/SOP.
    """
    if kind in ("packed", "full_sentences"):
        return PackedSequences(shards, max_seq_len, tokens.cls, tokens.sep)
    if kind in ("doc_packed", "doc_bounded"):
        return DocPackedSequences(shards, max_seq_len, tokens.cls, tokens.sep)
    if kind == "pairs":
        from data_pipeline.pairs import SegmentPairs

        return SegmentPairs(shards, max_seq_len, tokens, seed)
    raise ValueError(f"unknown sample builder '{kind}'")
