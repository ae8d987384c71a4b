"""Export a trained encoder + MLM head as a HuggingFace `BertForMaskedLM` directory, and check it.

The checkpoint layout `save_pretrained` writes for BERT in transformers 5.x:
- config.json with architectures ["BertForMaskedLM"] and tie_word_embeddings true;
- model.safetensors WITHOUT `cls.predictions.decoder.weight` / `.bias`: both are tied on load
  (to the word embeddings and to `cls.predictions.bias`) and `save_pretrained` drops them, so we do too;
- no `bert.embeddings.position_ids` / `token_type_ids`: they are non-persistent buffers;
- no pooler: `BertForMaskedLM` builds `BertModel(add_pooling_layer=False)`.

Every name correspondence lives in `_weight_map`, used in both directions.
"""

from __future__ import annotations

import copy
import datetime
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file
from torch import nn

from objectives.base import SpecialTokens
from pretrain.config import ModelConfig
from pretrain.errors import UserError


# Keys HF may carry that hold no information of their own: the tied decoder (a copy of the word
# embeddings and of cls.predictions.bias) and non-persistent buffers older versions saved.
_TIED_DECODER = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                 "cls.predictions.decoder.bias": "cls.predictions.bias"}
_HF_BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")


class ExportError(RuntimeError):
    """The exported directory does not reproduce the model: a bug in the export, not a user mistake."""


def hf_bert_config(model_cfg: ModelConfig, tokens: SpecialTokens) -> Any:
    """The `BertConfig` of our encoder. HF's "gelu" is `nn.functional.gelu` (exact erf form), as ours."""
    import transformers

    if model_cfg.vocab_size != tokens.vocab_size:
        raise UserError(f"model.vocab_size {model_cfg.vocab_size} != tokenizer vocabulary size {tokens.vocab_size}")
    return transformers.BertConfig(
        architectures=["BertForMaskedLM"],
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        intermediate_size=model_cfg.intermediate_size,
        hidden_act="gelu",
        hidden_dropout_prob=model_cfg.hidden_dropout,
        attention_probs_dropout_prob=model_cfg.attention_dropout,
        max_position_embeddings=model_cfg.max_position_embeddings,
        type_vocab_size=model_cfg.type_vocab_size,
        initializer_range=model_cfg.initializer_range,
        layer_norm_eps=model_cfg.layer_norm_eps,
        pad_token_id=tokens.pad,
        # transformers 5 only has absolute positions and ignores this; 4.x readers consult it.
        position_embedding_type="absolute",
        tie_word_embeddings=True,
        is_decoder=False,
        use_cache=False,
    )


# ----------------------------------------------------------------------------------------------
# The weight map


def lm_head_name(model: nn.Module) -> str:
    """Dotted name of the token-prediction head tied to the encoder's word embeddings, wherever the
    objective keeps it (heads.mlm, heads.span.mlm, heads.plm, ...): the head BertForMaskedLM gets."""
    from objectives.mlm import MLMHead

    tied = model.encoder.embeddings.word_embeddings.weight
    for name, module in model.named_modules():
        if isinstance(module, MLMHead) and module.decoder_weight is tied and name.startswith("heads."):
            return name
    raise UserError(f"BertForMaskedLM export needs a token-prediction objective (mlm, span, plm); this model "
                    f"has heads {sorted(model.heads) or 'none'}")


def _weight_map(num_layers: int, head: str) -> list[tuple[str, tuple[str, ...]]]:
    """(our name, HF names). One HF name: a rename. Several: our tensor is their concatenation on dim 0
    (the fused qkv Linear stacks q, k, v along its output dimension, in that order)."""
    pairs: list[tuple[str, tuple[str, ...]]] = []

    def linear_or_norm(ours: str, *hf: str) -> None:
        for param in ("weight", "bias"):
            pairs.append((f"{ours}.{param}", tuple(f"{h}.{param}" for h in hf)))

    emb, hf_emb = "encoder.embeddings", "bert.embeddings"
    for table in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        pairs.append((f"{emb}.{table}.weight", (f"{hf_emb}.{table}.weight",)))
    linear_or_norm(f"{emb}.layer_norm", f"{hf_emb}.LayerNorm")

    for i in range(num_layers):
        ours, hf = f"encoder.layers.{i}", f"bert.encoder.layer.{i}"
        linear_or_norm(f"{ours}.attention.qkv", *(f"{hf}.attention.self.{p}" for p in ("query", "key", "value")))
        linear_or_norm(f"{ours}.attention.out", f"{hf}.attention.output.dense")
        linear_or_norm(f"{ours}.attn_norm", f"{hf}.attention.output.LayerNorm")
        linear_or_norm(f"{ours}.ffn_in", f"{hf}.intermediate.dense")
        linear_or_norm(f"{ours}.ffn_out", f"{hf}.output.dense")
        linear_or_norm(f"{ours}.ffn_norm", f"{hf}.output.LayerNorm")

    linear_or_norm(f"{head}.dense", "cls.predictions.transform.dense")
    linear_or_norm(f"{head}.layer_norm", "cls.predictions.transform.LayerNorm")
    pairs.append((f"{head}.bias", ("cls.predictions.bias",)))
    # heads.mlm.decoder_weight is the word-embedding Parameter itself (tied), so it has no entry.
    return pairs


def _check_exportable(model: nn.Module) -> str:
    return lm_head_name(model)  # raises when there is no tied token-prediction head


def to_hf_bert_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our `PretrainingModel` weights under `BertForMaskedLM` names: fp32, CPU, contiguous, unshared."""
    head = _check_exportable(model)
    ours = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, hf_names in _weight_map(model.config.num_layers, head):
        for hf_name, part in zip(hf_names, ours[name].chunk(len(hf_names), dim=0)):
            # clone: chunks are views of one storage, and safetensors refuses shared tensors
            out[hf_name] = part.detach().to("cpu", torch.float32).contiguous().clone()
    return out


def from_hf_bert_state_dict(hf_sd: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf_bert_state_dict`: a state dict `model.load_state_dict` accepts (strict)."""
    head = _check_exportable(model)
    pairs = _weight_map(model.config.num_layers, head)
    known = {h for _, hf_names in pairs for h in hf_names}
    missing = sorted(known - hf_sd.keys())
    unexpected = sorted(hf_sd.keys() - known - _TIED_DECODER.keys() - set(_HF_BUFFERS))
    if missing or unexpected:
        raise UserError(f"not a BertForMaskedLM state dict of {model.config.num_layers} layers: "
                        f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    # A checkpoint may carry the decoder explicitly; we can only represent it tied.
    for copy_name, source in _TIED_DECODER.items():
        if copy_name in hf_sd and not torch.equal(hf_sd[copy_name], hf_sd[source]):
            raise UserError(f"{copy_name} differs from {source}: an untied decoder cannot be imported")

    ref = model.state_dict()
    out = {}
    for name, hf_names in pairs:
        out[name] = torch.cat([hf_sd[h] for h in hf_names], dim=0).to(ref[name].dtype)
    out[f"{head}.decoder_weight"] = out["encoder.embeddings.word_embeddings.weight"]
    return out


# ----------------------------------------------------------------------------------------------
# The export directory


def _card_value(card: dict, key: str) -> Any:
    value = card.get(key)
    return "unknown" if value is None or value == "" else value


def _fmt_int(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def model_card(model_cfg: ModelConfig, num_params: int, card: dict) -> str:
    """README.md: YAML front matter for the Hub, then what was trained, on what, for how long."""
    objectives = card.get("objectives") or ["unknown"]
    if isinstance(objectives, dict):  # {name: options}: list each with its options
        described = [f"{name} ({', '.join(f'{k}={v}' for k, v in (opts or {}).items())})"
                     for name, opts in objectives.items()]
        objectives = list(objectives)
    else:
        described = list(map(str, objectives))
    front: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "fill-mask", "language": ["en"],
                             "tags": ["bert", "fill-mask", "pretraining", *map(str, objectives)]}
    if card.get("license"):  # never claim a license nobody chose
        front["license"] = card["license"]
    final_loss = card.get("final_loss")
    loss_text = f"{final_loss:.4f}" if isinstance(final_loss, float) else str(_card_value(card, "final_loss"))
    corpus = _card_value(card, "corpus")
    if isinstance(corpus, (list, tuple)):
        corpus = ", ".join(map(str, corpus))
    # through JSON so that paths, numpy scalars and the like become plain YAML
    plain_config = json.loads(json.dumps(card.get("config") or {}, default=str))
    config_yaml = yaml.safe_dump(plain_config, sort_keys=False).strip() if plain_config else "unknown"
    name = _card_value(card, "run_name")
    lines = [
        "---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
        f"# {name}", "",
        "A BERT encoder pretrained from scratch, exported as `BertForMaskedLM`.", "",
        "## Training", "",
        f"- Objective(s): {'; '.join(described)}",
        f"- Data: {corpus}",
        f"- Data provenance: {_card_value(card, 'provenance')}",
        f"- Tokens seen: {_fmt_int(_card_value(card, 'tokens_seen'))}",
        f"- Steps: {_fmt_int(_card_value(card, 'steps'))}",
        f"- Final loss: {loss_text}",
        f"- Exported: {datetime.date.today().isoformat()}", "",
        "## Model", "",
        f"- Parameters: {num_params:,}",
        f"- Layers: {model_cfg.num_layers}, hidden size: {model_cfg.hidden_size}, "
        f"heads: {model_cfg.num_heads}, intermediate size: {model_cfg.intermediate_size}",
        f"- Vocabulary: {model_cfg.vocab_size}, max positions: {model_cfg.max_position_embeddings}", "",
        "## Training configuration", "",
        "```yaml", config_yaml, "```", "",
        "## Usage", "",
        "```python",
        "from transformers import pipeline",
        "",
        'fill = pipeline("fill-mask", model="path/to/this/directory")',
        'print(fill(f"The meaning of life is {fill.tokenizer.mask_token}."))',
        "```", "",
    ]
    return "\n".join(lines)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Swap a finished `tmp` into place: at every instant out_dir is either the old or the new export."""
    old = out_dir.parent / (".old-" + out_dir.name)
    if old.exists():
        shutil.rmtree(old)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old.exists():
        shutil.rmtree(old)


def export_pretrained(model: nn.Module, tokens: SpecialTokens, tokenizer_dir: str | Path, out_dir: str | Path,
                      card: dict) -> Path:
    """Write a `from_pretrained`-loadable directory (config, safetensors, tokenizer, README); returns it."""
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    if not tokenizer_dir.is_dir() or not any(tokenizer_dir.iterdir()):
        raise UserError(f"tokenizer directory {tokenizer_dir} is missing or empty")
    config = hf_bert_config(model.config, tokens)
    state = to_hf_bert_state_dict(model)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / (".tmp-" + out_dir.name)
    if tmp.exists():  # left by an export that crashed
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        for item in tokenizer_dir.iterdir():
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
        config.save_pretrained(tmp)  # writes config.json
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})  # "pt": what HF's loader expects
        num_params = sum(t.numel() for t in state.values())  # tied decoder not in `state`: counted once
        (tmp / "README.md").write_text(model_card(model.config, num_params, card))
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ----------------------------------------------------------------------------------------------
# Verification


def _probe_batch(cfg: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed batch of 3 x L: random ids, both token types, and rows with trailing padding."""
    gen = torch.Generator().manual_seed(seed)
    length = min(16, cfg.max_position_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (3, length), generator=gen)
    types = torch.zeros_like(ids)
    types[:, length // 2:] = min(1, cfg.type_vocab_size - 1)
    mask = torch.ones_like(ids)
    mask[1, length - 5:] = 0
    mask[2, length // 3:] = 0
    ids[mask == 0] = cfg.pad_token_id
    return ids, types, mask


@torch.no_grad()
def verify_export(model: nn.Module, out_dir: str | Path, atol: float = 1e-4) -> float:
    """Load `out_dir` with transformers, compare its logits with ours in fp32; return the max abs diff."""
    import transformers

    hf, info = transformers.AutoModelForMaskedLM.from_pretrained(str(out_dir), output_loading_info=True,
                                                                 dtype=torch.float32)
    problems = {k: sorted(v) for k, v in info.items() if v and k != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise ExportError(f"{out_dir}: transformers loaded the export with problems: {problems} "
                          f"{info.get('error_msgs') or ''}")
    hf.eval()

    # Compare in fp32 without changing the caller's model: copy it only if a cast is needed.
    ours = model if all(p.dtype == torch.float32 for p in model.parameters()) else copy.deepcopy(model).float()
    was_training = ours.training
    ours.eval()
    try:
        device = next(ours.parameters()).device
        ids, types, mask = _probe_batch(ours.config)
        expected = ours.get_submodule(lm_head_name(ours))(ours.encoder(ids.to(device), types.to(device), mask.to(device))).cpu()
    finally:
        ours.train(was_training)
    got = hf(input_ids=ids, token_type_ids=types, attention_mask=mask).logits
    # Padded positions included: both models mask keys only, so their outputs must agree there too.
    diff = (got - expected).abs().max().item()
    if not diff <= atol:  # `not <=` also catches NaN
        raise ExportError(f"{out_dir}: HF logits differ from ours by {diff:.3g} (> {atol:g})")
    return diff
