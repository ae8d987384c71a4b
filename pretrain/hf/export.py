"""Export a trained model as a complete HuggingFace `save_pretrained` directory, and check it.

Which architecture is written follows from the model's options and heads (`pretrain.hf.interop.select_architecture`
over the registry of `pretrain.hf.architectures`); `export_hf` writes each directory (`Part`) its record gives: one
for bert / roberta / albert / modernbert, two for ELECTRA (discriminator, generator/). Weight names come from the
record's table, used in both directions; the model card from one template (`pretrain.hf.card`).

The layout `save_pretrained` writes, which we reproduce (transformers 5.x):
- config.json with the class in `architectures` and tie_word_embeddings true;
- model.safetensors WITHOUT the tied decoder (`cls.predictions.decoder.*`, `lm_head.decoder.*`, ...): HF
  re-ties it on load (to the word embeddings and to the head's bias) and `save_pretrained` drops it, so do we;
- no `*.embeddings.position_ids` / `token_type_ids`: they are non-persistent buffers;
- a pooler only in the *ForPreTraining classes (the *ForMaskedLM ones build their base model without one);
- the tokenizer files of the run (a BPE or Unigram [MASK] taking the space before it, as RoBERTa's <mask>), and
  README.md (model card).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from data_pipeline.tokenizer import (
    SOURCE_FILE,
    TOKENIZER_FILES,
    copy_tokenizer_files,
    join_lines_as_the_pipeline,
    record_source,
    strip_space_before_mask,
)
from pretrain.core.errors import UserError
from pretrain.core.files import fsync_path, sync_tree, write_atomic
from pretrain.core.outputs import (
    MARKER,
    check_not_input,
    check_output_place,
    claim_output,
    exclusive_waiting,
    mark_output,
    marked_kind,
)
from pretrain.core.tokens import SpecialTokens
from pretrain.hf import interop as hf
from pretrain.hf.architectures import Part, Target, get
from pretrain.hf.card import intro_line, model_card
from pretrain.hf.parity import (
    ExportError,
    compare_with_hf,
    fp32_eval,
    lm_head_name,
    load_hf,
    probe_batch,
    verify_export,
)

_probe_batch = probe_batch  # the name tests and benchmarks know
__all__ = [
    "ExportError",
    "compare_with_hf",
    "export_hf",
    "export_pretrained",
    "fp32_eval",
    "intro_line",
    "lm_head_name",
    "load_hf",
    "model_card",
    "verify_export",
    "verify_parts",
]


# ----------------------------------------------------------------------------------------------
# The export directory


# What an export writes into its directory; on a re-export these are replaced (or removed when the new export has no
# such entry, e.g. generator/ after an ELECTRA export) and every other entry, the user's, is left alone.
EXPORT_ENTRIES = frozenset(
    {*TOKENIZER_FILES, SOURCE_FILE, "config.json", "model.safetensors", "README.md", "generator", MARKER}
)
TMP = ".tmp-export"  # inside the export directory: the same file system, and no need to write to its parent
# In the export directory while an export replaces its files one by one (`_install`): until it goes, the directory may
# hold the new config beside the old weights, and nothing loads it (`check_model_dir`).
INCOMPLETE = ".export-incomplete"


def check_model_dir(directory: str | Path, what: str = "") -> Path:
    """`directory` as a HuggingFace model directory to load: a UserError (prefixed `what`) where it has no config.json,
    or where an export into it (or into the ELECTRA export above its generator/) stopped while replacing its files."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise UserError(
            f"{what}{directory}: no config.json: not a HuggingFace model directory (export one with `pretrain export`)"
        )
    for where in (directory, directory.parent):
        if (where / INCOMPLETE).exists():
            raise UserError(
                f"{what}{where}: an export into it stopped while replacing its files, so it may hold parts of two "
                "exports: run the same `pretrain export` again"
            )
    _check_readable(directory, what)
    return directory


def _check_readable(directory: Path, what: str) -> None:
    """config.json as JSON, each safetensors file's header and each pytorch_model*.bin's zip directory: a torn or
    truncated one was a JSONDecodeError, SafetensorError or PytorchStreamReader traceback from eval, finetune and
    model.init_from."""
    from safetensors import SafetensorError, safe_open

    try:
        config = json.loads((directory / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{what}{directory / 'config.json'}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise UserError(f"{what}{directory / 'config.json'}: not a model config (a JSON object)")
    for weights in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(weights), "pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise UserError(f"{what}{weights}: truncated or not a safetensors file ({err})") from None
    safetensors = any(directory.glob("model*.safetensors*"))  # what transformers loads first: a .bin beside is unread
    for weights in [] if safetensors else sorted(directory.glob("pytorch_model*.bin")):  # a zip: its directory last
        with open(weights, "rb") as f:
            zipped = f.read(2) == b"PK"  # (torch's legacy pickle format is not checked)
        try:
            if zipped:
                zipfile.ZipFile(weights).close()
        except (zipfile.BadZipFile, OSError) as err:
            raise UserError(f"{what}{weights}: truncated or not a torch weights file ({err})") from None


# What a HuggingFace tokenizer is saved as (a fast one's tokenizer.json, or a slow one's vocabulary): one of these
# beside a model's config.json
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "spm.model",
    "sentencepiece.bpe.model",
    "sentencepiece.model",
    "tokenizer.model",
)


def check_tokenizer(directory: Path, tokens: int | None, vocab_size: int | None) -> None:
    """A model directory's tokenizer, as fine-tuning and eval read it: there (without one, transformers made up a
    5-token tokenizer, every word read [UNK], and the scores were those of nothing), and with no more tokens than the
    model's vocabulary (ids past it failed mid-run with a bare IndexError). `tokens`: its size, None before it is
    loaded."""
    if not any((directory / name).is_file() for name in HF_TOKENIZER_FILES):
        raise UserError(
            f"{directory}: no tokenizer ({', '.join(HF_TOKENIZER_FILES)}) beside the model: save the tokenizer it was "
            "trained with there (`pretrain export` writes it)"
        )
    if tokens is not None and vocab_size and tokens > vocab_size:
        raise UserError(
            f"{directory}: its tokenizer has {tokens:,} tokens, more than the model's vocabulary ({vocab_size:,}): "
            "it is not the tokenizer this model was trained with"
        )


def position_limit(config: dict) -> int:
    """The longest input the encoder's position table allows: RoBERTa's starts after the padding index."""
    limit = int(config.get("max_position_embeddings") or 512)
    if config.get("model_type") == "roberta":
        limit -= int(config.get("pad_token_id") or 0) + 1
    return limit


def _remove_leftover(path: Path, kind: str) -> None:
    """A temporary directory a crashed export left: removed only if it carries our marker (or is empty: a crash
    before the marker was written)."""
    if path.exists():
        if marked_kind(path) != kind and any(path.iterdir()):
            raise UserError(
                f"{path} is in the way of the export (this tool uses that name for its temporary "
                "directory, and did not write it): move it away"
            )
        shutil.rmtree(path)


def _install(new: Path, dest: Path, entries: frozenset[str]) -> None:
    """Move each entry the export wrote from `new` into `dest`, file by file (each os.replace atomic), and take
    away the `entries` an earlier export wrote that this one does not; whatever else `dest` holds stays."""
    dest.mkdir(exist_ok=True)
    written = sorted(new.iterdir())
    for entry in written:
        if entry.name == MARKER:
            continue  # `dest` is marked already; the temporary directory keeps its own until it goes
        target = dest / entry.name
        if entry.is_dir():
            if target.is_symlink() or (target.exists() and not target.is_dir()):
                target.unlink()
            _install(entry, target, entries)
        else:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(entry, target)
    for stale in entries - {MARKER} - {p.name for p in written}:
        _remove_ours(dest / stale, entries)


def _remove_ours(path: Path, entries: frozenset[str]) -> None:
    """Remove an entry an earlier export wrote, keeping what the user put inside it (then the folder stays)."""
    if path.is_dir() and not path.is_symlink():
        for inner in entries & {p.name for p in path.iterdir()}:
            _remove_ours(path / inner, entries)
        if not any(path.iterdir()):
            path.rmdir()
    elif path.is_file() or path.is_symlink():
        path.unlink()


def _remove_old_leftovers(out_dir: Path, kind: str) -> None:
    """What an earlier version, which swapped whole directories, left beside out_dir when it crashed: only
    directories of ours (marked, or empty), never a link (that version renamed a symlinked --out to .old-NAME)."""
    for name in (".tmp-" + out_dir.name, ".old-" + out_dir.name):
        path = out_dir.parent / name
        try:
            if path.is_dir() and not path.is_symlink() and (marked_kind(path) == kind or not any(path.iterdir())):
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
    model), and only then move the new files into out_dir, over the previous export's (`replace_output`).
    Returns out_dir, symlinks resolved.

    out_dir must be absent, empty or an export of ours (`outputs.claim_output`), and neither one of `inputs`
    (description -> path; the tokenizer directory always counts) nor a directory holding one."""

    def write(tmp: Path) -> None:
        for sub, config, state, readme in parts:
            where = tmp / sub
            # pairs typed as this architecture's; no longer inputs than its position table holds
            copy_tokenizer_files(tokenizer_dir, where, config, position_limit(config.to_dict()))
            strip_space_before_mask(where)  # fill-mask input as pretraining masked words
            join_lines_as_the_pipeline(where)  # multi-line input as pretraining read it
            record_source(tokenizer_dir, where)  # the run's shards are this tokenizer's too (`pretrain eval`)
            config.save_pretrained(where)  # writes config.json
            save_file(state, where / "model.safetensors", metadata={"format": "pt"})  # what HF's loader expects
            (where / "README.md").write_text(readme)
        if check is not None:
            check(tmp)

    inputs = {**(inputs or {}), "the tokenizer directory": tokenizer_dir}
    return replace_output(Path(out_dir), "export", EXPORT_ENTRIES, write, inputs, "--out")


def replace_output(
    given: Path, kind: str, entries: frozenset[str], write: Callable[[Path], None], inputs: dict[str, Path], flag: str
) -> Path:
    """Have `write` fill a temporary directory inside `given` (it raises to refuse: `given` is then as it was), then
    move what it wrote into `given`, over the `entries` of the previous output of this `kind`; entries the output does
    not write (the user's notes, a fine-tuned model in a subfolder) are kept. Returns `given`, symlinks resolved (a
    link is written through, and kept). `given` must be absent, empty or an output of this kind, and neither one of
    `inputs` (description -> path) nor a directory holding one; `flag` names it in errors."""
    check_not_input(given, inputs, flag)
    check_output_place(given, inputs, flag)
    claim_output(given, kind, flag)
    out_dir = given.resolve()  # `.`, `..` and symlinks: the directory the user means, written in place
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_waiting(out_dir, "exporting"):
            mark_output(out_dir, kind)
            tmp = out_dir / TMP
            _remove_leftover(tmp, kind)  # left by an export that crashed
            mark_output(tmp, kind)
            try:
                write(tmp)
                sync_tree(tmp)  # the new files on the disk before any replaces an old one
                write_atomic(out_dir / INCOMPLETE, "an export is replacing this directory's files\n")
                _install(tmp, out_dir, entries)
                fsync_path(out_dir)
                (out_dir / INCOMPLETE).unlink()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            _remove_old_leftovers(out_dir, kind)
    except BaseException as err:
        if created and out_dir.is_dir() and not [p for p in out_dir.iterdir() if p.name != MARKER]:
            shutil.rmtree(out_dir, ignore_errors=True)  # nothing exported: leave no trace of the attempt
        if isinstance(err, ExportError):
            raise ExportError(f"{err}; nothing was written to {given}, which is as it was") from None
        if isinstance(err, OSError) and err.errno != errno.ENOSPC:  # a full disk has its own message in the CLI
            raise UserError(
                f"cannot export to {flag} {given}: {err.strerror or err} ({err.filename or out_dir})"
            ) from None
        raise
    return out_dir


def check_tokenizer_dir(tokenizer_dir: str | Path) -> Path:
    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise UserError(f"tokenizer directory {tokenizer_dir} is missing or has no tokenizer.json")
    return tokenizer_dir


def export_parts(model: nn.Module, target: Target, tokens: SpecialTokens) -> list[Part]:
    """The directories `target` writes: the architecture's own parts (ELECTRA's two), or one from its table
    (`interop.to_hf_state_dict`, fix-ups included) and config."""
    record = get(target.arch)
    if record.parts is not None:
        return record.parts(model, target, tokens)
    config = hf.hf_config(model, target, tokens)
    return [Part("", target.hf_class, config, hf.to_hf_state_dict(model, target.arch), model.config)]


def export_hf(
    model: nn.Module,
    tokens: SpecialTokens,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    card: dict,
    arch: str | None = None,
    inputs: dict[str, Path] | None = None,
    check: Callable[[Path], Any] | None = None,
    target: Target | None = None,
) -> tuple[Path, list[Part]]:
    """Write every directory of the HF architecture `select_architecture` picks for this model (`arch` forces
    one), each config + safetensors + tokenizer + README; returns (out_dir, its parts). `check` runs on the
    finished export before it replaces anything (`write_hf_dir`), e.g. `lambda d: verify_parts(model, d, arch)`."""
    tokenizer_dir, out_dir = check_tokenizer_dir(tokenizer_dir), Path(out_dir)
    target = target or hf.select_architecture(model, arch)
    parts = export_parts(model, target, tokens)
    notes = [*(card.get("notes") or []), *(target.notes if len(parts) == 1 else ())]
    card = {**card, "notes": notes}
    written = []
    for part in parts:
        num_params = sum(t.numel() for t in part.state.values())  # tied decoder not in `state`: counted once
        readme = model_card(part.body, num_params, card, part.hf_class, target.arch, part.card)
        written.append((part.subdir, part.config, part.state, readme))
    return write_hf_dir(out_dir, written, tokenizer_dir, inputs, check), parts


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
    """`export_hf` of an architecture written as one directory (bert / roberta / albert / modernbert, or one
    registered later); returns it. An architecture of several directories (ELECTRA: `pretrain.hf.electra`) is
    refused: its parts are not one model."""
    target = hf.select_architecture(model, arch)
    if get(target.arch).parts is not None:
        raise UserError(
            f"export_pretrained needs a token-prediction head (mlm, span, plm); a {target.arch} run "
            "is exported by export_hf (an rtd run by export_electra), as `pretrain export` does"
        )
    return export_hf(model, tokens, tokenizer_dir, out_dir, card, arch, inputs, check, target)[0]


def verify_parts(model: nn.Module, out_dir: str | Path, arch: str) -> dict[str, float]:
    """The parity check of an export of `arch` (its own, or `verify_export`'s): max differences by output."""
    record = get(arch)
    if record.verify is not None:
        return record.verify(model, Path(out_dir))
    return {"logits": verify_export(model, out_dir)}
