"""Loss normalization over an optimizer step: a batch split into micro-batches (accumulation or ranks) has the
gradient of the whole batch, because every loss term is a mean over all its targets in the step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from objectives import LOSS_SCALES, build_objectives
from pretrain.model import PretrainingModel
from pretrain.trainer import step_loss_scales
from test_model_variants import BASE, TOKENS, make_batch

pytestmark = pytest.mark.usefixtures("one_thread")

# Rows of very different lengths: the two halves hold very different numbers of targets.
LENGTHS = (40, 36, 9, 7)


def halves(batch: dict) -> list[dict]:
    return [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]


def gradients(model, batches: list[dict], scales: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Accumulate as DeepSpeed does (each micro-batch's loss / number of micro-batches); (loss, grads)."""
    model.zero_grad()
    total = 0.0
    for batch, scale in zip(batches, scales):
        loss, _ = model({**batch, LOSS_SCALES: scale})
        (loss / len(batches)).backward()
        total += loss.item() / len(batches)
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("objectives", [("mlm",), ("span",), ("plm",)])
def test_split_batch_has_the_loss_and_gradient_of_the_whole(objectives):
    objectives = build_objectives({o: {} for o in objectives}, TOKENS)
    torch.manual_seed(0)
    model = PretrainingModel(replace(BASE, hidden_dropout=0.0, attention_dropout=0.0), objectives).eval()
    batch = make_batch(lengths=LENGTHS, objectives=objectives)
    parts = halves(batch)
    counts = [sum(int(n) for o in objectives for n in o.target_counts(p).values()) for p in parts]
    assert counts[0] >= 2 * counts[1], counts  # otherwise the test could not tell the normalizations apart

    whole_loss, whole = gradients(model, [batch], [{}])
    scales = step_loss_scales(objectives, parts)
    split_loss, split = gradients(model, parts, scales)
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)

    # Means per micro-batch (train.loss_normalization=micro_batch) weigh the few targets of the short rows up
    _, naive = gradients(model, parts, [{}, {}])
    assert not all(torch.allclose(naive[n], whole[n], rtol=1e-2, atol=1e-5) for n in whole)


def test_scales_sum_to_the_number_of_micro_batches():
    objectives = build_objectives({"rtd": {}}, TOKENS)
    batch = make_batch(lengths=LENGTHS, objectives=objectives)
    parts = halves(batch)
    counts = [o.target_counts(p) for o in objectives for p in parts]
    # ELECTRA: the generator predicts the masked tokens, the discriminator scores every real token
    assert [int(c["rtd_disc"]) for c in counts] == [76, 16]
    assert [int(c["rtd_gen"]) for c in counts] == [int((p["rtd_mlm_labels"] != -100).sum()) for p in parts]
    scales = step_loss_scales(objectives, parts)
    assert scales[0]["rtd_disc"] == pytest.approx(2 * 76 / 92) and scales[1]["rtd_disc"] == pytest.approx(2 * 16 / 92)
    for term in ("rtd_gen", "rtd_disc"):
        assert sum(s[term] for s in scales) == pytest.approx(2.0)
