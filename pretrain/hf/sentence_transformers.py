"""Turn an exported HuggingFace directory into a sentence-transformers model directory.

`SentenceTransformer(out_dir)` loads what this writes, offline; sentence-transformers itself is not needed to write
it. The layout is the one sentence-transformers has saved since v2, which every release since reads (v6 included):

- at the top, module 0, `Transformer`: the encoder as its HF base class saves it (config.json and
  model.safetensors, without the pretraining heads and pooler), the export's tokenizer files, and
  sentence_bert_config.json (max_seq_length); it loads them with `AutoModel`;
- 1_Pooling/config.json: module 1, mean over the real tokens or the [CLS] vector;
- 2_Normalize/ (no files): module 2, L2 normalisation, only when asked for;
- modules.json (the modules in order), config_sentence_transformers.json (model-level settings) and README.md.

The embeddings are the pretrained encoder's pooled states: no similarity fine-tuning happens here.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from data_pipeline.tokenizer import TOKENIZER_FILES
from pretrain.core.errors import UserError
from pretrain.core.outputs import MARKER
from pretrain.hf.export import check_model_dir, position_limit, replace_output
from pretrain.hf.hub import upload_patterns

POOLINGS = ("mean", "cls")
KIND = "sentence-transformers"  # the output kind in pretrain.core.outputs
# What the conversion writes: a conversion again replaces these (and removes those it no longer writes, 2_Normalize)
ENTRIES = frozenset(
    {
        *TOKENIZER_FILES,
        "config.json",
        "model.safetensors",
        "sentence_bert_config.json",
        "1_Pooling",
        "2_Normalize",
        "modules.json",
        "config_sentence_transformers.json",
        "README.md",
        MARKER,
    }
)
# The exact files a conversion writes, as `pretrain export --push-to-hub` uploads them (2_Normalize holds none)
HUB_FILES = upload_patterns(ENTRIES, {"1_Pooling": ["config.json"], "2_Normalize": []})

# Module class references as saved models name them; sentence-transformers >= 6 maps these to its new locations.
_MODULES = {
    "transformer": "sentence_transformers.models.Transformer",
    "pooling": "sentence_transformers.models.Pooling",
    "normalize": "sentence_transformers.models.Normalize",
}
_MODEL_FILES = ("config.json", "model.safetensors")  # what an export holds beside its tokenizer


def _read_hf_config(hf_dir: Path) -> dict:
    missing = [n for n in (*_MODEL_FILES, "tokenizer.json") if not (hf_dir / n).is_file()]
    if missing:
        raise UserError(
            f"{hf_dir} is not an exported HuggingFace model directory (missing {', '.join(missing)}): give the "
            "directory `pretrain export` wrote (for an ELECTRA run, the discriminator's, not generator/)"
        )
    check_model_dir(hf_dir)
    try:
        config = json.loads((hf_dir / "config.json").read_text())
    except ValueError as err:
        raise UserError(f"{hf_dir / 'config.json'}: not valid JSON ({err})") from None
    if not isinstance(config.get("hidden_size"), int):
        raise UserError(f"{hf_dir / 'config.json'}: no integer hidden_size, so not an encoder this tool exported")
    return config


def default_max_seq_length(hf_dir: Path, config: dict) -> int:
    """The tokenizer's model_max_length where it is a real limit (tokenizers without one store ~1e30), capped at what
    the position table allows."""
    limit = position_limit(config)
    try:
        declared = json.loads((hf_dir / "tokenizer_config.json").read_text()).get("model_max_length")
    except (OSError, ValueError):
        declared = None
    if isinstance(declared, (int, float)) and 0 < declared < limit:
        return int(declared)
    return limit


def _versions() -> dict[str, str]:
    """Versions of the libraries at hand, recorded as sentence-transformers records them; those not installed are
    left out (sentence-transformers warns only when the recorded version is newer than its own)."""
    found = {}
    for key, dist in (("sentence_transformers", "sentence-transformers"), ("transformers", "transformers")):
        try:
            found[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        found["pytorch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    return found


def model_card(
    name: str, config: dict, pooling: str, normalize: bool, max_seq_length: int, model_args: dict | None = None
) -> str:
    pooled = "the mean of the token states over the real tokens" if pooling == "mean" else "the [CLS] token's state"
    lines = [
        "---",
        "library_name: sentence-transformers",
        "pipeline_tag: sentence-similarity",
        "tags:",
        "- sentence-transformers",
        "- feature-extraction",
        "- sentence-similarity",
        f"- {config.get('model_type', 'encoder')}",
        "---",
        "",
        f"# {name}",
        "",
        f"A pretrained {config.get('model_type', 'encoder')} encoder packaged for sentence-transformers: each text's "
        f"embedding is {pooled} of the last layer" + (", scaled to unit length." if normalize else "."),
        "",
        "It was pretrained (its objectives: the card of the export it was converted from) and not fine-tuned for "
        "similarity, so its embeddings are a starting point for fine-tuning (or for probes) rather than a tuned "
        "similarity model.",
        "",
        "## Model",
        "",
        f"- Embedding size: {config['hidden_size']}",
        f"- Layers: {config.get('num_hidden_layers', 'unknown')}, attention heads: "
        f"{config.get('num_attention_heads', 'unknown')}",
        f"- Maximum input length: {max_seq_length} tokens (longer texts are truncated)",
        f"- Pooling: {pooling}" + (", then L2 normalisation" if normalize else ""),
        "",
        "## Usage",
        "",
        "```python",
        "from sentence_transformers import SentenceTransformer",
        "",
        'model = SentenceTransformer("path/to/this/directory")',
        'embeddings = model.encode(["The Union is strong.", "The state of the Union is sound."])',
        "print(embeddings.shape)",
        "print(model.similarity(embeddings, embeddings))",
        "```",
        "",
        "The encoder is also a plain HuggingFace model: `transformers.AutoModel.from_pretrained(directory"
        + "".join(f", {k}={v!r}" for k, v in (model_args or {}).items())
        + ")`.",
        "",
    ]
    return "\n".join(lines)


def export_sentence_transformers(
    hf_dir: str | Path,
    out_dir: str | Path,
    pooling: str = "mean",
    normalize: bool = False,
    max_seq_length: int | None = None,
) -> Path:
    """Write a directory `SentenceTransformer(out_dir)` loads, from the HF export in `hf_dir` (what `pretrain export`
    wrote; for ELECTRA the discriminator's directory). `pooling`: mean (over the real tokens) or cls; `normalize`
    adds L2 normalisation; `max_seq_length` (longer inputs are truncated) defaults to the tokenizer's
    model_max_length capped by the position table (pass the run's data.max_seq_len to keep to what it trained on).

    out_dir must be absent, empty or an earlier output of this function, and not hold `hf_dir`. It is written as an
    export is (`replace_output`): never half written, a symlink written through, and the entries this function does
    not write (the user's) kept. Returns out_dir, symlinks resolved."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if pooling not in POOLINGS:
        raise UserError(f"pooling '{pooling}' is not one of {', '.join(POOLINGS)}")
    config = _read_hf_config(hf_dir)
    limit = position_limit(config)
    if max_seq_length is None:
        max_seq_length = default_max_seq_length(hf_dir, config)
    elif not 2 <= max_seq_length <= limit:  # [CLS] and [SEP] at least; positions beyond the table do not exist
        raise UserError(f"max_seq_length {max_seq_length} is outside 2..{limit}, the lengths {hf_dir} can encode")
    name = _model_name(hf_dir, out_dir)
    return replace_output(
        out_dir,
        KIND,
        ENTRIES,
        lambda tmp: _write(tmp, hf_dir, config, pooling, normalize, max_seq_length, name),
        {"the HF export being converted": hf_dir},
        "--st-out",
    )


def _write(
    where: Path, hf_dir: Path, config: dict, pooling: str, normalize: bool, max_seq_length: int, name: str
) -> None:
    # Module 0 saves in the top directory (sentence-transformers' `save_in_root`): AutoModel and the tokenizer load
    # from there
    encoder_config, state, model_args = encoder_checkpoint(hf_dir, config)
    _write_json(where / "config.json", encoder_config)
    save_file(state, where / "model.safetensors", metadata={"format": "pt"})
    for file in TOKENIZER_FILES:  # as the export wrote them: its tokenizer_config suits its architecture
        if (hf_dir / file).is_file():
            shutil.copy2(hf_dir / file, where / file)
    # do_lower_case would lowercase again before the tokenizer, which does its own normalisation
    bert_config = {"max_seq_length": max_seq_length, "do_lower_case": False}
    if model_args:
        bert_config["model_args"] = model_args  # read by every release (>= 6 renames it model_kwargs on load)
    _write_json(where / "sentence_bert_config.json", bert_config)

    # Pooling's saved keys (one flag per mode): read by every release, sentence-transformers >= 6 included
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    chosen = {"mean": "mean_tokens", "cls": "cls_token"}[pooling]
    pooling_config = {"word_embedding_dimension": config["hidden_size"]}
    pooling_config.update({f"pooling_mode_{mode}": mode == chosen for mode in modes})
    pooling_config["include_prompt"] = True
    (where / "1_Pooling").mkdir()
    _write_json(where / "1_Pooling" / "config.json", pooling_config)

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": _MODULES["transformer"]},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": _MODULES["pooling"]},
    ]
    if normalize:
        (where / "2_Normalize").mkdir()  # Normalize has no settings: an empty folder, as sentence-transformers saves it
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": _MODULES["normalize"]})
    _write_json(where / "modules.json", modules)
    _write_json(
        where / "config_sentence_transformers.json",
        {
            "__version__": _versions(),
            "model_type": "SentenceTransformer",
            "prompts": {},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    )
    (where / "README.md").write_text(model_card(name, config, pooling, normalize, max_seq_length, model_args))


def encoder_checkpoint(hf_dir: Path, config: dict) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """The export's encoder alone, as its base HF class (BertModel, ElectraModel, ...) saves it: the pretraining
    heads and the pooler are left out, since sentence-transformers runs `AutoModel` and pools the token states itself;
    kept, they load as unexpected or newly initialised weights, which AutoModel reports as if something were wrong.
    Returns (config.json, weights, the keyword arguments AutoModel needs to build the class without a pooler)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    base_name = MODEL_MAPPING_NAMES.get(config.get("model_type", ""))
    base = getattr(transformers, base_name, None) if base_name else None
    if base is None:
        raise UserError(f"{hf_dir / 'config.json'}: model_type {config.get('model_type')!r} has no HF base model class")
    prefix = base.base_model_prefix + "."
    pooler = "add_pooling_layer" in inspect.signature(base.__init__).parameters
    state = {
        key.removeprefix(prefix): tensor
        for key, tensor in load_file(hf_dir / "model.safetensors").items()
        if key.startswith(prefix) and not (pooler and key.startswith(prefix + "pooler."))
    }
    if not state:
        raise UserError(f"{hf_dir / 'model.safetensors'}: no weights under '{prefix}', the {base_name} encoder")
    return {**config, "architectures": [base_name]}, state, ({"add_pooling_layer": False} if pooler else {})


def _model_name(hf_dir: Path, out_dir: Path) -> str:
    """The export's model card title (the run's name), else the output directory's name."""
    try:
        lines = (hf_dir / "README.md").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    return next((line[2:].strip() for line in lines if line.startswith("# ") and line[2:].strip()), out_dir.name)


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
