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

# Test modules import their shared helpers (run_cli, small_corpus, make_docs, make_batch, requires_fp16, ...) from
# tests/helpers.py; this file only sets the environment up and holds the fixtures.


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
