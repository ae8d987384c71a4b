"""Paired comparisons of ablation arms on the same dev examples, with the variance that matters.

An arm's score on a task is the mean, over its pretraining seeds and the downstream seeds within each, of the task's
metric on the dev set. Two things make a gap between arms uncertain: which pretraining runs happened (each arm is
pretrained once per seed) and which dev examples happened (a 1,000-example dev set alone carries about 0.015 of
noise on an accuracy).

- `paired_bootstrap` resamples both: each replicate draws dev examples with replacement and pretraining seeds with
  replacement, each the same draw for both arms (the comparison is paired by example and by seed: arms of one seed
  share its data order), and recomputes both scores and their difference. A pair's seeds are drawn from its own
  two arms' seeds, so its interval does not depend on which other arms were compared. The 2.5-97.5 percentiles give
  a 95% interval; the two-sided p-value is twice the share of replicates on the far side of zero, counted as
  (k + 1) / (R + 1), so no p is below 2 / (R + 1).
- That floor matters after a correction for many comparisons: Holm multiplies the smallest p by the family's size m,
  so R must grow with m. `replicates_for(m)` gives R >= 20 m / alpha, which keeps the smallest adjusted p at
  alpha / 10 (with a fixed 2,000, nothing could be significant in a family of 51 or more).
- With few pretraining seeds the bootstrap understates the seed variance (n seeds give C(2n - 1, n) distinct seed
  draws: 3 for two seeds). `sign_flip_test` tests at the seed level instead: arms paired by pretraining seed, the
  per-seed differences of task scores, and every assignment of signs to them (exact up to 2^16, else Monte Carlo).
  It cannot reach below 2 / 2^n, and Holm multiplies that by the family's size m: `seeds_needed(m)` is the fewest
  seeds with which anything can hold across seeds (6 for one comparison, 9 for a family of 12).
- `holm` adjusts a family's p-values so that "significant" keeps its 5% meaning across the family;
  `minimum_detectable_effect` says what gap a comparison could find at all.

Predictions are arrays [seeds, downstream seeds, examples]: class indices, or scores for regression.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

METRICS = ("accuracy", "mcc", "pearson", "chunk_f1")
ALPHA = 0.05
POWER = 0.8
MIN_REPLICATES = 2000
EXACT_SIGN_FLIPS = 16  # up to 2^16 sign assignments enumerated; beyond, Monte Carlo
SIGN_FLIP_DRAWS = 200_000


def chunk_f1_from_sums(correct, predicted, gold):
    """Chunk F1 (CoNLL) from summed counts (numpy arrays or numbers): 2 c / (predicted + gold), 0 where both are 0."""
    correct, total = np.asarray(correct, float), np.asarray(predicted, float) + np.asarray(gold, float)
    return np.divide(2 * correct, total, out=np.zeros_like(total), where=total > 0)


def metric_batch(name: str, labels: np.ndarray, preds: np.ndarray) -> np.ndarray:
    """The metric of each row: labels [..., N], preds [..., N] -> [...]. chunk_f1 is over sentences: labels [N] hold
    each sentence's gold chunks, preds [..., N, 2] its correct and predicted chunks."""
    if name == "chunk_f1":
        return chunk_f1_from_sums(preds[..., 0].sum(-1), preds[..., 1].sum(-1), np.asarray(labels).sum(-1))
    if name == "accuracy":
        return (preds == labels).mean(-1)
    if name == "mcc":  # binary, 0 where a row or column of the confusion matrix is empty (as sklearn)
        tp = ((preds == 1) & (labels == 1)).sum(-1).astype(float)
        tn = ((preds == 0) & (labels == 0)).sum(-1).astype(float)
        fp = ((preds == 1) & (labels == 0)).sum(-1).astype(float)
        fn = ((preds == 0) & (labels == 1)).sum(-1).astype(float)
        return _mcc(tp, tn, fp, fn)
    if name == "pearson":
        x = preds - preds.mean(-1, keepdims=True)
        y = labels - labels.mean(-1, keepdims=True)
        denom = np.sqrt((x * x).sum(-1) * (y * y).sum(-1))
        return np.divide((x * y).sum(-1), denom, out=np.zeros_like(denom), where=denom > 0)
    raise ValueError(f"no paired test for metric '{name}'; known: {', '.join(METRICS)}")


def _mcc(tp, tn, fp, fn) -> np.ndarray:
    denom = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return np.divide(tp * tn - fp * fn, denom, out=np.zeros_like(denom), where=denom > 0)


def score(metric: str, labels: np.ndarray, preds: np.ndarray) -> float:
    """An arm's score: the metric averaged over pretraining and downstream seeds. preds [S, P, N]."""
    return float(metric_batch(metric, labels, preds).mean())


def replicates_for(m: int, alpha: float = ALPHA, minimum: int = MIN_REPLICATES) -> int:
    """Bootstrap replicates for a family of m comparisons: at least 20 m / alpha, so that the smallest p the bootstrap
    can give, times m (what Holm does to it), is alpha / 10."""
    return max(minimum, math.ceil(20 * max(1, m) / alpha))


def p_floor(replicates: int) -> float:
    """The smallest two-sided p of `paired_bootstrap` with this many replicates."""
    return 2 / (replicates + 1)


def _features(metric: str, labels: np.ndarray, preds: np.ndarray) -> np.ndarray:
    """Per-example terms [N, S, P, K] whose weighted sums over examples give the metric (`_from_sums`): resampling
    examples is then one matrix product of example counts with them, and needs no copy of the predictions."""
    if metric == "chunk_f1":  # preds [S, P, N, 2] -> correct, predicted, gold per sentence: [N, S, P, 3]
        counts = np.moveaxis(np.asarray(preds, float), -2, 0)
        gold = np.asarray(labels, float).reshape((-1,) + (1,) * (counts.ndim - 1))
        gold = np.broadcast_to(gold, counts[..., :1].shape)
        return np.concatenate([counts, gold], -1)
    preds = np.moveaxis(np.asarray(preds), -1, 0)  # [N, S, P]
    y = np.asarray(labels).reshape((-1,) + (1,) * (preds.ndim - 1))
    if metric == "accuracy":
        return (preds == y)[..., None].astype(float)
    if metric == "mcc":
        p1, y1 = preds == 1, y == 1
        p0, y0 = preds == 0, y == 0
        return np.stack([p1 & y1, p0 & y0, p1 & y0, p0 & y1], -1).astype(float)  # tp, tn, fp, fn
    if metric == "pearson":  # centred on the full dev set: the correlation is shift-invariant, the sums stay small
        x = preds.astype(float) - preds.mean(0, keepdims=True)
        v = np.broadcast_to(y.astype(float) - y.mean(), x.shape)
        return np.stack([x, v, x * x, v * v, x * v], -1)
    raise ValueError(f"no paired test for metric '{metric}'; known: {', '.join(METRICS)}")


def _from_sums(metric: str, sums: np.ndarray, n: int) -> np.ndarray:
    """The metric from the summed `_features` [..., K] of n (resampled) examples -> [...]."""
    if metric == "accuracy":
        return sums[..., 0] / n
    if metric == "chunk_f1":
        return chunk_f1_from_sums(sums[..., 0], sums[..., 1], sums[..., 2])
    if metric == "mcc":
        return _mcc(*(sums[..., k] for k in range(4)))
    sx, sy, sxx, syy, sxy = (sums[..., k] for k in range(5))
    cov, vx, vy = sxy - sx * sy / n, sxx - sx * sx / n, syy - sy * sy / n
    denom = np.sqrt(np.clip(vx, 0, None) * np.clip(vy, 0, None))
    return np.divide(cov, denom, out=np.zeros_like(denom), where=denom > 1e-12 * n)


def bootstrap_seed_scores(
    metric: str, labels: np.ndarray, preds: dict[str, np.ndarray], replicates: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Each arm's score per pretraining seed in each of `replicates` bootstrap replicates: {arm: [R, S]}. A replicate
    draws dev examples with replacement once for all the arms (every difference is paired by example; the draws
    depend on the seed and the dev set alone). labels [N]; preds {arm: [S, P, N]}."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    n = len(labels)
    features = {arm: _features(metric, labels, p) for arm, p in preds.items()}  # [N, S, P, K]
    out = {arm: np.empty((replicates, f.shape[1])) for arm, f in features.items()}
    chunk = max(1, 4_000_000 // n)  # [chunk, N] example counts per pass
    for lo in range(0, replicates, chunk):
        r = min(chunk, replicates - lo)
        rows = rng.integers(0, n, size=(r, n))
        counts = np.bincount((rows + n * np.arange(r)[:, None]).ravel(), minlength=r * n).reshape(r, n)
        counts = counts.astype(float)  # [R, N]: how often each example was drawn
        for arm, f in features.items():
            sums = (counts @ f.reshape(n, -1)).reshape((r,) + f.shape[1:])  # [R, S, P, K]
            out[arm][lo : lo + r] = _from_sums(metric, sums, n).mean(-1)  # [R, S]: each pretraining seed's score
    return out


def pair_seed_picks(ids_a: list[int], ids_b: list[int], r: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[r, U] indices into a's and into b's seeds: U seeds drawn with replacement from the union of this pair's seed
    ids, the same draw for both arms (paired by seed: arms of one seed share its data order, so what a seed does to
    both cancels in their difference); an arm without a drawn seed (its run failed) takes one of its own, drawn alone.
    The draws come from a generator of this pair's own, from `seed` and the pair's seed ids: a pair's interval is the
    same whatever other arms its task has (drawn from the union over all of them, two arms that both lack a seed a
    third has lost their pairing on it)."""
    union = sorted(set(ids_a) | set(ids_b))
    key = zlib.crc32(repr((list(ids_a), list(ids_b))).encode())
    rng = np.random.default_rng([seed, key])
    drawn = rng.integers(0, len(union), size=(r, len(union)))  # [r, U] positions in the union
    picks = []
    for ids in (list(ids_a), list(ids_b)):
        where = np.array([ids.index(i) if i in ids else -1 for i in union])  # union position -> the arm's index
        pick = where[drawn]
        lacking = pick < 0
        pick[lacking] = rng.integers(0, len(ids), size=int(lacking.sum()))
        picks.append(pick)
    return picks[0], picks[1]


def summarize(observed: float, diffs: np.ndarray) -> dict:
    """Interval, p and standard error of a difference from its bootstrap replicates; see the module doc."""
    replicates = len(diffs)
    if np.all(np.abs(diffs) < 1e-12):  # the two arms predict alike on every example they share
        return {"diff": observed, "low": 0.0, "high": 0.0, "p": 1.0, "se": 0.0, "replicates": replicates}
    low, high = np.percentile(diffs, [2.5, 97.5])
    tol = 1e-12  # sums of float features are exact to far better than this; a tie with zero counts as beyond it
    beyond = min((diffs <= tol).sum(), (diffs >= -tol).sum())  # replicates on the far side of zero
    return {
        "diff": observed,
        "low": float(low),
        "high": float(high),
        "p": float(min(1.0, 2 * (beyond + 1) / (replicates + 1))),
        "se": float(diffs.std(ddof=1)) if replicates > 1 else 0.0,
        "replicates": replicates,
    }


def paired_bootstrap(
    metric: str, labels: np.ndarray, preds_a: np.ndarray, preds_b: np.ndarray, replicates: int = 2000, seed: int = 0
) -> dict:
    """Score of a minus score of b with a 95% interval, a two-sided p-value and the standard error (the replicates'
    standard deviation); see the module doc. labels [N]; preds_a [Sa, P, N], preds_b [Sb, P', N]."""
    return compare(metric, labels, {"a": preds_a, "b": preds_b}, [("a", "b")], replicates, seed)[("a", "b")]


def compare(
    metric: str,
    labels: np.ndarray,
    preds: dict[str, np.ndarray],
    pairs: list[tuple[str, str]],
    replicates: int,
    seed: int = 0,
    seeds: dict[str, list[int]] | None = None,
) -> dict[tuple[str, str], dict]:
    """`paired_bootstrap` of every pair (a, b) of arms on one dev set, from one set of example draws
    (`bootstrap_seed_scores`: drawing examples is most of the cost, and is shared) and each pair's own seed draws
    (`pair_seed_picks`). `seeds`: each arm's pretraining seed ids, in preds' order (default: the positions 0..S-1,
    the same seed at the same position)."""
    labels = np.asarray(labels)
    used = {arm: np.asarray(preds[arm]) for pair in pairs for arm in pair}
    scores = bootstrap_seed_scores(metric, labels, used, replicates, seed)
    ids = {arm: list(seeds[arm]) if seeds else list(range(p.shape[0])) for arm, p in used.items()}
    observed = {arm: score(metric, labels, p) for arm, p in used.items()}
    out = {}
    for a, b in pairs:
        pick_a, pick_b = pair_seed_picks(ids[a], ids[b], replicates, seed)
        diffs = np.take_along_axis(scores[a], pick_a, 1).mean(1) - np.take_along_axis(scores[b], pick_b, 1).mean(1)
        out[(a, b)] = summarize(observed[a] - observed[b], diffs)
    return out


def sign_flip_test(diffs, draws: int = SIGN_FLIP_DRAWS, seed: int = 0) -> float:
    """Two-sided p of an exact paired permutation test: under "no difference between the arms", each per-seed
    difference is as likely to have either sign, so p is the share of the 2^n sign assignments whose mean is at
    least as far from zero as the observed one (n all-positive differences: 2 / 2^n). Monte Carlo, counted as
    (k + 1) / (draws + 1), beyond 2^16 assignments."""
    d = np.asarray(diffs, dtype=float)
    n = len(d)
    if n == 0:
        return 1.0
    observed = abs(d.sum())
    tol = 1e-9 * max(1.0, float(np.abs(d).sum()))  # assignments that tie with the observed sum count as reaching it
    if n <= EXACT_SIGN_FLIPS:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)  # [2^n, n] every assignment once
        return float((np.abs(signs @ d) >= observed - tol).mean())
    rng = np.random.default_rng(seed)
    hits, chunk = 0, max(1, 4_000_000 // n)
    for lo in range(0, draws, chunk):
        signs = rng.choice(np.array([-1.0, 1.0]), size=(min(chunk, draws - lo), n))
        hits += int((np.abs(signs @ d) >= observed - tol).sum())
    return (hits + 1) / (draws + 1)


def sign_flip_floor(n: int) -> float:
    """The smallest two-sided p `sign_flip_test` can give with n per-seed differences."""
    return 1.0 if n == 0 else max(2 / 2**n, 1 / (SIGN_FLIP_DRAWS + 1)) if n > EXACT_SIGN_FLIPS else 2 / 2**n


def seeds_needed(m: int, alpha: float = ALPHA, most: int = 64) -> int | None:
    """The fewest pretraining seeds with which a sign-flip test can hold in a Holm family of m: the smallest n with
    m x sign_flip_floor(n) < alpha (one comparison: 6; 12: 9). None where no n up to `most` reaches it (the Monte
    Carlo floor beyond 2^16 assignments bounds it)."""
    return next((n for n in range(1, most + 1) if max(1, m) * sign_flip_floor(n) < alpha), None)


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the given order: reject where adjusted p < alpha, and the family-wise
    error rate stays below alpha over all the comparisons."""
    order = np.argsort(p_values, kind="stable")
    m = len(p_values)
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted.tolist()


def norm_ppf(q: float) -> float:
    """The standard normal quantile, by bisection on erfc (no scipy): accurate to ~1e-12 for 1e-300 < q < 1."""
    if not 0 < q < 1:
        raise ValueError(f"quantile of {q}: expected 0 < q < 1")
    if q > 0.5:
        return -norm_ppf(1 - q)
    lo, hi = -40.0, 0.0  # the lower tail: Phi(x) = erfc(-x / sqrt 2) / 2 keeps its precision there
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-13:
            break
    return (lo + hi) / 2


def minimum_detectable_effect(se: float, m: int = 1, alpha: float = ALPHA, power: float = POWER) -> float:
    """The gap a two-sided test finds with probability `power` at level alpha / m (Bonferroni: what the smallest p of a
    Holm family of m must beat), for an estimate with standard error se:

        MDE = (z_{1 - alpha / (2 m)} + z_{power}) x se

    se is the standard deviation of the bootstrap differences (for accuracy about sd(a_i - b_i) / sqrt(n) over n
    dev examples), so the MDE shrinks as 1 / sqrt(n)."""
    return (norm_ppf(1 - alpha / (2 * max(1, m))) + norm_ppf(power)) * se
