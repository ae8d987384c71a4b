"""train.precision=fp8 (`pretrain.model.fp8`): each of a Linear's three products is exactly the scaled product of its
fp8-quantized operands, the conversion keeps every parameter and name, training follows bf16, and a GPU without
fp8 kernels is refused before the run writes anything. The CPU runs torch's reference fp8 kernel (slow: tiny shapes)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from helpers import BASE, TOKENS, compile_with, loss_and_grads, make_batch, run_args, run_cli, small_corpus
from torch import nn

from objectives import build_objectives
from pretrain.model.fp8 import E4M3, E5M2, Float8Linear, float8_problem, quantize, use_float8
from pretrain.model.pretraining import PretrainingModel


def dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q, inverse = quantize(t, dtype)
    return q.float() * inverse


@pytest.mark.parametrize("rows", [48, 37])  # 37: not a multiple of 16, so padded to 48 for the kernel
def test_each_product_is_the_scaled_product_of_the_quantized_operands(rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    fp8 = nn.Linear(64, 32)
    fp8.load_state_dict(linear.state_dict())
    fp8.__class__ = Float8Linear
    x = torch.randn(rows, 64) * 3
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(rows, 32) * 1e-3  # gradients are small: the scale, not the format's range, must carry them

    y = fp8(x_fp8)
    y.backward(grad)
    # the reference: operands quantized and turned back in fp32 (inputs and weights e4m3, gradients e5m2)
    x_q, w_q, g_q = dequantized(x, E4M3), dequantized(linear.weight.detach(), E4M3), dequantized(grad, E5M2)
    assert torch.allclose(y, x_q @ w_q.T + linear.bias, rtol=1e-5, atol=1e-5)
    assert torch.allclose(x_fp8.grad, g_q @ w_q, rtol=1e-5, atol=1e-8)
    assert torch.allclose(fp8.weight.grad, g_q.T @ x_q, rtol=1e-5, atol=1e-8)
    assert torch.allclose(fp8.bias.grad, grad.sum(0), rtol=1e-6, atol=1e-9)  # the bias stays in full precision

    # and those are close to the full-precision products (a wrong scale would be off by orders of magnitude)
    y_ref = linear(x_ref)
    y_ref.backward(grad)

    def relative(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert relative(y, y_ref) < 0.05  # e4m3: 3 mantissa bits
    assert relative(x_fp8.grad, x_ref.grad) < 0.1 and relative(fp8.weight.grad, linear.weight.grad) < 0.1  # e5m2


def test_under_autocast_the_product_comes_out_in_bf16_and_gradients_in_their_own_dtypes():
    fp8 = nn.Linear(32, 16)
    fp8.__class__ = Float8Linear
    x = torch.randn(2, 16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 16, 16)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and fp8.weight.grad.dtype == torch.float32


def test_only_the_encoder_layers_linears_convert_and_nothing_else_changes():
    cfg = replace(BASE, intermediate_size=72)  # FFN widths 72: not multiples of 16, so they stay bf16
    model = PretrainingModel(cfg, build_objectives({"mlm": {}, "nsp": {}}, TOKENS))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = use_float8(model.encoder)
    assert converted == [f"layers.{i}.attention.{p}" for i in range(3) for p in ("qkv", "out")]
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(v, before[k]) for k, v in after.items())
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert fp8 == {f"encoder.{n}" for n in converted}  # no head, no embedding projection
    shared = PretrainingModel(replace(BASE, share_layers=True), build_objectives({"mlm": {}}, TOKENS))
    assert use_float8(shared.encoder) == [
        f"shared_layer.{p}" for p in ("attention.qkv", "attention.out", "ffn_in", "ffn_out")
    ]


def _train(model, batches, steps):
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batches[step % len(batches)])[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_fp8_training_follows_bf16():
    objectives = build_objectives({"mlm": {}}, TOKENS)
    cfg = replace(BASE, hidden_dropout=0.0, attention_dropout=0.0)
    batches = [make_batch(seed=s, objectives=objectives) for s in range(4)]
    torch.manual_seed(0)
    bf16 = PretrainingModel(cfg, objectives)
    fp8 = PretrainingModel(cfg, objectives)
    fp8.load_state_dict(bf16.state_dict())
    use_float8(fp8.encoder)
    a, b = _train(bf16, batches, 40), _train(fp8, batches, 40)
    assert a[-1] < a[0] - 0.5  # it learns (the 4 batches, by heart)
    tail = sum(a[-8:]) / 8, sum(b[-8:]) / 8
    assert abs(tail[1] - tail[0]) < 0.05 * tail[0], (a[-8:], b[-8:])


def test_compiled_fp8_matches_eager_fp8(monkeypatch):
    """The float8 autograd function traced by dynamo and AOTAutograd (the graph inductor fuses the scaling into):
    the same loss and gradients as eager."""
    compile_with(monkeypatch, lambda fn, mode: torch.compile(fn, backend="aot_eager"))
    objectives = build_objectives({"mlm": {}}, TOKENS)
    cfg = replace(BASE, hidden_dropout=0.0, attention_dropout=0.0, unpadded=True)
    eager = PretrainingModel(cfg, objectives)
    compiled = PretrainingModel(replace(cfg, compile=True), objectives)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        use_float8(model.encoder)
    for seed, lengths in enumerate([(30, 17, 24, 9), (12, 20, 5, 31)]):  # 80 and 68 real tokens: padded to 80
        batch = make_batch(lengths, seed=seed, objectives=objectives)
        (loss_e, grads_e), (loss_c, grads_c) = (loss_and_grads(model, batch) for model in (eager, compiled))
        assert torch.allclose(loss_c, loss_e, rtol=1e-5, atol=1e-6)
        assert all(torch.allclose(grads_c[n], e, rtol=1e-4, atol=1e-6) for n, e in grads_e.items())


def test_a_gpu_without_fp8_kernels_is_named_and_the_run_refused_before_it_writes(monkeypatch, tmp_path):
    from pretrain.core.errors import ConfigError
    from pretrain.train.setup import check_precision, load_config

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    problem = float8_problem(torch.device("cuda", 0))
    assert (
        problem
        == "NVIDIA A100-SXM4-80GB has compute capability 8.0; fp8 matrix products need 8.9 or newer (H100, L40S)"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8_problem(torch.device("cuda", 0)) is None and float8_problem(torch.device("cpu")) is None

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ConfigError, match=r"train.precision=fp8: NVIDIA A100-SXM4-80GB has compute capability 8.6;"):
        check_precision(load_config("tiny", ["train.precision=fp8"]), "bf16")
    check_precision(load_config("tiny", ["train.precision=bf16"]), "bf16")  # other precisions: nothing to check


def test_fp16_where_deepspeed_has_none_is_refused_by_name(monkeypatch):
    """DeepSpeed refuses fp16 on a CPU without oneDNN's fp16 kernels: that was its 36-line traceback, after the run
    had written config.yaml; now a ConfigError before anything is written (`Trainer.start` checks first)."""
    from deepspeed.accelerator import get_accelerator

    from pretrain.core.errors import ConfigError
    from pretrain.train.setup import check_precision, load_config

    accelerator = get_accelerator()
    cfg = load_config("tiny", ["train.precision=fp16"])
    monkeypatch.setattr(type(accelerator), "is_fp16_supported", lambda self: False)
    with pytest.raises(ConfigError, match=r"train.precision=fp16: DeepSpeed has no fp16 on this .*precision=bf16"):
        check_precision(cfg, "fp16")
    check_precision(load_config("tiny", ["train.precision=bf16"]), "bf16")
    monkeypatch.setattr(type(accelerator), "is_fp16_supported", lambda self: True)
    check_precision(cfg, "fp16")


@pytest.mark.slow  # the CPU's reference fp8 kernel: ~20 s
def test_an_fp8_run_through_the_cli_trains_saves_and_exports(tmp_path):
    corpus = small_corpus(tmp_path)
    dry = run_cli("train", *run_args(tmp_path / "out", corpus, "train.precision=fp8"), "--dry-run", cwd=tmp_path)
    assert "(ZeRO stage 0, bf16-autocast with float8 products in the encoder layers, 1 rank(s)" in dry.stdout
    proc = run_cli("run", *run_args(tmp_path / "out", corpus, "train.precision=fp8"), cwd=tmp_path)
    assert "bf16-autocast with float8 products in 4 encoder Linears" in proc.stdout + proc.stderr
    run = tmp_path / "out" / "r"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)
    assert (run / "checkpoints" / "step_00000003").is_dir()
    assert "max |logit diff| vs ours" in proc.stdout + proc.stderr  # the export's parity check passed
