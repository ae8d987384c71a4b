"""Variable-length attention on the unpadded path (`model.unpadded`, `pretrain.model.padding.varlen_attention`):
flash attention's kernel over the packed tokens, each row one sequence, a local layer's band as its window. The
kernel is CUDA-only: on a CPU the path runs on a per-sequence reference of the kernel's documented contract (q, k,
v [T, N, D], cumulative row starts, an inclusive (left, right) window), which checks everything around it (row
starts, rotary positions, windows, the output projection, gradients) against the padded encoder; where CUDA is,
the real kernel is checked against the padded encoder in bf16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import BASE, TOKENS, loss_and_grads, make_batch

from objectives import build_objectives
from pretrain.model import encoder as encoder_module
from pretrain.model import padding
from pretrain.model.pretraining import PretrainingModel

CASES = {
    "global": dict(),
    "local_rope_prenorm": dict(
        norm_placement="pre", position_embedding="rope", activation="geglu", local_attention=8, global_every=2
    ),
}
LENGTHS = [(30, 17, 24, 9), (8, 11, 25, 3, 7)]


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
    """The kernel's contract, one sequence at a time: query i of a sequence sees its keys j with
    i - left <= j <= i + right (-1: no limit)."""
    left, right = window_size
    out = torch.empty_like(q)
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        i = torch.arange(e - s)
        allowed = torch.ones(e - s, e - s, dtype=torch.bool)
        if left >= 0:
            allowed &= i[None, :] >= i[:, None] - left
        if right >= 0:
            allowed &= i[None, :] <= i[:, None] + right
        y = F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1) for t in (q, k, v)), attn_mask=allowed)
        out[s:e] = y.transpose(0, 1)
    return out


@pytest.fixture
def reference_kernel(monkeypatch):
    """The varlen path taken on this CPU, on the reference; counts its calls."""
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs["window_size"])
        return reference_varlen(*args, **kwargs)

    monkeypatch.setattr(padding, "_varlen_attn", lambda: kernel)
    monkeypatch.setattr(encoder_module, "varlen_usable", lambda q, dropout_p: dropout_p == 0.0)
    return calls


def _build(options: dict) -> PretrainingModel:
    torch.manual_seed(0)
    cfg = replace(BASE, **{"hidden_dropout": 0.0, "attention_dropout": 0.0, **options})
    model = PretrainingModel(cfg, build_objectives({"mlm": {}}, TOKENS))
    with torch.no_grad():  # off the init (zero biases and unit norms would hide mistakes)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("case", CASES)
def test_varlen_attention_gives_the_padded_encoders_loss_and_gradients(case, reference_kernel):
    padded = _build(CASES[case])
    unpadded = _build(dict(CASES[case], unpadded=True))
    unpadded.load_state_dict(padded.state_dict())
    for seed, lengths in enumerate(LENGTHS):
        batch = make_batch(lengths=lengths, seed=seed)
        loss_p, grads_p = loss_and_grads(padded, batch)
        calls = len(reference_kernel)
        loss_u, grads_u = loss_and_grads(unpadded, batch)
        assert len(reference_kernel) - calls == BASE.num_layers  # every layer ran on the packed tokens
        assert torch.allclose(loss_u, loss_p, rtol=1e-5, atol=1e-6), (case, seed, loss_u.item(), loss_p.item())
        wrong = {
            n: (grads_u[n] - g).abs().max().item()
            for n, g in grads_p.items()
            if not torch.allclose(grads_u[n], g, rtol=1e-4, atol=1e-6)
        }
        assert not wrong, f"{case}, batch {seed}: gradients differ from the padded encoder: {wrong}"
    windows = set(reference_kernel)
    assert windows == ({(-1, -1), (4, 4)} if case.startswith("local") else {(-1, -1)})  # window 8: 4 either side


def test_attention_dropout_while_training_keeps_the_re_padded_path(reference_kernel):
    model = _build(dict(unpadded=True, attention_dropout=0.1)).train()
    model(make_batch())
    assert reference_kernel == []  # the kernel has no dropout
    model.eval()(make_batch())
    assert len(reference_kernel) == BASE.num_layers  # evaluation has none


def test_the_kernel_is_used_only_where_it_runs():
    q = torch.randn(10, 2, 16)
    assert not padding.varlen_usable(q, 0.0)  # a CPU tensor
    if torch.cuda.is_available():
        assert padding.varlen_usable(q.cuda().bfloat16(), 0.0) == (padding._varlen_attn() is not None)
        assert not padding.varlen_usable(q.cuda().bfloat16(), 0.1)
        assert not padding.varlen_usable(q.cuda(), 0.0)  # fp32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's varlen kernel needs CUDA")
@pytest.mark.parametrize("case", CASES)
def test_the_cuda_kernel_gives_the_padded_encoders_loss(case):
    if padding._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    padded = _build(CASES[case]).cuda()
    unpadded = _build(dict(CASES[case], unpadded=True)).cuda()
    unpadded.load_state_dict(padded.state_dict())
    for seed, lengths in enumerate(LENGTHS):
        batch = make_batch(lengths=lengths, seed=seed).to("cuda")
        with torch.autocast("cuda", torch.bfloat16):
            loss_p, grads_p = loss_and_grads(padded, batch)
            loss_u, grads_u = loss_and_grads(unpadded, batch)
        assert torch.allclose(loss_u, loss_p, rtol=2e-2, atol=2e-2), (case, seed, loss_u.item(), loss_p.item())
        for name, g in grads_p.items():
            assert torch.allclose(grads_u[name], g, rtol=5e-2, atol=5e-2), (case, seed, name)
