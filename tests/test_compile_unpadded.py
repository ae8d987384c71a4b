"""model.compile against eager, in loss and every parameter's gradient, over batches of different real-token counts:
the first compiles a static graph, the second recompiles with dynamic shapes (T, B, L change), the third reuses that
graph with yet other sizes. Unpadded (`Packed`: gathers, scatters and `_TakeRows` inside the compiled layers, T a
dynamic size) and padded, and unpadded local attention with RoPE (`Banded` masks, per-token rotary tables)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import BASE, TOKENS, compile_with, loss_and_grads, make_batch

from objectives import build_objectives
from pretrain.model.pretraining import PretrainingModel

CASES = {
    "unpadded": dict(unpadded=True),
    "padded": dict(unpadded=False),
    "unpadded_local_rope": dict(
        unpadded=True,
        norm_placement="pre",
        position_embedding="rope",
        activation="geglu",
        local_attention=8,
        global_every=2,
    ),
}
# Real tokens 80, 37, 54; batch 4, 3, 5; length 30, 20, 25 (a window of 8 runs by blocks at each length).
LENGTHS = [(30, 17, 24, 9), (12, 20, 5), (8, 11, 25, 3, 7)]


@pytest.fixture(scope="module")
def compile_works():
    try:
        torch.compile(lambda x: x * 2)(torch.ones(2))
    except Exception as e:  # no C++ compiler for inductor, an unsupported platform, ...
        pytest.skip(f"torch.compile cannot run here: {type(e).__name__}: {e}")


def _build(options: dict) -> PretrainingModel:
    torch.manual_seed(0)
    tiny = dict(num_layers=2, hidden_size=16, num_heads=2, intermediate_size=32)
    cfg = replace(BASE, **tiny, hidden_dropout=0.0, attention_dropout=0.0, **options)
    return PretrainingModel(cfg, build_objectives({"mlm": {}}, TOKENS))


@pytest.mark.slow  # a static then a dynamic graph (fwd + bwd) per case: ~65 s for the three, cold, on 2 cores
@pytest.mark.parametrize("case", CASES)
def test_compiled_gradients_match_eager_across_token_counts(case, compile_works):
    torch._dynamo.reset()  # a fresh start: static graph first, then the dynamic recompile, then its reuse
    eager = _build(CASES[case])
    with torch.no_grad():  # off the init (zero biases and unit norms would hide mistakes)
        for p in eager.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    compiled = _build(dict(CASES[case], compile=True))
    compiled.load_state_dict(eager.state_dict())
    for seed, lengths in enumerate(LENGTHS):
        batch = make_batch(lengths=lengths, seed=seed)
        loss_e, grads_e = loss_and_grads(eager, batch)
        loss_c, grads_c = loss_and_grads(compiled, batch)
        where = f"{case}, batch {seed} ({batch.tokens} real tokens)"
        assert torch.allclose(loss_c, loss_e, rtol=1e-5, atol=1e-5), (where, loss_c.item(), loss_e.item())
        assert grads_c.keys() == grads_e.keys(), where
        wrong = {
            name: (grads_c[name] - grad).abs().max().item()
            for name, grad in grads_e.items()
            if not torch.allclose(grads_c[name], grad, rtol=1e-5, atol=1e-5)
        }
        assert not wrong, f"{where}: compiled gradients differ from eager (max abs difference): {wrong}"


@pytest.mark.parametrize(
    "spec", [{"mlm": {}, "nsp": {}}, {"span": {}}, {"rtd": {"generator_layers": 1}}, {"plm": {}}], ids=str
)
def test_compiled_heads_and_losses_match_eager(spec, monkeypatch):
    """Every objective's head and loss, traced by dynamo and AOTAutograd (aot_eager: the graphs inductor would get,
    run by eager kernels, so ELECTRA's samples draw the same random numbers), against eager: loss, every metric and
    every gradient, over batches with different numbers of targets."""
    from pretrain.model import compiling

    compile_with(monkeypatch, lambda fn, mode: torch.compile(fn, backend="aot_eager", dynamic=None))
    objectives = build_objectives(spec, TOKENS)
    torch.manual_seed(0)
    cfg = replace(BASE, hidden_dropout=0.0, attention_dropout=0.0)
    eager = PretrainingModel(cfg, objectives)
    with torch.no_grad():
        for p in eager.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    compiled = PretrainingModel(replace(cfg, compile=True), objectives)
    compiled.load_state_dict(eager.state_dict())
    for seed, lengths in enumerate(LENGTHS):
        batch = make_batch(lengths=lengths, seed=seed, objectives=objectives)
        results = []
        for model in (eager, compiled):
            torch.manual_seed(seed)  # rtd: both sample from the same generator state
            model.zero_grad(set_to_none=True)
            loss, metrics = model(batch)
            loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            results.append((loss.detach(), {k: v.value() for k, v in metrics.items() if hasattr(v, "value")}, grads))
        (loss_e, metrics_e, grads_e), (loss_c, metrics_c, grads_c) = results
        where = f"{list(spec)}, batch {seed}"
        assert torch.allclose(loss_c, loss_e, rtol=1e-5, atol=1e-6), (where, loss_c.item(), loss_e.item())
        assert metrics_c.keys() == metrics_e.keys() and len(metrics_e) > 2, where
        for k, v in metrics_e.items():
            assert metrics_c[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (where, k)
        assert grads_c.keys() == grads_e.keys(), where
        wrong = [n for n, g in grads_e.items() if not torch.allclose(grads_c[n], g, rtol=1e-4, atol=1e-6)]
        assert not wrong, f"{where}: compiled gradients differ from eager: {wrong}"
    assert {fn.__name__ for fn, _ in compiling._made} - {"_embed", "layer_stack"}, "no head was compiled"
