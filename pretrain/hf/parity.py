"""The parity check of an export: transformers loads it, and its outputs match ours on a fixed padded batch."""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from pretrain.core.config import ModelConfig
from pretrain.core.errors import UserError
from pretrain.hf.architectures.base import REGISTRY
from pretrain.hf.architectures.base import lm_head_name as _lm_head_name


class ExportError(RuntimeError):
    """The exported directory does not reproduce the model: a bug in the export, not a user mistake."""


def lm_head_name(model: nn.Module) -> str:
    """Dotted name of the token-prediction head tied to the encoder's word embeddings, wherever the
    objective keeps it (heads.mlm, heads.span.mlm, heads.plm, ...): the head a *ForMaskedLM export gets."""
    name = _lm_head_name(model)
    if name is None:
        raise UserError(
            f"BertForMaskedLM export needs a token-prediction objective (mlm, span, plm); this model "
            f"has heads {sorted(model.heads) or 'none'}"
        )
    return name


def probe_batch(cfg: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed batch of 3 x L: random ids (never the pad id at a real token: RoBERTa numbers positions by
    counting non-pad tokens), both token types, and rows with trailing padding. L is 16, or with a sliding window
    16 past it, so that local layers see keys outside their window (a wrong window or RoPE base then shows)."""
    gen = torch.Generator().manual_seed(seed)
    length = min(16 + (cfg.local_attention or 0), cfg.max_position_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (3, length), generator=gen)
    ids[ids == cfg.pad_token_id] = (cfg.pad_token_id + 1) % cfg.vocab_size
    types = torch.zeros_like(ids)
    types[:, length // 2 :] = min(1, max(cfg.type_vocab_size, 1) - 1)
    mask = torch.ones_like(ids)
    mask[1, length - 5 :] = 0
    mask[2, length // 3 :] = 0
    ids[mask == 0] = cfg.pad_token_id
    return ids, types, mask


def load_checked(cls, path: str | Path) -> nn.Module:
    """`cls.from_pretrained(path)` in fp32 eval; missing or unexpected weights are an ExportError."""
    model, info = cls.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32)
    problems = {k: sorted(v) for k, v in info.items() if v and k != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise ExportError(
            f"{path}: transformers loaded the export with problems: {problems} {info.get('error_msgs') or ''}"
        )
    return model.eval()


def load_hf(path: str | Path, hf_class: str | None = None) -> nn.Module:
    """transformers' class for the export in `path` (config.json's architectures[0] by default), fp32, eval."""
    import transformers

    path = Path(path)
    hf_class = hf_class or json.loads((path / "config.json").read_text())["architectures"][0]
    return load_checked(getattr(transformers, hf_class), path)


@contextmanager
def fp32_eval(model: nn.Module):
    """The model in fp32 eval mode for a parity check, without changing the caller's: copied only if a cast is
    needed, and put back in its training mode afterwards."""
    ours = model if all(p.dtype == torch.float32 for p in model.parameters()) else copy.deepcopy(model).float()
    was_training = ours.training
    ours.eval()
    try:
        yield ours
    finally:
        ours.train(was_training)


@torch.no_grad()
def _ours(model: nn.Module, uses_types: bool) -> tuple[dict[str, torch.Tensor], tuple]:
    """Our hidden states, MLM logits and sentence-head logits on the probe batch (fp32, CPU)."""
    with fp32_eval(model) as ours:
        device = next(ours.parameters()).device
        ids, types, mask = probe_batch(ours.config)
        our_types = types if uses_types else torch.zeros_like(types)  # without token types ours are all type 0
        hidden = ours.encoder(ids.to(device), our_types.to(device), mask.to(device))
        expected = {"hidden": hidden.cpu(), "logits": ours.get_submodule(lm_head_name(ours))(hidden).cpu()}
        for sentence in ("nsp", "sop"):
            if sentence in ours.heads:
                expected[sentence] = ours.heads[sentence](hidden).cpu()
    return expected, (ids, types, mask)


@torch.no_grad()
def compare_with_hf(model: nn.Module, hf_model: nn.Module, arch: str) -> dict[str, float]:
    """Max abs differences between ours and `hf_model` on the probe batch (with padding), fp32:
    "hidden" (last hidden state of the base model), "logits" (MLM), and "nsp"/"sop" logits where both have
    that head. Padded positions are compared too (both models mask keys only), except where the architecture
    gives padding its own position id (RoBERTa) or our encoder computes nothing there (model.unpadded): there real
    tokens only."""
    record = REGISTRY.get(arch)
    uses_types = record.token_types if record else True
    expected, (ids, types, mask) = _ours(model, uses_types)
    kwargs = {"input_ids": ids, "attention_mask": mask, **({"token_type_ids": types} if uses_types else {})}
    base = getattr(hf_model, hf_model.base_model_prefix)
    out = hf_model(**kwargs)
    got = {
        "hidden": base(**kwargs).last_hidden_state,
        "logits": out.prediction_logits if hasattr(out, "prediction_logits") else out.logits,
    }
    if getattr(out, "seq_relationship_logits", None) is not None and "nsp" in expected:
        got["nsp"] = out.seq_relationship_logits
    if getattr(out, "sop_logits", None) is not None and "sop" in expected:
        got["sop"] = out.sop_logits
    # An unpadded encoder (model.unpadded) runs on real tokens only and leaves zeros at padding: real tokens only
    all_positions = (record.padding_comparable if record else True) and not getattr(model.config, "unpadded", False)
    real = torch.ones_like(mask, dtype=torch.bool) if all_positions else mask.bool()
    diffs = {}
    for key, value in got.items():
        if value.shape != expected[key].shape:
            raise ExportError(f"{key}: HF shape {tuple(value.shape)} != ours {tuple(expected[key].shape)}")
        a, b = (value[real], expected[key][real]) if value.dim() == 3 else (value, expected[key])
        diffs[key] = (a - b).abs().max().item()
    return diffs


def verify_export(model: nn.Module, out_dir: str | Path, atol: float = 1e-4) -> float:
    """Load `out_dir` with transformers, compare its hidden states and logits with ours in fp32; return the
    max abs difference (ExportError above `atol`)."""
    out_dir = Path(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    diffs = compare_with_hf(model, load_hf(out_dir), config["model_type"])
    worst = max(diffs.values())
    if not worst <= atol:  # `not <=` also catches NaN
        raise ExportError(f"{out_dir}: HF outputs differ from ours by {diffs} (> {atol:g})")
    return worst
