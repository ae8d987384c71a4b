"""Word-level masking shared by whole-word / n-gram MLM and SpanBERT.

Words come only from the pipeline's `word_starts` (True where a token begins a word; [CLS]/[SEP] count as
starts), so this works for any tokenizer: WordPiece `##`, byte-level BPE `Ġ` and Unigram `▁` are all turned
into `word_starts` upstream. A word is a candidate when none of its tokens is special.

Span selection draws a span length (in words), then places it uniformly among the positions where it fits;
it never truncates or shrinks a span. Whether to draw another span is decided *before* its length is known,
so the lengths of the spans placed follow the sampler's distribution (Wald's identity: the pooled mean over
many samples is the sampler's mean), while the expected number of masked tokens is close to the budget.
The first span is always placed, so a sample is never left without targets: where its drawn length fits nowhere (a
short sample), its length is drawn again among the lengths that fit, from the same distribution cut there.
"""

from __future__ import annotations

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
    ids = sample["input_ids"]
    bad = np.zeros(len(ids), bool)
    for special in tokens.special_ids:  # five compares over [n]: several times cheaper than np.isin at n ~ 512
        bad |= ids == special
    if "special_mask" in sample:
        bad |= sample["special_mask"]
    return bad


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
    corrupted[to_random] = rng.choice(tokens.replaceable, size=len(to_random))
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


def _longest_run(free: np.ndarray) -> int:
    """Length of the longest run of True in a bool array (>= 1 where any is True)."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], free.astype(np.int8), [0]))))  # starts and ends of runs
    return int((edges[1::2] - edges[::2]).max()) if len(edges) else 0


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
    K = len(lengths.pmf)
    csum = np.concatenate(([0], np.cumsum(candidate_sizes)))  # [C+1]
    end = np.arange(len(csum))[None, :] + np.arange(1, K + 1)[:, None]  # [K, C+1] window of k words from i
    valid = end < len(csum)  # [K, C+1] windows that end inside the sample
    win = csum[np.minimum(end, len(csum) - 1)] - csum[None, :]  # [K, C+1] tokens per window
    weight = lengths.pmf[:, None] * valid / np.maximum(valid.sum(1, keepdims=True), 1)  # [K, C+1] P(L=k, window)
    p_t = np.bincount(win[valid], weight[valid], minlength=budget + 2)  # [T+1] P(T = t)
    tail = np.cumsum(p_t[::-1])[::-1]  # [T+1] P(T >= t)
    # E[(T - r)+] = sum over t > r of P(T >= t), for r = 0..budget: [budget+1]
    overshoot = np.append(np.cumsum(tail[::-1])[::-1], 0.0)[1 : budget + 2]
    remaining = np.arange(budget + 1)  # [budget+1] every r the loop can meet
    return (remaining / np.maximum(remaining + overshoot, 1e-9)).tolist()


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
    free = good.copy()  # [W] words a new span may still cover
    run = np.zeros(len(free) + 1, np.int64)  # [W+1] free words before each index
    first_words, lens = [], []
    taken = 0
    for i in range(budget):
        if i > 0 and (taken >= budget or u_go[i] >= go_p[budget - taken]):  # the first span is always drawn
            break
        L = drawn[i]
        np.cumsum(free, out=run[1:])
        fits = np.flatnonzero(run[L:] - run[:-L] == L)  # [F] first words of L free words in a row
        if len(fits) == 0 and i == 0:  # the first span must be placed: its length among those that fit
            longest = _longest_run(free)
            L = int(SpanLengths(lengths.pmf[:longest]).draw(rng, 1)[0])
            fits = np.flatnonzero(run[L:] - run[:-L] == L)
        if len(fits) == 0:  # no room for this length: stop rather than redraw (redrawing favours short spans)
            break
        s = int(fits[int(u_place[i] * len(fits))])
        free[max(s - gap, 0) : s + L + gap] = False
        first_words.append(s)
        lens.append(L)
        taken += int(ends[s + L - 1] - starts[s])
    return np.asarray(first_words, np.int64), np.asarray(lens, np.int64)
