"""The optimizers as their papers' reference code runs them."""

import pytest
import torch

from pretrain.train.setup import load_config


def test_lamb_adapts_the_matrices_and_steps_biases_and_norms_as_adam():
    """LAMB scaled every tensor's step by ||w|| / ||update||, biases and LayerNorm weights too, where the LAMB authors'
    BERT code and NVIDIA's exclude them (as from weight decay): a bias that starts at 0 then moved by lr x its own
    small norm a step, so it hardly trained. Now a matrix moves by lr x ||w|| (the trust ratio) and a bias by Adam's
    step, lr a coordinate on the first step."""
    from pretrain.train.optim import build_optimizer

    t = load_config("tiny", ["train.optimizer=lamb", "train.lr=0.01", "train.weight_decay=0.0"]).train
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    norm = torch.nn.LayerNorm(8)
    model = torch.nn.Sequential(layer, norm)
    with torch.no_grad():
        layer.bias.fill_(1e-3)  # a small bias: its trust ratio would be ~1e-3
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    build_optimizer(model, t).step()
    moved = {name: (p.detach() - before[name]) for name, p in model.named_parameters()}
    # the first Adam step is lr x sign(grad) in each coordinate (eps aside)
    for name in ("0.bias", "1.weight", "1.bias"):
        assert moved[name].abs().mean().item() == pytest.approx(0.01, rel=1e-3), name
    assert moved["0.weight"].norm().item() == pytest.approx(0.01 * before["0.weight"].norm().item(), rel=1e-3)


def test_lamb_state_from_before_adapt_goes_on_as_it_trained():
    """A LAMB state saved before the groups said which adapt loads and goes on adapting every tensor, as it trained: a
    run does not change its update rule at a resume."""
    from pretrain.train.optim import build_optimizer

    t = load_config("tiny", ["train.optimizer=lamb", "train.lr=0.01"]).train
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.bias.fill_(1e-3)
    saved = build_optimizer(model, t).state_dict()
    for group in saved["param_groups"]:
        del group["adapt"]
    optimizer = build_optimizer(model, t)
    optimizer.load_state_dict(saved)
    bias = model.bias.detach().clone()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    # the trust ratio ||b|| / ||update|| = 1e-3: the bias moves by lr x 1e-3, not lr
    assert (bias - model.bias.detach()).abs().mean().item() == pytest.approx(0.01 * 1e-3, rel=1e-3)
