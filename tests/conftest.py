import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest
import torch


def run_cli(*args, cwd, rc=0, wait=True, wandb_mode="disabled"):
    """`python -m pretrain.cli ARGS` in a fresh process, as a user runs it (no rank variables of a launcher around
    it); asserts the exit status `rc` (None: any). wait=False returns the running Popen."""
    import subprocess

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "WANDB_MODE": wandb_mode, "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "pretrain.cli", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if rc is not None:
        tails = f"stdout:{proc.stdout[-3000:]}\nstderr:{proc.stderr[-4000:]}"
        assert proc.returncode == rc, f"rc={proc.returncode}\n{tails}"
    return proc


# The vocabulary of the tiny random-weight models in the model, export and interop tests.
TINY_VOCAB = 128


@pytest.fixture(scope="module")
def tokens():
    """Special tokens of a tiny made-up vocabulary: ids 0-4 are special, the rest replaceable."""
    from pretrain.core.tokens import SpecialTokens

    return SpecialTokens(
        pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=TINY_VOCAB, replaceable=np.arange(5, TINY_VOCAB)
    )


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is fastest, and intra-op threads crawl on a busy machine (10x seen)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _deepspeed_fp16_here() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


# DeepSpeed trains fp16 on a CPU only where oneDNN has fp16 kernels (AVX512-FP16 / AMX-FP16, e.g. Sapphire Rapids);
# elsewhere it refuses ("Type fp16 is not supported on your device"). GPUs and such CPUs run these tests.
requires_fp16 = pytest.mark.skipif(
    not _deepspeed_fp16_here(), reason="DeepSpeed refuses fp16 on this CPU (oneDNN without fp16 kernels)"
)
