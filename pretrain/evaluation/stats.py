"""Paired comparisons of ablation arms on the same dev examples, with the variance that matters.

An arm's score on a task is the mean, over its pretraining seeds and the downstream seeds within each, of the task's
metric on the dev set. Two things make a gap between arms uncertain: which pretraining runs happened (each arm is
pretrained once per seed) and which dev examples happened (a 1,000-example dev set alone carries about 0.015 of
noise on an accuracy). `paired_bootstrap` resamples both: each replicate draws dev examples with replacement (the
same draw for both arms: the comparison is paired) and each arm's pretraining seeds with replacement, and recomputes
both scores and their difference. The 2.5-97.5 percentiles of the differences give a 95% interval; the two-sided
p-value is twice the share of replicates on the far side of zero, counted as (k + 1) / (R + 1) so that R replicates
never claim p below 1 / R. With several comparisons in one report, `holm`
adjusts the p-values so that "significant" keeps its 5% meaning across all of them.

Predictions are arrays [seeds, downstream seeds, examples]: class indices, or scores for regression.
"""

from __future__ import annotations

import numpy as np

METRICS = ("accuracy", "mcc", "pearson")


def metric_batch(name: str, labels: np.ndarray, preds: np.ndarray) -> np.ndarray:
    """The metric of each row: labels [..., N], preds [..., N] -> [...]."""
    if name == "accuracy":
        return (preds == labels).mean(-1)
    if name == "mcc":  # binary, 0 where a row or column of the confusion matrix is empty (as sklearn)
        tp = ((preds == 1) & (labels == 1)).sum(-1).astype(float)
        tn = ((preds == 0) & (labels == 0)).sum(-1).astype(float)
        fp = ((preds == 1) & (labels == 0)).sum(-1).astype(float)
        fn = ((preds == 0) & (labels == 1)).sum(-1).astype(float)
        denom = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
        return np.divide(tp * tn - fp * fn, denom, out=np.zeros_like(denom), where=denom > 0)
    if name == "pearson":
        x = preds - preds.mean(-1, keepdims=True)
        y = labels - labels.mean(-1, keepdims=True)
        denom = np.sqrt((x * x).sum(-1) * (y * y).sum(-1))
        return np.divide((x * y).sum(-1), denom, out=np.zeros_like(denom), where=denom > 0)
    raise ValueError(f"no paired test for metric '{name}'; known: {', '.join(METRICS)}")


def score(metric: str, labels: np.ndarray, preds: np.ndarray) -> float:
    """An arm's score: the metric averaged over pretraining and downstream seeds. preds [S, P, N]."""
    return float(metric_batch(metric, labels, preds).mean())


def paired_bootstrap(
    metric: str, labels: np.ndarray, preds_a: np.ndarray, preds_b: np.ndarray, replicates: int = 2000, seed: int = 0
) -> dict:
    """Score of a minus score of b with a 95% interval and a two-sided p-value; see the module doc.
    labels [N]; preds_a [Sa, P, N], preds_b [Sb, P', N]."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    n = len(labels)
    observed = score(metric, labels, preds_a) - score(metric, labels, preds_b)
    diffs = np.empty(replicates)
    chunk = max(1, 2_000_000 // max(1, n * (preds_a.shape[0] * preds_a.shape[1] + preds_b.shape[0] * preds_b.shape[1])))
    for lo in range(0, replicates, chunk):
        r = min(chunk, replicates - lo)
        rows = rng.integers(0, n, size=(r, n))  # [R, N] the same examples for both arms
        seeds_a = rng.integers(0, preds_a.shape[0], size=(r, preds_a.shape[0]))  # [R, Sa]
        seeds_b = rng.integers(0, preds_b.shape[0], size=(r, preds_b.shape[0]))
        y = labels[rows]  # [R, N]
        a, b = _pick(preds_a, seeds_a, rows), _pick(preds_b, seeds_b, rows)  # [R, S, P, N] each
        diffs[lo : lo + r] = metric_batch(metric, y[:, None, None], a).mean((1, 2)) - metric_batch(
            metric, y[:, None, None], b
        ).mean((1, 2))
    low, high = np.percentile(diffs, [2.5, 97.5])
    if np.all(diffs == 0):  # the two arms predict alike on every example they share
        return {"diff": observed, "low": 0.0, "high": 0.0, "p": 1.0, "replicates": replicates}
    beyond = min((diffs <= 0).sum(), (diffs >= 0).sum())  # replicates on the far side of zero
    return {
        "diff": observed,
        "low": float(low),
        "high": float(high),
        "p": float(min(1.0, 2 * (beyond + 1) / (replicates + 1))),
        "replicates": replicates,
    }


def _pick(preds: np.ndarray, seeds: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """preds [S, P, N] at resampled seeds [R, S'] and examples [R, N] -> [R, S', P, N]."""
    picked = preds[seeds]  # [R, S', P, N]
    return np.take_along_axis(picked, rows[:, None, None, :], axis=-1)


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the given order: reject where adjusted p < alpha, and the family-wise
    error rate stays below alpha over all the comparisons."""
    order = np.argsort(p_values)
    m = len(p_values)
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted.tolist()
