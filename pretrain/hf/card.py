"""The model card (README.md) of an exported directory: one template for every architecture and part."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import yaml

from pretrain.core.config import ModelConfig
from pretrain.hf.architectures.base import REGISTRY, Card

_FILL_MASK_USAGE = "\n".join(
    [
        "## Usage",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        'fill = pipeline("fill-mask", model="path/to/this/directory")',
        'print(fill(f"The meaning of life is {fill.tokenizer.mask_token}."))',
        "```",
        "",
    ]
)


def _card_value(card: dict, key: str) -> Any:
    value = card.get(key)
    return "unknown" if value is None or value == "" else value


def _fmt_int(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def intro_line(arch: str, hf_class: str, init_from: bool) -> str:
    how = "pretrained further from a HuggingFace checkpoint" if init_from else "pretrained from scratch"
    title = REGISTRY[arch].title if arch in REGISTRY else arch
    return f"A {title} encoder {how}, exported as `{hf_class}`."


def _front_matter(card: dict, arch: str, role: Card) -> tuple[dict[str, Any], list[str]]:
    """The Hub's YAML front matter, and the objectives described with their options."""
    objectives = card.get("objectives") or ["unknown"]
    if isinstance(objectives, dict):  # {name: options}: list each with its options
        described = [
            f"{name} ({', '.join(f'{k}={v}' for k, v in (opts or {}).items())})" for name, opts in objectives.items()
        ]
        objectives = list(objectives)
    else:
        described = list(map(str, objectives))
    fill_mask = ["fill-mask"] if role.fill_mask else []
    front: dict[str, Any] = {
        "library_name": "transformers",
        **({"pipeline_tag": "fill-mask"} if role.fill_mask else {}),
        "tags": [arch, *fill_mask, "pretraining", *map(str, objectives)],
    }
    if card.get("license"):  # never claim a license nobody chose
        front["license"] = card["license"]
    return front, described


def card_names(paths: list[str]) -> list[str]:
    """Paths as a published card names them: an absolute one by as few of its last parts as tell it from the others
    ('train.jsonl', or 'en/train.jsonl' and 'de/train.jsonl'; not '/home/alice/project/...': a card is pushed to the Hub
    as written), a relative one as the config has it."""
    absolute = {Path(p).parts for p in paths if Path(p).is_absolute()}
    k = next(
        (k for k in range(1, max(map(len, absolute), default=1)) if len({a[-k:] for a in absolute}) == len(absolute)), 1
    )
    return [str(Path(*Path(p).parts[-k:])) if Path(p).is_absolute() else p for p in paths]


def card_paths(value):
    """`value` (a config as dicts and lists) with its absolute paths named as `card_names` does."""
    if isinstance(value, dict):
        return {key: card_paths(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return card_names(list(value))
    if isinstance(value, (list, tuple)):
        return [card_paths(v) for v in value]
    return card_names([value])[0] if isinstance(value, str) else value


def model_card(
    model_cfg: ModelConfig,
    num_params: int,
    card: dict,
    hf_class: str = "BertForMaskedLM",
    arch: str = "bert",
    role: Card | None = None,
) -> str:
    """README.md: YAML front matter for the Hub, then what was trained, on what, for how long. `role` says what
    this directory holds where it differs from a fill-mask model (ELECTRA's discriminator and generator)."""
    role = role or Card()
    front, described = _front_matter(card, arch, role)
    final_loss = card.get("final_loss")
    loss_text = f"{final_loss:.4f}" if isinstance(final_loss, float) else str(_card_value(card, "final_loss"))
    if card.get("final_loss_step") not in (None, card.get("steps")):  # saved between log lines: say whose it is
        loss_text += f" (the last log line before the checkpoint, at step {card['final_loss_step']:,})"
    if card.get("final_loss_of_training_weights") and final_loss is not None:
        loss_text += " (the training weights' loss as logged, not that of these moving-average weights)"
    corpus = _card_value(card, "corpus")
    if isinstance(corpus, (list, tuple)):
        corpus = ", ".join(map(str, corpus))
    # through JSON so that paths, numpy scalars and the like become plain YAML
    plain_config = json.loads(json.dumps(card.get("config") or {}, default=str))
    config_yaml = yaml.safe_dump(plain_config, sort_keys=False).strip() if plain_config else "unknown"
    name = _card_value(card, "run_name")
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {name}",
        "",
        role.intro or intro_line(arch, hf_class, bool(card.get("init_from"))),
        "",
        *([f"Notes: {'; '.join(notes)}.", ""] if (notes := [*(card.get("notes") or []), *role.notes]) else []),
        "## Training",
        "",
        f"- Objective(s): {'; '.join(described)}",
        *([f"- Initialised from: {card['init_from']} (`model.init_from`)"] if card.get("init_from") else []),
        f"- Data: {corpus}",
        *([f"- Data provenance: {card['provenance']}"] if card.get("provenance") else []),
        f"- Tokens seen: {_fmt_int(_card_value(card, 'tokens_seen'))}",
        f"- Steps: {_fmt_int(_card_value(card, 'steps'))}",
        f"- Final loss: {loss_text}",
        f"- Exported: {datetime.date.today().isoformat()}",
        "",
        "## Model",
        "",
        f"- Parameters: {num_params:,}",
        f"- Layers: {model_cfg.num_layers}, hidden size: {model_cfg.hidden_size}, "
        f"heads: {model_cfg.num_heads}, intermediate size: {model_cfg.intermediate_size}",
        f"- Vocabulary: {model_cfg.vocab_size}, max positions: {model_cfg.max_position_embeddings}",
        "",
        "## Training configuration",
        "",
        "```yaml",
        config_yaml,
        "```",
        "",
    ]
    return "\n".join(lines) + "\n" + (role.usage or _FILL_MASK_USAGE)
