"""Export a trained model as a complete HuggingFace `save_pretrained` directory, and check it.

Which architecture is written follows from the model's options and heads (`pretrain.hf.interop.select_architecture`):
bert (BertForPreTraining with an nsp head, else BertForMaskedLM), roberta (--arch roberta), albert, modernbert;
ELECTRA (rtd) runs go through `export_electra`. Weight names come from the one table per architecture in
`pretrain.hf.interop`, used in both directions.

The layout `save_pretrained` writes, which we reproduce (transformers 5.x):
- config.json with the class in `architectures` and tie_word_embeddings true;
- model.safetensors WITHOUT the tied decoder (`cls.predictions.decoder.*`, `lm_head.decoder.*`, ...): HF
  re-ties it on load (to the word embeddings and to the head's bias) and `save_pretrained` drops it, so do we;
- no `*.embeddings.position_ids` / `token_type_ids`: they are non-persistent buffers;
- a pooler only in the *ForPreTraining classes (the *ForMaskedLM ones build their base model without one);
- the tokenizer files of the run, and README.md (model card).
"""

from __future__ import annotations

import copy
import datetime
import errno
import json
import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file
from torch import nn

from data_pipeline.tokenizer import TOKENIZER_FILES, copy_tokenizer_files
from pretrain.core.config import ModelConfig
from pretrain.core.errors import UserError
from pretrain.core.outputs import MARKER, check_not_input, claim_output, exclusive_waiting, mark_output, marked_kind
from pretrain.core.tokens import SpecialTokens
from pretrain.hf import interop as hf

_ARCH_TITLE = {
    "bert": "BERT",
    "roberta": "RoBERTa",
    "albert": "ALBERT",
    "electra": "ELECTRA",
    "modernbert": "ModernBERT",
}


class ExportError(RuntimeError):
    """The exported directory does not reproduce the model: a bug in the export, not a user mistake."""


# ----------------------------------------------------------------------------------------------
# BERT's names (the tables of every architecture live in pretrain.hf.interop)


def lm_head_name(model: nn.Module) -> str:
    """Dotted name of the token-prediction head tied to the encoder's word embeddings, wherever the
    objective keeps it (heads.mlm, heads.span.mlm, heads.plm, ...): the head a *ForMaskedLM export gets."""
    name = hf.lm_head_name(model)
    if name is None:
        raise UserError(
            f"BertForMaskedLM export needs a token-prediction objective (mlm, span, plm); this model "
            f"has heads {sorted(model.heads) or 'none'}"
        )
    return name


# ----------------------------------------------------------------------------------------------
# The export directory


def _card_value(card: dict, key: str) -> Any:
    value = card.get(key)
    return "unknown" if value is None or value == "" else value


def _fmt_int(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def intro_line(arch: str, hf_class: str, init_from: bool) -> str:
    how = "pretrained further from a HuggingFace checkpoint" if init_from else "pretrained from scratch"
    return f"A {_ARCH_TITLE.get(arch, arch)} encoder {how}, exported as `{hf_class}`."


def model_card(
    model_cfg: ModelConfig, num_params: int, card: dict, hf_class: str = "BertForMaskedLM", arch: str = "bert"
) -> str:
    """README.md: YAML front matter for the Hub, then what was trained, on what, for how long."""
    objectives = card.get("objectives") or ["unknown"]
    if isinstance(objectives, dict):  # {name: options}: list each with its options
        described = [
            f"{name} ({', '.join(f'{k}={v}' for k, v in (opts or {}).items())})" for name, opts in objectives.items()
        ]
        objectives = list(objectives)
    else:
        described = list(map(str, objectives))
    front: dict[str, Any] = {
        "library_name": "transformers",
        "pipeline_tag": "fill-mask",
        "language": ["en"],
        "tags": [arch, "fill-mask", "pretraining", *map(str, objectives)],
    }
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
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {name}",
        "",
        intro_line(arch, hf_class, bool(card.get("init_from"))),
        "",
        *([f"Notes: {'; '.join(card['notes'])}.", ""] if card.get("notes") else []),
        "## Training",
        "",
        f"- Objective(s): {'; '.join(described)}",
        *([f"- Initialised from: {card['init_from']} (`model.init_from`)"] if card.get("init_from") else []),
        f"- Data: {corpus}",
        f"- Data provenance: {_card_value(card, 'provenance')}",
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
    return "\n".join(lines)


# What an export writes into its directory; on a re-export these are replaced (or removed when the new export has no
# such entry, e.g. generator/ after an ELECTRA export) and every other entry, the user's, is left alone.
EXPORT_ENTRIES = frozenset({*TOKENIZER_FILES, "config.json", "model.safetensors", "README.md", "generator", MARKER})
TMP = ".tmp-export"  # inside the export directory: the same file system, and no need to write to its parent


def _remove_leftover(path: Path) -> None:
    """A temporary directory a crashed export left: removed only if it carries our marker (or is empty: a crash
    before the marker was written)."""
    if path.exists():
        if marked_kind(path) != "export" and any(path.iterdir()):
            raise UserError(
                f"{path} is in the way of the export (this tool uses that name for its temporary "
                "directory, and did not write it): move it away"
            )
        shutil.rmtree(path)


def _install(new: Path, dest: Path) -> None:
    """Move each entry the export wrote from `new` into `dest`, file by file (each os.replace atomic), and take
    away the entries an earlier export wrote that this one does not; whatever else `dest` holds stays."""
    dest.mkdir(exist_ok=True)
    written = sorted(new.iterdir())
    for entry in written:
        if entry.name == MARKER:
            continue  # `dest` is marked already; the temporary directory keeps its own until it goes
        target = dest / entry.name
        if entry.is_dir():
            if target.is_symlink() or (target.exists() and not target.is_dir()):
                target.unlink()
            _install(entry, target)
        else:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(entry, target)
    for stale in EXPORT_ENTRIES - {MARKER} - {p.name for p in written}:
        _remove_ours(dest / stale)


def _remove_ours(path: Path) -> None:
    """Remove an entry an earlier export wrote, keeping what the user put inside it (then the folder stays)."""
    if path.is_dir() and not path.is_symlink():
        for inner in EXPORT_ENTRIES & {p.name for p in path.iterdir()}:
            _remove_ours(path / inner)
        if not any(path.iterdir()):
            path.rmdir()
    elif path.is_file() or path.is_symlink():
        path.unlink()


def _remove_old_leftovers(out_dir: Path) -> None:
    """What an earlier version, which swapped whole directories, left beside out_dir when it crashed: only
    directories of ours (marked, or empty), never a link (that version renamed a symlinked --out to .old-NAME)."""
    for name in (".tmp-" + out_dir.name, ".old-" + out_dir.name):
        path = out_dir.parent / name
        try:
            if path.is_dir() and not path.is_symlink() and (marked_kind(path) == "export" or not any(path.iterdir())):
                shutil.rmtree(path, ignore_errors=True)
        except OSError:  # tidying only: the export itself is done
            pass


def write_hf_dir(
    out_dir: Path,
    parts: list[tuple[str, Any, dict[str, torch.Tensor], str]],
    tokenizer_dir: Path,
    inputs: dict[str, Path] | None = None,
    check: Callable[[Path], Any] | None = None,
) -> Path:
    """Write each part (subdirectory, HF config, HF state dict, README text) with the tokenizer files into a
    temporary directory, run `check` on it (the parity check: it raises if the export does not reproduce the
    model), and only then move the new files into out_dir, over the previous export's; files the export does not
    write (the user's notes, a fine-tuned model in a subfolder) are kept. A failure before that move, the check's
    included, leaves out_dir as it was. Returns out_dir, symlinks resolved (a link is written through, and kept).

    out_dir must be absent, empty or an export of ours (`outputs.claim_output`), and neither one of `inputs`
    (description -> path; the tokenizer directory always counts) nor a directory holding one."""
    given = Path(out_dir)
    check_not_input(given, {**(inputs or {}), "the tokenizer directory": tokenizer_dir})
    claim_output(given, "export", "--out")
    out_dir = given.resolve()  # `.`, `..` and symlinks: the directory the user means, written in place
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_waiting(out_dir, "exporting"):
            mark_output(out_dir, "export")
            tmp = out_dir / TMP
            _remove_leftover(tmp)  # left by an export that crashed
            mark_output(tmp, "export")
            try:
                for sub, config, state, readme in parts:
                    where = tmp / sub
                    copy_tokenizer_files(tokenizer_dir, where, config)  # pairs typed as this architecture's
                    config.save_pretrained(where)  # writes config.json
                    save_file(state, where / "model.safetensors", metadata={"format": "pt"})  # what HF's loader expects
                    (where / "README.md").write_text(readme)
                if check is not None:
                    check(tmp)
                _install(tmp, out_dir)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            _remove_old_leftovers(out_dir)
    except BaseException as err:
        if created and out_dir.is_dir() and not [p for p in out_dir.iterdir() if p.name != MARKER]:
            shutil.rmtree(out_dir, ignore_errors=True)  # nothing exported: leave no trace of the attempt
        if isinstance(err, ExportError):
            raise ExportError(f"{err}; nothing was written to {given}, which is as it was") from None
        if isinstance(err, OSError) and err.errno != errno.ENOSPC:  # a full disk has its own message in the CLI
            raise UserError(
                f"cannot export to --out {given}: {err.strerror or err} ({err.filename or out_dir})"
            ) from None
        raise
    return out_dir


def check_tokenizer_dir(tokenizer_dir: str | Path) -> Path:
    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise UserError(f"tokenizer directory {tokenizer_dir} is missing or has no tokenizer.json")
    return tokenizer_dir


def export_pretrained(
    model: nn.Module,
    tokens: SpecialTokens,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    card: dict,
    arch: str | None = None,
    inputs: dict[str, Path] | None = None,
    check: Callable[[Path], Any] | None = None,
) -> Path:
    """Write a `from_pretrained`-loadable directory (config, safetensors, tokenizer, README) of the HF class
    `select_architecture` picks for this model (`arch` forces bert / roberta / albert / modernbert); returns
    it. `check` runs on the finished export before it replaces anything (`write_hf_dir`), e.g.
    `lambda d: verify_export(model, d)`. ELECTRA (rtd) runs: `pretrain.hf.electra.export_electra`."""
    tokenizer_dir, out_dir = check_tokenizer_dir(tokenizer_dir), Path(out_dir)
    target = hf.select_architecture(model, arch)
    if target.arch == "electra":
        raise UserError(
            "export_pretrained needs a token-prediction head (mlm, span, plm); an rtd (ELECTRA) run "
            "is exported by export_electra, as `pretrain export` does"
        )
    config = hf.hf_config(model, target, tokens)
    state = hf.to_hf_state_dict(model, target.arch)
    num_params = sum(t.numel() for t in state.values())  # tied decoder not in `state`: counted once
    card = {**card, "notes": list(card.get("notes") or []) + list(target.notes)}
    readme = model_card(model.config, num_params, card, target.hf_class, target.arch)
    return write_hf_dir(out_dir, [("", config, state, readme)], tokenizer_dir, inputs, check)


# ----------------------------------------------------------------------------------------------
# Verification


def _probe_batch(cfg: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed batch of 3 x L: random ids (never the pad id at a real token: RoBERTa numbers positions by
    counting non-pad tokens), both token types, and rows with trailing padding."""
    gen = torch.Generator().manual_seed(seed)
    length = min(16, cfg.max_position_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (3, length), generator=gen)
    ids[ids == cfg.pad_token_id] = (cfg.pad_token_id + 1) % cfg.vocab_size
    types = torch.zeros_like(ids)
    types[:, length // 2 :] = min(1, max(cfg.type_vocab_size, 1) - 1)
    mask = torch.ones_like(ids)
    mask[1, length - 5 :] = 0
    mask[2, length // 3 :] = 0
    ids[mask == 0] = cfg.pad_token_id
    return ids, types, mask


def load_hf(path: str | Path, hf_class: str | None = None) -> nn.Module:
    """transformers' class for the export in `path` (config.json's architectures[0] by default), fp32, eval;
    missing or unexpected weights are an ExportError."""
    import transformers

    path = Path(path)
    hf_class = hf_class or json.loads((path / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, hf_class).from_pretrained(
        str(path), output_loading_info=True, dtype=torch.float32
    )
    problems = {k: sorted(v) for k, v in info.items() if v and k != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise ExportError(
            f"{path}: transformers loaded the export with problems: {problems} {info.get('error_msgs') or ''}"
        )
    return model.eval()


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
def compare_with_hf(model: nn.Module, hf_model: nn.Module, arch: str) -> dict[str, float]:
    """Max abs differences between ours and `hf_model` on the probe batch (with padding), fp32:
    "hidden" (last hidden state of the base model), "logits" (MLM), and "nsp"/"sop" logits where both have
    that head. Padded positions are compared too (both models mask keys only), except for RoBERTa, which
    gives padding its own position id: there real tokens only."""
    with fp32_eval(model) as ours:
        device = next(ours.parameters()).device
        ids, types, mask = _probe_batch(ours.config)
        uses_types = arch != "modernbert"  # ModernBERT has no token types (ours are then all type 0)
        our_types = types if uses_types else torch.zeros_like(types)
        hidden = ours.encoder(ids.to(device), our_types.to(device), mask.to(device))
        expected = {"hidden": hidden.cpu(), "logits": ours.get_submodule(lm_head_name(ours))(hidden).cpu()}
        for sentence in ("nsp", "sop"):
            if sentence in ours.heads:
                expected[sentence] = ours.heads[sentence](hidden).cpu()
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
    real = mask.bool() if arch == "roberta" else torch.ones_like(mask, dtype=torch.bool)
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
