"""Segment pairs for sentence-level objectives (NSP, SOP), after BERT's create_instances_from_document.

Index (built once, from `seed` only): each document's sentences are cut greedily into *chunks*. A chunk
starting at sentence s draws a target length t(s): max_seq_len - 3 tokens, or with probability
`short_seq_prob` a uniform length in [2, max_seq_len - 3] (so the model also sees short inputs), and takes
sentences until it holds >= t(s) tokens or the document ends. One chunk = one sample. Two changes from
BERT, both so that every chunk has a TRUE next segment and labels stay balanced (BERT forces a random B
for a one-sentence chunk, which skews NSP labels and leaves SOP nothing to swap):
  * a chunk takes at least 2 sentences, and never leaves a lone last sentence behind (it takes it too);
  * a single-sentence document is no chunk: it only serves as a random segment. Split at a word, its second half
    would start mid-sentence where a random B never does, and (for SOP) its first half end without the full stop:
    the label could be read off the surface of the text.

Sample (per (seed, epoch, index) rng, so pairs change every epoch): the chunk is split at a random
sentence boundary into A and its true continuation B; a RANDOM segment is also drawn from another
document (uniform document != this one, uniform start sentence, sentences until it fills the target
length left after A). The objective picks what it needs and calls `assemble_pair`.

Convention: `SegmentPairs.sample` returns only raw material, under keys starting with "_" (ragged arrays
and provenance). A sentence-level objective's `prepare` must `pop_raw` them all and return the assembled
sample; build_objectives runs it first, so token-level objectives and collate never see "_" keys.
"""

from __future__ import annotations

import numpy as np

from data_pipeline.shards import ShardSet

_INDEX_STREAM = 2  # SeedSequence stream of the index, distinct from the loader's order (0) and sample (1) streams


def sentence_offsets(shards: ShardSet) -> np.ndarray:
    """[S+1] int64 global token offsets of every sentence of the corpus."""
    if hasattr(shards, "sent_offsets"):
        return shards.sent_offsets()
    # older ShardSet without the accessor: one pass over documents (slow in Python, but only at start-up)
    return np.concatenate(
        [shards.doc_sentence_offsets(d)[:-1] + shards.doc_offsets()[d] for d in range(shards.num_docs)]
        + [shards.doc_offsets()[-1:]]
    ).astype(np.int64)


class SegmentPairs:
    """Map-style dataset of segment pairs over a shard set; `len` = number of chunks in the index."""

    def __init__(self, shards: ShardSet, max_seq_len: int, tokens, seed: int, short_seq_prob: float = 0.1):
        if max_seq_len < 5:
            raise ValueError(f"max_seq_len must be >= 5 for [CLS] A [SEP] B [SEP], got {max_seq_len}")
        self.shards = shards
        self.max_seq_len = max_seq_len
        self.tokens = tokens
        self.seed = seed
        self.max_tokens = max_seq_len - 3  # room for [CLS] and two [SEP]
        self._sent = sentence_offsets(shards)  # [S+1]
        doc_tok = shards.doc_offsets()  # [D+1]
        # Documents start at sentence starts, so this is exact: [D+1] first sentence of each document.
        self._doc_sent = np.searchsorted(self._sent, doc_tok).astype(np.int64)
        self._doc_tok = doc_tok
        self.first, self.end, self.target, self.doc = self._build_index(short_seq_prob)

    def _build_index(self, short_seq_prob: float):
        """Chunks as 4 arrays [C]: first sentence, end sentence (exclusive; global ids), target, document."""
        sent, doc_sent = self._sent, self._doc_sent
        num_sents = len(sent) - 1
        rng = np.random.default_rng([self.seed, _INDEX_STREAM])
        short = rng.random(num_sents) < short_seq_prob  # [S] target of a chunk starting at each sentence
        target = np.where(short, rng.integers(2, self.max_tokens + 1, num_sents), self.max_tokens)
        doc_of = np.repeat(np.arange(len(doc_sent) - 1), np.diff(doc_sent))  # [S]
        doc_end = doc_sent[1:][doc_of]  # [S] sentence after the document's last
        start = np.arange(num_sents)
        # Chunk from s: the first end e with tokens(s..e) >= target, at least 2 sentences, within the document,
        # and taking a lone last sentence along.
        end = np.searchsorted(sent, sent[:-1] + target, "left")  # [S]
        end = np.minimum(np.maximum(end, start + 2), doc_end)
        end = np.where(end == doc_end - 1, doc_end, end)
        # Walk all documents' chunk chains at once: one numpy step per chunk of the longest document.
        heads, cur = [], doc_sent[:-1]
        while cur.size:
            heads.append(cur)
            nxt = end[cur]
            cur = nxt[nxt < doc_end[cur]]  # chains whose document continues
        first = np.sort(np.concatenate(heads))  # [C] corpus order
        first = first[end[first] - first >= 2]  # a single-sentence document has no pair of its own
        return first, end[first], target[first].astype(np.int32), doc_of[first].astype(np.int32)

    def __len__(self) -> int:
        return len(self.first)

    def sample(self, index: int, rng: np.random.Generator) -> dict:
        """Raw material of chunk `index` (all "_" keys; token offsets are relative to their document)."""
        sent, shards = self._sent, self.shards
        first, end, target, doc = (int(a[index]) for a in (self.first, self.end, self.target, self.doc))
        lo, hi = int(sent[first]), int(sent[end])
        ids, words = shards.read_span(lo, hi - lo)  # [n] the chunk: A then B
        cut = int(sent[rng.integers(first + 1, end)]) - lo  # a sentence boundary: >= 1 sentence each side
        ids = ids.astype(np.int64)
        raw = {
            "_seg_a": ids[:cut],
            "_seg_a_words": words[:cut],
            "_seg_b": ids[cut:],
            "_seg_b_words": words[cut:],
            "_doc": doc,
            "_a_start": lo - int(self._doc_tok[doc]),
            "_max_seq_len": self.max_seq_len,
        }
        raw["_b_start"] = raw["_a_start"] + cut
        raw["_b_end"] = raw["_a_start"] + len(ids)
        raw.update(self._random_segment(doc, max(target - cut, 1), rng))
        return raw

    def _random_segment(self, doc: int, need: int, rng: np.random.Generator) -> dict:
        """Sentences from a random start in a uniform random other document, until >= `need` tokens."""
        num_docs = len(self._doc_sent) - 1
        if num_docs < 2:  # nothing to draw from; an objective that needs it raises
            empty = np.zeros(0, np.int64)
            return {
                "_seg_rand": empty,
                "_seg_rand_words": empty.astype(bool),
                "_rand_doc": -1,
                "_rand_start": 0,
                "_rand_end": 0,
            }
        other = int(rng.integers(num_docs - 1))
        other += other >= doc  # uniform over the documents != doc
        s0, s1 = int(self._doc_sent[other]), int(self._doc_sent[other + 1])
        s = int(rng.integers(s0, s1))
        e = int(np.searchsorted(self._sent, self._sent[s] + need, "left"))
        e = min(max(e, s + 1), s1)
        lo, hi = int(self._sent[s]), int(self._sent[e])
        ids, words = self.shards.read_span(lo, hi - lo)
        base = int(self._doc_tok[other])
        return {
            "_seg_rand": ids.astype(np.int64),
            "_seg_rand_words": words,
            "_rand_doc": other,
            "_rand_start": lo - base,
            "_rand_end": hi - base,
        }
