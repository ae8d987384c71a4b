"""A run's precision is the precision its training step computes in. bf16 under ZeRO-0 is torch autocast over fp32
weights; DeepSpeed's forward turns off an autocast entered around it (0.19), so a step wrapped from outside
computed in fp32: on an H100 BERT-base trained at 78k tokens/s instead of its ~400k (benchmarks/RESULTS.md). Checked
in the engine's real step, on a subprocess of one rank: the dtype a Linear of the encoder computes in, the weights'
and the gradients' dtypes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_engine_script

from pretrain.train.distributed import single_process_env

ROOT = Path(__file__).resolve().parent.parent

STEP = """
import json
linear = next(m for m in engine.ds.module.encoder.modules() if isinstance(m, nn.Linear))
seen = {}
def note(module, args, out):  # returns None: the output stays as it is
    seen.setdefault("computed", str(out.dtype))
linear.register_forward_hook(note)
loss, _ = engine.ds(batch.to(engine.device))
engine.backward(loss)
seen.update(mode=run.precision, weight=str(linear.weight.dtype), loss=str(loss.dtype),
            grad=str(linear.weight.grad.dtype) if linear.weight.grad is not None else None)
engine.step()
print("SEEN", json.dumps(seen))
"""


F32, B16 = "torch.float32", "torch.bfloat16"
CASES = {  # (precision, ZeRO stage): what the step shows
    ("fp32", 0): {"mode": "fp32", "computed": F32, "weight": F32},
    # autocast over fp32 weights: bf16 products, fp32 weights and gradients, an fp32 loss
    ("bf16", 0): {"mode": "bf16-autocast", "computed": B16, "weight": F32, "grad": F32, "loss": F32},
    # DeepSpeed's bf16: the module itself in bf16 (fp32 masters in its optimizer)
    ("bf16", 2): {"mode": "bf16", "computed": B16, "weight": B16},
}


@pytest.mark.parametrize("precision, zero", list(CASES))
def test_the_step_computes_in_the_runs_precision(precision, zero):
    expected = CASES[precision, zero]
    script = tiny_engine_script(precision, zero, mask_rate=0.5) + STEP
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=single_process_env(WANDB_MODE="disabled", DS_ACCELERATOR="cpu"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.split("SEEN ", 1)[1])
    assert {k: seen.get(k) for k in expected} == expected, seen


def test_bf16_on_a_cpu_without_native_bf16_is_noted(monkeypatch):
    """There bf16 products are emulated, many times slower than fp32: the log says so (auto chooses fp32 there)."""
    from pretrain.train import distributed

    monkeypatch.setattr(distributed, "has_cuda", lambda: False)
    monkeypatch.setattr(distributed, "cpu_supports_bf16", lambda: False)
    assert "emulated" in distributed.slow_precision_note("bf16-autocast")
    assert "emulated" in distributed.slow_precision_note("bf16")
    assert distributed.slow_precision_note("fp32") is None
    monkeypatch.setattr(distributed, "cpu_supports_bf16", lambda: True)
    assert distributed.slow_precision_note("bf16-autocast") is None
    monkeypatch.setattr(distributed, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(distributed, "has_cuda", lambda: True)
    assert distributed.slow_precision_note("bf16-autocast") is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_attention_bias_is_finite_in_the_dtype_sdpa_computes_in(dtype):
    """A bias made in the activations' fp32 under autocast is cast to bf16 by SDPA, where fp32's finfo.min is -inf: a
    query with no allowed key (PLM's per-query masks) then averaged -inf scores, NaN on CUDA's kernels."""
    import torch

    from pretrain.model.padding import attention_bias

    allowed = torch.ones(2, 4, 4, dtype=torch.bool)  # [B, Lq, L] per-query mask
    allowed[0, 1] = False  # a query that may see no key
    plain = attention_bias(allowed, torch.float32)
    assert plain.dtype == torch.float32 and plain.isfinite().all()
    with torch.autocast("cpu", dtype=getattr(torch, dtype)):
        bias = attention_bias(allowed, torch.float32)
    assert bias.to(getattr(torch, dtype)).isfinite().all()
    assert (bias[0, 0, 1] < -1e4).all() and not bias[1].any()
