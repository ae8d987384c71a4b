"""Word-level masking shared by whole-word / n-gram MLM and SpanBERT.

Words come only from the pipeline's `word_starts` (True where a token begins a word; [CLS]/[SEP] count as
starts), so this works for any tokenizer: the shard build makes them BERT's words for every kind
(`data_pipeline.shard_encode`: WordPiece's `##`, the pre-tokenizer's words of byte-level BPE and Unigram, a
punctuation mark a word of its own, a CJK ideograph too, spaces alone part of the next word). A word is a
candidate when none of its tokens is special.

Span selection draws a span length (in words), then places it uniformly among the positions where it fits;
it never truncates or shrinks a span. Whether to draw another span is decided *before* its length is known,
so the lengths of the spans placed follow the sampler's distribution (Wald's identity: the pooled mean over
many samples is the sampler's mean), while the expected number of masked tokens is close to the budget.
The first span is always placed, so a sample is never left without targets: where its drawn length fits nowhere (a
short sample), its length is drawn again among the lengths that fit, from the same distribution cut there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from pretrain.core.errors import ConfigError
from pretrain.core.tokens import SpecialTokens


def check_replacement(where: str, mask_token_prob: float, random_token_prob: float) -> None:
    """The rule between BERT's replacement rates of options at config path `where` (e.g. "objectives.mlm"): each
    rate's own range is declared with its option."""
    if mask_token_prob + random_token_prob > 1.0 + 1e-9:
        raise ConfigError(
            f"{where}: mask_token_prob + random_token_prob must be <= 1 (the rest stay unchanged), "
            f"got {mask_token_prob} + {random_token_prob}"
        )


def ineligible_tokens(sample: dict[str, np.ndarray], tokens: SpecialTokens) -> np.ndarray:
    """bool [n]: tokens that may never be chosen (special ids, [UNK], anything the builder flagged special)."""
    table = _special_table(tokens.special_ids)  # [max id + 2]: True at the special ids
    bad = table[np.minimum(sample["input_ids"], len(table) - 1)]  # one lookup: cheaper than a compare per id
    if "special_mask" in sample:
        bad |= sample["special_mask"]
    return bad


@functools.lru_cache(maxsize=8)
def _special_table(special_ids: tuple[int, ...]) -> np.ndarray:
    """bool [max(special_ids) + 2], True at each special id; ids past the end are clipped to its last (False)."""
    table = np.zeros(max(special_ids) + 2, bool)
    table[list(special_ids)] = True
    table.flags.writeable = False
    return table


def sample_word_starts(sample: dict[str, np.ndarray]) -> np.ndarray:
    """bool [n] word starts of a sample; word-level masking cannot guess them from ids for every tokenizer."""
    if "word_starts" not in sample:
        raise ValueError(
            "whole-word, n-gram and span masking need 'word_starts' in every sample; this sample "
            "builder does not provide it"
        )
    return sample["word_starts"]


def replace_tokens(
    input_ids: np.ndarray,
    positions: np.ndarray,
    u: np.ndarray,
    mask_token_prob: float,
    random_token_prob: float,
    tokens: SpecialTokens,
    rng: np.random.Generator,
) -> np.ndarray:
    """BERT's corruption of `positions` [M] given uniforms `u` [M]: u < p_mask -> [MASK], the next
    p_random -> a random real token, the rest unchanged. Callers choose u's granularity (per token or per
    span: equal u for every token of a span gives the span one fate). Returns a corrupted copy [n]."""
    corrupted = input_ids.copy()
    to_mask = positions[u < mask_token_prob]
    to_random = positions[(u >= mask_token_prob) & (u < mask_token_prob + random_token_prob)]
    corrupted[to_mask] = tokens.mask
    if len(to_random):  # rng.choice(pool, n) is pool[rng.integers(len(pool), size=n)] at 3x its overhead
        pool = tokens.replaceable
        corrupted[to_random] = pool[rng.integers(len(pool), size=len(to_random))]
    return corrupted


@dataclass
class WordSpans:
    """Chosen spans of whole words, sorted by position. Token ranges are [begin, end)."""

    begin: np.ndarray  # [S] int64 first token of each span
    end: np.ndarray  # [S] int64 one past its last token
    words: np.ndarray  # [S] int64 length in words (the drawn length; spans are never truncated)

    def positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(token positions [M] sorted, index of the span each belongs to [M])."""
        sizes = self.end - self.begin  # [S]
        span_of = np.repeat(np.arange(len(sizes)), sizes)  # [M]
        # position = begin of its span + offset inside it; offset = running index - tokens before the span
        first = np.cumsum(sizes) - sizes  # [S] index in the flat output where each span starts
        return self.begin[span_of] + np.arange(int(sizes.sum())) - first[span_of], span_of


@dataclass(frozen=True)
class SpanLengths:
    """A distribution of span lengths in words: pmf [K] over lengths 1..K."""

    pmf: np.ndarray

    @classmethod
    def ngram(cls, max_n: int) -> SpanLengths:
        """ALBERT n-grams: p(n) proportional to 1/n for n in 1..max_n (max_n = 1: single whole words)."""
        p = 1.0 / np.arange(1, max_n + 1)
        return cls(p / p.sum())

    @classmethod
    def geometric(cls, p: float, max_len: int) -> SpanLengths:
        """SpanBERT: Geometric(p) on 1..max_len, renormalised (as SpanBERT's code; mean 3.80 for p = 0.2,
        max_len = 10, the paper's 3.8). Clipping instead (tail mass on max_len) would give a mean of 4.46."""
        pmf = p * (1 - p) ** np.arange(max_len)  # [max_len] P(k) for k = 1..max_len, before renormalising
        return cls(pmf / pmf.sum())

    @property
    def mean(self) -> float:
        return float(np.dot(np.arange(1, len(self.pmf) + 1), self.pmf))

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """int64 [size] lengths, each in 1..K (inverse CDF: a fraction of rng.choice(p=...)'s overhead)."""
        cdf = np.cumsum(self.pmf)  # [K]
        return np.minimum(np.searchsorted(cdf, rng.random(size) * cdf[-1], side="right"), len(cdf) - 1) + 1


def _free_runs(free: np.ndarray) -> list[list[int]]:
    """[start, length] of each run of True in a bool array, in order (plain ints: the span loop walks them)."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], free.astype(np.int8), [0])))).tolist()  # run starts, ends
    return [[a, b - a] for a, b in zip(edges[::2], edges[1::2])]


def _fit(runs: list[list[int]], length: int, u: float) -> tuple[int, int] | None:
    """(run index, first word) of the int(u * F)-th of the F places, in word order, where `length` free words in a
    row fit; None where there is none. The same place as indexing the sorted array of every fitting first word."""
    places = [m - length + 1 for _, m in runs]  # [R] first words that fit in each run, where positive
    count = sum([p for p in places if p > 0])
    if count == 0:
        return None
    k = int(u * count)
    for r, here in enumerate(places):
        if 0 < here <= k:
            k -= here
        elif here > 0:
            return r, runs[r][0] + k
    raise AssertionError("unreachable: k < count")


def select_word_spans(
    word_starts: np.ndarray,
    ineligible: np.ndarray,
    rate: float,
    lengths: SpanLengths,
    rng: np.random.Generator,
    separate: bool = False,
) -> WordSpans:
    """Choose non-overlapping spans of whole candidate words until about round(rate * candidate tokens)
    tokens are chosen; at least one span, so a sample much shorter than a span / rate gets more than rate.

    word_starts, ineligible: bool [n]. lengths: the span-length distribution in words. separate: keep at
    least one unchosen word between spans (SpanBERT: a span's boundary tokens are then never hidden by a
    neighbouring span).
    """
    n = len(word_starts)
    ws = word_starts.copy()
    ws[0] = True  # the first token always opens a word (it is [CLS] in every builder)
    starts = np.flatnonzero(ws)  # [W] first token of each word
    ends = np.append(starts[1:], n)  # [W] one past its last token
    good = ~np.logical_or.reduceat(ineligible, starts)  # [W] words without a special token
    candidate_tokens = int((ends - starts)[good].sum())
    if candidate_tokens == 0:
        empty = np.zeros(0, np.int64)
        return WordSpans(empty, empty, empty)
    budget = max(1, int(round(rate * candidate_tokens)))
    if len(lengths.pmf) == 1 and not separate:
        return _single_words(starts, ends, good, budget, rng)
    go_p = _go_on_probabilities((ends - starts)[good], lengths, budget)
    first, lens = _place_spans(starts, ends, good, lengths, budget, go_p, rng, gap=int(separate))
    order = np.argsort(first)
    first, lens = first[order], lens[order]
    return WordSpans(starts[first], ends[first + lens - 1], lens)


def _single_words(
    starts: np.ndarray, ends: np.ndarray, good: np.ndarray, budget: int, rng: np.random.Generator
) -> WordSpans:
    """Single words: one vectorised pass over a shuffled word order. starts, ends, good: [W] per word."""
    sizes = ends - starts  # [W]
    order = rng.permutation(np.flatnonzero(good))  # [C] candidate words in random order
    taken_before = np.cumsum(sizes[order]) - sizes[order]  # [C] tokens chosen before each word
    # words that fit are kept; the one crossing the budget is kept with probability remaining / its size,
    # so the expected count is exactly the budget (no length statistic to protect for single words)
    keep_p = (budget - taken_before) / sizes[order]  # [C] >= 1: fits, (0, 1): crosses, <= 0: past it
    keep_p[0] = 1.0  # every sample gets at least one word, however short
    keep = rng.random(len(order)) < keep_p
    chosen = np.sort(order[keep])
    return WordSpans(starts[chosen], ends[chosen], np.ones(len(chosen), np.int64))


def _go_on_probabilities(candidate_sizes: np.ndarray, lengths: SpanLengths, budget: int) -> list[float]:
    """P(draw another span | r tokens left) for r = 0..budget. candidate_sizes: [C] tokens of each candidate word.

    Stopping rule, decided before the next length is drawn: with r tokens left, go on with probability
    r / (r + E[(T - r)+]), T = tokens of the next span. Then the expected final overshoot p * E[(T - r)+]
    equals the expected shortfall (1 - p) * r: the count is the budget in expectation, and no span is
    dropped or cut for being long. T's law: L ~ pmf, and the tokens of L consecutive candidate words of
    this sample (every window of L words, ignoring where runs break; enough for a stopping rule)."""
    csum = np.concatenate(([0], np.cumsum(candidate_sizes)))  # [C+1]
    ends, begins, weight = _windows(lengths.pmf.tobytes(), lengths.pmf.dtype.str, len(csum))  # [N] each
    p_t = np.bincount(csum[ends] - csum[begins], weight, minlength=budget + 2)  # [T+1] P(T = t)
    tail = np.cumsum(p_t[::-1])[::-1]  # [T+1] P(T >= t)
    # E[(T - r)+] = sum over t > r of P(T >= t), for r = 0..budget: [budget+1]
    overshoot = np.append(np.cumsum(tail[::-1])[::-1], 0.0)[1 : budget + 2]
    remaining = np.arange(budget + 1)  # [budget+1] every r the loop can meet
    return (remaining / np.maximum(remaining + overshoot, 1e-9)).tolist()


@functools.lru_cache(maxsize=256)
def _windows(pmf_bytes: bytes, dtype: str, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every window of k = 1..K consecutive words that ends inside a sample of n - 1 candidate words, by k then
    start: (end [N], start [N] into the [n] running token counts, P(L = k, this window) [N]). A function of the
    word count alone, so cached: rebuilding it was a third of a sample's span selection."""
    pmf = np.frombuffer(pmf_bytes, dtype)  # [K]
    end = np.arange(n)[None, :] + np.arange(1, len(pmf) + 1)[:, None]  # [K, n] window of k words from i
    valid = end < n  # [K, n] windows that end inside the sample
    weight = pmf[:, None] * valid / np.maximum(valid.sum(1, keepdims=True), 1)  # [K, n] P(L=k, window)
    out = end[valid], np.broadcast_to(np.arange(n), end.shape)[valid], weight[valid]
    for a in out:
        a.flags.writeable = False
    return out


def _place_spans(
    starts: np.ndarray,
    ends: np.ndarray,
    good: np.ndarray,
    lengths: SpanLengths,
    budget: int,
    go_p: list[float],
    rng: np.random.Generator,
    gap: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(first word [S], length in words [S]) of the spans placed, in drawing order. A loop over spans (a handful
    per sample), each step vectorised over words. Each span has >= 1 token and the loop goes on only while under
    budget, so `budget` draws always suffice. gap: words blocked on each side of a placed span."""
    drawn = lengths.draw(rng, budget).tolist()  # [budget]
    u_go, u_place = rng.random((2, budget)).tolist()  # [budget] each
    # The free words as runs [start, length]: a few per sample, so walking them in Python costs less than a
    # cumsum over every word per span.
    runs = _free_runs(good)
    first_words, lens = [], []
    taken = 0
    for i in range(budget):
        if i > 0 and (taken >= budget or u_go[i] >= go_p[budget - taken]):  # the first span is always drawn
            break
        L = drawn[i]
        place = _fit(runs, L, u_place[i])
        if place is None and i == 0:  # the first span must be placed: its length among those that fit
            longest = max((m for _, m in runs), default=0)
            L = int(SpanLengths(lengths.pmf[:longest]).draw(rng, 1)[0])
            place = _fit(runs, L, u_place[i])
        if place is None:  # no room for this length: stop rather than redraw (redrawing favours short spans)
            break
        r, s = place
        a, m = runs[r]
        # block the span and `gap` words each side; words next to the run are not free already
        left, right = [a, max(s - gap, a) - a], [min(s + L + gap, a + m), a + m - min(s + L + gap, a + m)]
        runs[r : r + 1] = [run for run in (left, right) if run[1] > 0]
        first_words.append(s)
        lens.append(L)
        taken += int(ends[s + L - 1] - starts[s])
    return np.asarray(first_words, np.int64), np.asarray(lens, np.int64)
