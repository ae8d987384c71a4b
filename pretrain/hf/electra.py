"""Export an ELECTRA (rtd) run: the discriminator as `ElectraForPreTraining` in out_dir, the generator as
`ElectraForMaskedLM` in out_dir/generator; both complete `from_pretrained` directories, written atomically.

What ELECTRA is (tables, configs, the two parts, import, verification) is its record in
`pretrain.hf.architectures.electra`; this writes it through the same `export_hf` as every architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from pretrain.core.tokens import SpecialTokens
from pretrain.hf.architectures.electra import (
    GENERATOR_DIR,
    hf_electra_config,
    rtd_head,
    to_hf_electra_state_dicts,
    verify_electra_export,
)
from pretrain.hf.export import export_hf

__all__ = [
    "GENERATOR_DIR",
    "export_electra",
    "hf_electra_config",
    "rtd_head",
    "to_hf_electra_state_dicts",
    "verify_electra_export",
]


def export_electra(
    model: nn.Module,
    tokens: SpecialTokens,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    card: dict,
    inputs: dict[str, Path] | None = None,
    check: Callable[[Path], Any] | None = None,
) -> Path:
    """Write out_dir (discriminator) and out_dir/generator, each config + safetensors + tokenizer + README,
    written in full (and checked by `check`, e.g. `lambda d: verify_electra_export(model, d)`) before they
    replace the previous export's files (`write_hf_dir`); returns out_dir."""
    rtd_head(model)  # a clear error for a run without rtd
    return export_hf(model, tokens, tokenizer_dir, out_dir, card, "electra", inputs, check)[0]
