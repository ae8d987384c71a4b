"""Metric measures summed on the device: the binned AUC agrees with the exact rank AUC, also in the narrow-logit
phase where ELECTRA's discriminator sits at its base rate, and sums over micro-batches exactly."""

import numpy as np
import pytest
import torch

from pretrain.core.measures import BinaryAUC, Mean
from pretrain.train.metrics import MetricSums


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney: P(score of a positive > score of a negative), ties counting half (average ranks)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    start = 0
    while start < len(scores):  # average ranks over runs of equal scores
        end = start
        while end + 1 < len(scores) and sorted_scores[end + 1] == sorted_scores[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    p = labels.sum()
    n = len(labels) - p
    return float((ranks[labels == 1].sum() - p * (p + 1) / 2) / (p * n))


@pytest.mark.parametrize(
    "spread, signal",
    [
        (0.01, 0.002),  # the base-rate phase: logits within ~0.03 of log(0.15 / 0.85)
        (0.05, 0.01),
        (1.0, 0.5),  # a discriminator that has learned something
        (4.0, 6.0),  # far apart, some logits beyond the histogram's ends
    ],
)
def test_binned_auc_matches_the_exact_auc(spread, signal):
    rng = np.random.default_rng(0)
    labels = (rng.random(50_000) < 0.15).astype(np.float64)
    logits = np.log(0.15 / 0.85) + rng.normal(0, spread, labels.shape) + signal * labels
    exact = exact_auc(logits, labels)
    assert 0.52 < exact  # there is something to measure
    binned = BinaryAUC(torch.tensor(logits), torch.tensor(labels), torch.ones(len(labels))).value()
    assert binned == pytest.approx(exact, abs=2e-4)


def test_padding_is_left_out_and_micro_batches_sum_exactly():
    rng = np.random.default_rng(1)
    logits = torch.tensor(rng.normal(-1.7, 0.3, (6, 40)))
    labels = torch.tensor(rng.random((6, 40)) < 0.15).float()
    labels[:, 0] = 1  # both classes in each micro-batch
    labels[:, 1] = 0
    real = torch.ones(6, 40)
    real[:, 30:] = 0  # padding: its logits and labels must not count
    logits[:, 30:] = 50.0
    whole = BinaryAUC(logits, labels, real).value()
    keep = real.bool().numpy()
    assert whole == pytest.approx(exact_auc(logits.numpy()[keep], labels.numpy()[keep]), abs=2e-3)

    sums = MetricSums()
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):  # uneven micro-batches
        sums.add({"auc": BinaryAUC(logits[rows], labels[rows], real[rows]), "acc": Mean(labels[rows].sum(), 40.0)})
    values = sums.read()
    assert values["auc"] == pytest.approx(whole, abs=1e-12)
    assert values["acc"] == pytest.approx(float(labels.sum()) / 120.0)


def test_one_class_has_no_auc():
    assert BinaryAUC(torch.zeros(5), torch.zeros(5), torch.ones(5)).value() is None


def test_sums_keep_no_view_of_what_they_were_given():
    """A compiled loss under CUDA graphs (compile_mode=reduce-overhead) returns tensors that its next replay
    overwrites in place: the interval's sums must not be a view of the first micro-batch's."""
    sums = MetricSums()
    loss, auc_logits = torch.tensor(2.0), torch.tensor([3.0, -3.0])
    sums.add({"loss": loss, "mean": Mean(loss, 1.0), "auc": BinaryAUC(auc_logits, torch.tensor([1, 0]), torch.ones(2))})
    loss.fill_(100.0)  # the replay of the next micro-batch, writing into the same memory
    auc_logits.fill_(0.0)
    sums.add({"loss": torch.tensor(4.0), "mean": Mean(torch.tensor(4.0), 1.0)})
    values = sums.read()
    assert values["loss"] == 3.0 and values["mean"] == 3.0 and values["auc"] == 1.0  # (2 + 4) / 2


def test_an_interval_averages_its_steps_however_each_was_split():
    """The loss is a mean per micro-batch: an interval's value is the mean of its steps' losses, each step the mean
    of its micro-batches over all ranks. Counted per micro-batch, a step split in two (2 ranks, or accumulation)
    weighed twice a step in one: a run stopped inside a log interval on 2 ranks and resumed on 1 logged 6.932014
    where the run never stopped logged 6.930896 (mlm + nsp, steps 3-4)."""
    step_3 = (torch.tensor(6.0), torch.tensor(7.0))  # two micro-batches: the step's loss is 6.5
    step_4 = torch.tensor(8.0)  # one micro-batch
    expected = (6.5 + 8.0) / 2

    sums = MetricSums()
    for part in step_3:
        sums.add({"loss": Mean.micro_batch(part), "plain": part, "acc": Mean(part, 2.0)}, parts=2)
    sums.add({"loss": Mean.micro_batch(step_4), "plain": step_4, "acc": Mean(step_4, 2.0)}, parts=1)
    values = sums.read()
    assert values["loss"] == values["plain"] == pytest.approx(expected)
    assert values["acc"] == pytest.approx((6.0 + 7.0 + 8.0) / 6.0)  # a sum over counted targets: as it was

    # across a checkpoint cut inside the interval, resumed with another split
    sums = MetricSums()
    for part in step_3:
        sums.add({"loss": Mean.micro_batch(part)}, parts=2)
    saved = sums.snapshot()
    resumed = MetricSums()
    resumed.restore(saved, "cpu")
    resumed.add({"loss": Mean.micro_batch(step_4)}, parts=1)
    assert resumed.read()["loss"] == pytest.approx(expected)
