"""Applying a table, both ways, and reading a checkpoint's weights. `to_hf` and `from_hf` are the only two functions
that read tables; nothing else renames weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pretrain.core.errors import UserError
from pretrain.hf.architectures.base import Link, Table, get


def to_hf(table: Table, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names: fp32, CPU, contiguous, unshared (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    for link in table:
        tensor = ours[link.ours].detach().to("cpu", torch.float32)
        if link.offset:
            tensor = torch.cat([tensor.new_zeros((link.offset, *tensor.shape[1:])), tensor])
        for hf_name, part in zip(link.hf, tensor.chunk(len(link.hf), dim=0)):
            part = part.contiguous().clone()
            if hf_name in out and not torch.equal(out[hf_name], part):  # shared layers must really be shared
                raise UserError(f"{link.ours} and another of our tensors both map to {hf_name} but differ")
            out[hf_name] = part
    return out


def from_hf(
    table: Table, hf_sd: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], where: str
) -> tuple[dict[str, torch.Tensor], list[Link]]:
    """HF state dict -> our names, as far as it goes: (our tensors, the links whose HF tensors are absent).
    A link half present, or a shape that differs from our model's, is an error naming both sides."""
    out, absent = {}, []
    for link in table:
        present = [h in hf_sd for h in link.hf]
        if not any(present):
            absent.append(link)
            continue
        if not all(present):
            raise UserError(
                f"{where}: has {[h for h, p in zip(link.hf, present) if p]} but not "
                f"{[h for h, p in zip(link.hf, present) if not p]}"
            )
        tensor = torch.cat([hf_sd[h] for h in link.hf], dim=0) if len(link.hf) > 1 else hf_sd[link.hf[0]]
        if link.offset:
            tensor = tensor[link.offset :]
        want = ref[link.ours].shape
        if tensor.shape != want:
            raise UserError(
                f"{where}: {' + '.join(link.hf)} has shape {tuple(tensor.shape)}"
                f"{f' after dropping {link.offset} leading rows' if link.offset else ''}, our "
                f"{link.ours} has {tuple(want)}: the model config does not match the checkpoint"
            )
        out[link.ours] = tensor.to(ref[link.ours].dtype)
    return out, absent


def fill_aliases(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the names of tied parameters (heads.mlm.decoder_weight is the word-embedding Parameter, shared
    layers appear under every index) so `load_state_dict(strict=True)` accepts `state`."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    out = dict(state)
    for names in groups.values():
        source = next((n for n in names if n in state), None)
        if source is not None:
            for n in names:
                out.setdefault(n, state[source])
    return out


def to_hf_state_dict(model: nn.Module, arch: str) -> dict[str, torch.Tensor]:
    """Our model under `arch`'s HF names (heads the model has and `arch` can hold), fix-ups included."""
    record = get(arch)
    out = to_hf(record.table(model), model.state_dict())
    if record.export_fixup is not None:
        record.export_fixup(model, out)
    return out


def from_hf_state_dict(
    hf_sd: dict[str, torch.Tensor], model: nn.Module, arch: str, where: str = "checkpoint", table: Table | None = None
) -> tuple[dict[str, torch.Tensor], list[Link], list[str]]:
    """(our tensors incl. tied aliases, our links absent from the checkpoint, checkpoint keys not used)."""
    record = get(arch)
    check_tied_decoder(record, hf_sd, where)
    table = record.table(model) if table is None else table
    state, absent = from_hf(table, hf_sd, model.state_dict(), where)
    used = {h for link in table for h in link.hf} | set(record.tied)
    if record.import_fixup is not None:
        used |= record.import_fixup(model, hf_sd, state, where)
    unused = sorted(k for k in hf_sd if k not in used)
    return fill_aliases(model, state), absent, unused


def check_tied_decoder(record, hf_sd: dict[str, torch.Tensor], where: str) -> None:
    """Refuse a checkpoint whose decoder is not its input embeddings: ours decodes with the embeddings, so its own
    decoder, counted as tied, was dropped unsaid (MLM logits off by ~10 on a random BERT)."""
    if record.decoder is None:
        return
    decoder, embeddings = record.decoder
    if decoder in hf_sd and embeddings in hf_sd and not torch.equal(hf_sd[decoder], hf_sd[embeddings]):
        raise UserError(
            f"{where}: the checkpoint's MLM decoder ({decoder}) is not tied to its input embeddings ({embeddings}; "
            "config tie_word_embeddings=false): our model decodes with the input embeddings and cannot hold a decoder "
            "of its own"
        )


def normalise(sd: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """A bare base model (BertModel, ModernBertModel, ...) saves its keys without the base prefix: add it."""
    prefix = get(arch).prefix + "."
    if any(k.startswith(prefix) for k in sd):
        return sd
    return {prefix + k: v for k, v in sd.items()}


def read_hf_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """model.safetensors / pytorch_model.bin of a save_pretrained directory, sharded or not, on CPU."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for index_name, loader in (
        ("model.safetensors.index.json", load_file),
        ("pytorch_model.bin.index.json", _load_bin),
    ):
        if (directory / index_name).is_file():
            files = sorted(set(json.loads((directory / index_name).read_text())["weight_map"].values()))
            sd = {}
            for f in files:
                sd.update(loader(str(directory / f)))
            return sd
    if (directory / "model.safetensors").is_file():
        return load_file(str(directory / "model.safetensors"))
    if (directory / "pytorch_model.bin").is_file():
        return _load_bin(str(directory / "pytorch_model.bin"))
    raise UserError(f"model.init_from: {directory} has no model.safetensors or pytorch_model.bin")


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)  # weights only: no pickled code runs
