"""Loss normalization over an optimizer step: a batch split into micro-batches (accumulation or ranks) has the
gradient of the whole batch, because every loss term is a mean over all its targets in the step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import BASE, TOKENS, make_batch

from objectives import build_objectives
from pretrain.model.pretraining import PretrainingModel
from pretrain.train.trainer import step_loss_weights

pytestmark = pytest.mark.usefixtures("one_thread")

# Rows of very different lengths: the two halves hold very different numbers of targets.
LENGTHS = (40, 36, 9, 7)


def gradients(model, batches: list, weights: dict | None) -> tuple[float, dict[str, torch.Tensor]]:
    """Accumulate as DeepSpeed does (each micro-batch's loss / number of micro-batches); (loss, grads)."""
    model.zero_grad()
    total = 0.0
    for batch in batches:
        loss, _ = model(batch, weights)
        (loss / len(batches)).backward()
        total += loss.item() / len(batches)
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("objectives", [("mlm",), ("span",), ("plm",)])
def test_split_batch_has_the_loss_and_gradient_of_the_whole(objectives):
    objectives = build_objectives({o: {} for o in objectives}, TOKENS)
    torch.manual_seed(0)
    model = PretrainingModel(replace(BASE, hidden_dropout=0.0, attention_dropout=0.0), objectives).eval()
    batch = make_batch(lengths=LENGTHS, objectives=objectives)
    parts = make_batch(lengths=LENGTHS, objectives=objectives, split=2)  # the same samples, as two micro-batches
    counts = [sum(p.counts.values()) for p in parts]
    assert counts[0] >= 2 * counts[1], counts  # otherwise the test could not tell the normalizations apart

    whole_loss, whole = gradients(model, [batch], None)
    split_loss, split = gradients(model, parts, step_loss_weights(parts))
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)

    # Means per micro-batch (train.loss_normalization=micro_batch) weigh the few targets of the short rows up
    _, naive = gradients(model, parts, None)
    assert not all(torch.allclose(naive[n], whole[n], rtol=1e-2, atol=1e-5) for n in whole)


def test_weights_make_each_term_a_mean_over_the_step():
    objectives = build_objectives({"rtd": {}}, TOKENS)
    parts = make_batch(lengths=LENGTHS, objectives=objectives, split=2)
    # ELECTRA: the generator predicts the masked tokens, the discriminator scores every real token
    assert [p.counts["rtd_disc"] for p in parts] == [76, 16] and [p.tokens for p in parts] == [76, 16]
    assert [p.counts["rtd_gen"] for p in parts] == [int((p["rtd_mlm_labels"] != -100).sum()) for p in parts]
    weights = step_loss_weights(parts)
    assert weights["rtd_disc"] == pytest.approx(2 / 92)
    for term in ("rtd_gen", "rtd_disc"):  # every target of the step weighs alike: micro-batches / targets
        assert sum(p.counts[term] for p in parts) * weights[term] == pytest.approx(2.0)
