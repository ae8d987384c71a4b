"""Which functions of the model run under torch.compile, and how (model.compile, model.compile_mode).

The model compiles plain functions over its modules, never the modules themselves, so state-dict names stay as they
are: the encoder's embeddings and its layer stack (`pretrain.model.encoder`), and each objective's head with its
loss (`objectives`: the LM head's gather, projection and cross-entropy; span's boundary head; ELECTRA's generator,
its sampling and the discriminator's head; the sentence-pair head). Each function is compiled once per mode, on its
first call: importing must not start dynamo.

Sizes that change from batch to batch (the real tokens of an unpadded batch, the targets of a masked batch) are
`varying`: marked dynamic before the first call, so that dynamo builds one graph dynamic in that size rather than a
static graph and then a recompile. Such a graph records no CUDA graphs (reduce-overhead would record, and keep the
memory of, one per size it sees): it runs in its mode without them. Everything else keeps one shape per phase (the
collator's static width), so the layers of padded and packed batches do use CUDA graphs under reduce-overhead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

# The mode a varying-size graph runs in, for each mode that records CUDA graphs.
_WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}

_made: dict[tuple[Callable, str], Callable] = {}


def without_cuda_graphs(mode: str) -> str:
    """The compile mode that is `mode` without CUDA graphs (`mode` itself where it records none)."""
    return _WITHOUT_CUDA_GRAPHS.get(mode, mode)


def _make(fn: Callable, mode: str) -> Callable:
    """torch.compile of `fn` in `mode` (the one place the model calls it; tests swap in a counting backend)."""
    return torch.compile(fn, mode=None if mode == "default" else mode)


def dispatch_mode_active() -> bool:
    """FlopCounterMode (pretrain.train.flops) and similar modes must see the eager ops, not a compiled graph."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def compiled(fn: Callable, config: Any, varying: Iterable[torch.Tensor | None] = ()) -> Callable:
    """`fn` as the model runs it under `config` (a ModelConfig): compiled in model.compile_mode where model.compile
    is true and no dispatch mode is active, else `fn` itself. `varying`: tensors whose first dimension changes from
    batch to batch (None entries are skipped); the graph is dynamic in it and records no CUDA graphs."""
    if not getattr(config, "compile", False) or dispatch_mode_active():
        return fn
    mode = config.compile_mode
    sized = [t for t in varying if t is not None]
    if sized:
        mode = without_cuda_graphs(mode)
        for t in sized:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    key = (fn, mode)
    if key not in _made:
        _made[key] = _make(fn, mode)
    return _made[key]
