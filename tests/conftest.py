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


# ----------------------------------------------------------------------------------------------
# Tiny runs through the CLI, as a user makes them

CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"  # the embedded corpus


def small_corpus(directory: Path, lines: slice = slice(0, 20), name: str = "speeches.jsonl") -> Path:
    """A corpus file of a few documents of the embedded corpus (20 by default): enough for the tiny preset."""
    path = Path(directory) / name
    path.write_text("\n".join(CORPUS.read_text().splitlines()[lines]) + "\n")
    return path


def run_args(out, corpus, *extra) -> list[str]:
    """A `tiny` run of 3 steps with 1 layer named r in `out` on `corpus` (a checkpoint at step 3, a metrics line per
    step); `extra` overrides come last and win (e.g. "name=other")."""
    return [
        "tiny",
        f"output_dir={out}",
        "name=r",
        f"data.corpus=[{corpus}]",
        "data.vocab_size=512",
        "data.num_workers=0",
        "model.num_layers=1",
        "train.max_steps=3",
        "train.save_every=3",
        "train.log_every=1",
        "train.warmup_steps=1",
        *extra,
    ]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` with its bytes (what 'left untouched' means; the lock records its last holder)."""
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def one_line_error(proc, *needles):
    """The command failed with one `error:` line (no traceback) holding every needle."""
    err = proc.stderr.strip()
    assert err.splitlines()[-1].startswith("error:") and "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in err, (needle, err[-3000:])


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
