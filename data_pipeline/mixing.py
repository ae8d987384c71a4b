"""Weighted mixing of corpora (`data.sources`): which source each stream position draws from, and the tokenizer's
sample split by weight.

The schedule (`Interleave`) is a pure function of (seed, weights, position), so a resumed run, any world size and
any worker count continue the same global sequence, and position i is located in O(log sources) without replaying
anything. Sources form a balanced binary tree; at each node the positions reaching it are split between its two
halves in proportion to their weights by a Bresenham line, `left(k) = floor((k * p + phase) / q)`: the first k
positions hold exactly left(k) left ones, so the count of every source in any prefix is within a few samples of
its share (a stratified schedule: every batch holds the mix), and a position's rank within its source is known at
once. The per-node phase comes from the seed, so seeds differ in where the sources fall.

Each source keeps its own sample sequence: its k-th draw is sample k % n of its epoch k // n (n samples per epoch),
through the loader's per-(source, epoch) permutation (`loader.PretrainDataset`), so an exhausted source starts a
new epoch in a new order while the others go on.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from data_pipeline.readers import Document, expand_inputs, iter_documents_sample
from pretrain.core.errors import ConfigError, DataError

RESOLUTION = 10**9
"""Weights become integer shares of this: exact integer arithmetic at any position, proportions exact to 1e-9."""
_MIX_STREAM = 2  # a SeedSequence stream apart from the loader's order (0) and sample (1) streams


def weight_units(weights: Sequence[float]) -> list[int]:
    """Integer shares of `weights` (each > 0), summing to about RESOLUTION; none is 0."""
    total = float(sum(weights))
    return [max(1, round(float(w) / total * RESOLUTION)) for w in weights]


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders; ties to the earlier source), summing to
    `total`."""
    exact = [total * float(w) / float(sum(weights)) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))[: total - sum(counts)]:
        counts[i] += 1
    return counts


class Interleave:
    """Source of each stream position, with proportions = weights; see the module docstring."""

    def __init__(self, weights: Sequence[float], seed: int):
        if not weights or min(weights) <= 0:
            raise ValueError(f"weights must be > 0, got {list(weights)}")
        self.num_sources = len(weights)
        units = weight_units(weights)
        # (lo, hi) -> (mid, p, q, phase): sources [lo, mid) go left, [mid, hi) right
        self._split: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        stack = [(0, len(units))]
        while stack:
            lo, hi = stack.pop()
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            p, q = sum(units[lo:mid]), sum(units[lo:hi])
            phase = int(np.random.default_rng([seed, _MIX_STREAM, lo, hi]).integers(q))
            self._split[(lo, hi)] = (mid, p, q, phase)
            stack += [(lo, mid), (mid, hi)]

    def locate(self, position: int) -> tuple[int, int]:
        """(source, k): stream position `position` is the k-th draw (from 0) of `source`."""
        if position < 0:
            raise IndexError(f"stream position {position} < 0")
        lo, hi, k = 0, self.num_sources, int(position)
        while hi - lo > 1:
            mid, p, q, phase = self._split[(lo, hi)]
            before = (k * p + phase) // q  # left positions among this node's first k
            if ((k + 1) * p + phase) // q > before:
                hi, k = mid, before
            else:
                lo, k = mid, k - before
        return lo, k

    def counts(self, n: int) -> np.ndarray:
        """[sources] int64: how many of the first `n` positions each source gets."""
        out = np.zeros(self.num_sources, np.int64)

        def split(lo: int, hi: int, m: int) -> None:
            if hi - lo == 1:
                out[lo] = m
                return
            mid, p, q, phase = self._split[(lo, hi)]
            left = (m * p + phase) // q - phase // q
            split(lo, mid, left)
            split(mid, hi, m - left)

        split(0, self.num_sources, int(n))
        return out


class MixedSamples:
    """Several sources' sample builders drawn from by weight. As a map-style dataset (`len`, `sample(index, rng)`)
    it is the sources' samples one after the other; the training stream reads it through `draw` instead (the
    loader's `PretrainDataset` does), which interleaves them by weight."""

    def __init__(self, builders: list, names: list[str], weights: list[float], seed: int):
        if not len(builders) == len(names) == len(weights):
            raise ValueError("one builder, name and weight per source")
        self.builders, self.names, self.weights = list(builders), list(names), [float(w) for w in weights]
        self.lengths = [len(b) for b in self.builders]
        self.schedule = Interleave(self.weights, seed)
        self._starts = np.cumsum([0] + self.lengths)  # [S+1] of the concatenated view

    def __len__(self) -> int:
        return int(self._starts[-1])

    def sample(self, index: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        source = int(np.searchsorted(self._starts, index, "right")) - 1
        return self.builders[source].sample(index - int(self._starts[source]), rng)

    def draw(self, position: int) -> tuple[int, int, int]:
        """(source, epoch of that source, offset within its epoch) of stream position `position`."""
        source, k = self.schedule.locate(position)
        epoch, offset = divmod(k, self.lengths[source])
        return source, epoch, offset

    def draws(self, num_positions: int) -> np.ndarray:
        """[sources] samples each source gives to the first `num_positions` positions of the stream."""
        return self.schedule.counts(num_positions)


def source_inputs(sources: Sequence) -> list[tuple[str, list, float]]:
    """(name, input files, weight) of each `SourceConfig`. A pattern that matches no file is a ConfigError naming
    the source and the pattern."""
    out = []
    for i, source in enumerate(sources):
        files: set = set()
        for pattern in source.corpus:
            try:
                files.update(expand_inputs([pattern]))
            except DataError as err:
                raise ConfigError(
                    f"data.sources[{i}] ('{source.name}'): corpus '{pattern}' matches no corpus file ({err})"
                ) from None
        out.append((source.name, sorted(files), float(source.weight)))
    return out


def iter_documents_weighted(
    groups: Sequence[Iterable[str]], weights: Sequence[float], max_docs: int, **kwargs
) -> Iterator[Document]:
    """About `max_docs` documents in all, each group (a source's inputs) giving its weight's share (at least one),
    spread over its files as `iter_documents_sample` does; in group order, so deterministic. A group with fewer
    documents than its share gives them again until it is filled, as training repeats a small source up to its
    weight (read once, it was 12% of the sample at 1:1 beside a larger one)."""
    quotas = [max(1, q) for q in apportion(max_docs, weights)]
    return itertools.chain.from_iterable(_filled(list(paths), quota, kwargs) for paths, quota in zip(groups, quotas))


def _filled(paths: list, quota: int, kwargs: dict) -> Iterator[Document]:
    """`quota` documents of `paths` (`iter_documents_sample`), passing over them again while they are fewer."""
    given = 0
    while given < quota:
        before = given
        for doc in iter_documents_sample(paths, quota - given, **kwargs):
            given += 1
            yield doc
        if given == before:  # nothing usable in the group: the empty-corpus checks say so
            return
