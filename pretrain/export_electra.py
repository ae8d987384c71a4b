"""Export an ELECTRA (rtd) run: the discriminator as `ElectraForPreTraining` in out_dir, the generator as
`ElectraForMaskedLM` in out_dir/generator; both complete `from_pretrained` directories, written atomically.

Layout, as `save_pretrained` writes it in transformers 5.x:
- discriminator: embedding_size = hidden_size = H, so no `electra.embeddings_project`;
- generator: embedding_size = H (the shared embeddings), hidden_size = Hg, with `electra.embeddings_project`
  E -> Hg; `generator_lm_head.weight` is tied to the word embeddings and left out (as BERT's decoder is).
The embeddings appear in both files (HF has no cross-model sharing); in disentangled mode the discriminator's
word table is the effective one, shared + delta, and the generator's the shared one.

The encoder layers' names are those of `pretrain.export._weight_map` with `bert.` read as `electra.`: one
table per model below, each used in both directions.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from objectives.base import SpecialTokens
from objectives.rtd import DisentangledWordEmbedding, RTDHead
from pretrain.config import ModelConfig
from pretrain.errors import UserError
from pretrain.export import ExportError, _probe_batch, _replace_dir, _weight_map, model_card

HEAD = "heads.rtd"
WORD = "encoder.embeddings.word_embeddings.weight"
DELTA = "encoder.embeddings.word_embeddings.delta"
GENERATOR_DIR = "generator"
_HF_BUFFERS = ("electra.embeddings.position_ids", "electra.embeddings.token_type_ids")
_TIED = {"generator_lm_head.weight": "electra.embeddings.word_embeddings.weight"}

Pairs = list[tuple[str, tuple[str, ...]]]


def rtd_head(model: nn.Module) -> RTDHead:
    head = model.heads["rtd"] if "rtd" in model.heads else None
    if not isinstance(head, RTDHead):
        raise UserError(f"ELECTRA export needs the rtd objective; this model has heads {sorted(model.heads) or 'none'}")
    return head


def hf_electra_config(model_cfg: ModelConfig, body: ModelConfig, tokens: SpecialTokens, architecture: str) -> Any:
    """ElectraConfig of a body of width `body.hidden_size` on embeddings of width model_cfg.hidden_size.
    HF's "gelu" (GELUActivation, erf form) is our F.gelu; the generator head's GELU is hard-wired in HF."""
    import transformers

    if model_cfg.vocab_size != tokens.vocab_size:
        raise UserError(f"model.vocab_size {model_cfg.vocab_size} != tokenizer vocabulary size {tokens.vocab_size}")
    return transformers.ElectraConfig(
        architectures=[architecture],
        vocab_size=model_cfg.vocab_size,
        embedding_size=model_cfg.hidden_size,
        hidden_size=body.hidden_size,
        num_hidden_layers=body.num_layers,
        num_attention_heads=body.num_heads,
        intermediate_size=body.intermediate_size,
        hidden_act="gelu",
        hidden_dropout_prob=body.hidden_dropout,
        attention_probs_dropout_prob=body.attention_dropout,
        max_position_embeddings=model_cfg.max_position_embeddings,
        type_vocab_size=model_cfg.type_vocab_size,
        initializer_range=model_cfg.initializer_range,
        layer_norm_eps=model_cfg.layer_norm_eps,
        pad_token_id=tokens.pad,
        tie_word_embeddings=True,
        is_decoder=False,
        use_cache=False,
    )


# ----------------------------------------------------------------------------------------------
# The weight maps


def _linear_or_norm(ours: str, hf: str) -> Pairs:
    return [(f"{ours}.{p}", (f"{hf}.{p}",)) for p in ("weight", "bias")]


def _body_pairs(num_layers: int, our_layers: str) -> Pairs:
    """Embeddings + encoder layers: BERT's map with bert.* read as electra.*, our layers under `our_layers`."""
    pairs = []
    for ours, hf in _weight_map(num_layers, head=HEAD):
        if not hf[0].startswith("bert."):
            continue  # BERT's MLM head: ELECTRA's heads are mapped below
        if ours.startswith("encoder.layers."):
            ours = our_layers + ours[len("encoder.layers"):]
        pairs.append((ours, tuple("electra." + h[len("bert."):] for h in hf)))
    return pairs


def discriminator_weight_map(num_layers: int) -> Pairs:
    """(our name, ElectraForPreTraining names); several names = our tensor is their concatenation on dim 0."""
    return (_body_pairs(num_layers, "encoder.layers")
            + _linear_or_norm(f"{HEAD}.dense", "discriminator_predictions.dense")
            + _linear_or_norm(f"{HEAD}.dense_prediction", "discriminator_predictions.dense_prediction"))


def generator_weight_map(num_layers: int) -> Pairs:
    """(our name, ElectraForMaskedLM names). The decoder is the word-embedding Parameter: no entry."""
    gen = f"{HEAD}.generator"
    return (_body_pairs(num_layers, f"{gen}.layers")
            + _linear_or_norm(f"{gen}.embeddings_project", "electra.embeddings_project")
            + _linear_or_norm(f"{gen}.head.dense", "generator_predictions.dense")
            + _linear_or_norm(f"{gen}.head.layer_norm", "generator_predictions.LayerNorm")
            + [(f"{gen}.head.bias", ("generator_lm_head.bias",))])


def _apply(pairs: Pairs, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, hf_names in pairs:
        for hf_name, part in zip(hf_names, ours[name].chunk(len(hf_names), dim=0)):
            # clone: chunks are views of one storage, and safetensors refuses shared tensors
            out[hf_name] = part.detach().to("cpu", torch.float32).contiguous().clone()
    return out


def to_hf_electra_state_dicts(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(ElectraForPreTraining, ElectraForMaskedLM) state dicts of our model: fp32, CPU, unshared."""
    head = rtd_head(model)
    ours = dict(model.state_dict())
    disc_src = dict(ours)
    word = model.encoder.embeddings.word_embeddings
    if isinstance(word, DisentangledWordEmbedding):
        disc_src[WORD] = word.effective_weight().detach()  # what our encoder actually reads
    return (_apply(discriminator_weight_map(model.config.num_layers), disc_src),
            _apply(generator_weight_map(head.generator.config.num_layers), ours))


def from_hf_electra_state_dicts(disc_sd: dict[str, torch.Tensor], gen_sd: dict[str, torch.Tensor],
                                model: nn.Module) -> dict[str, torch.Tensor]:
    """The inverse: a state dict `model.load_state_dict` accepts (strict). The embeddings must agree between
    the two files except, in disentangled mode, the word table, whose difference becomes the delta."""
    head = rtd_head(model)
    disentangled = isinstance(model.encoder.embeddings.word_embeddings, DisentangledWordEmbedding)
    ref = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for what, sd, pairs in (("ElectraForPreTraining", disc_sd, discriminator_weight_map(model.config.num_layers)),
                            ("ElectraForMaskedLM", gen_sd, generator_weight_map(head.generator.config.num_layers))):
        known = {h for _, hf_names in pairs for h in hf_names}
        missing = sorted(known - sd.keys())
        unexpected = sorted(sd.keys() - known - _TIED.keys() - set(_HF_BUFFERS))
        if missing or unexpected:
            raise UserError(f"not the {what} state dict of this model: missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]}")
        for name, hf_names in pairs:
            tensor = torch.cat([sd[h] for h in hf_names], dim=0).to(ref[name].dtype)
            if name.startswith("encoder.embeddings.") and name in out and not (disentangled and name == WORD):
                if not torch.equal(out[name], tensor):
                    raise UserError(f"{name}: the two models' copies differ; ours share one")
                continue
            out[name] = tensor
    if disentangled:  # the discriminator's word table is shared + delta, the generator's (read last) shared
        effective = disc_sd["electra.embeddings.word_embeddings.weight"].to(ref[WORD].dtype)
        out[DELTA] = effective - out[WORD]  # exact up to one float rounding
    out[f"{HEAD}.generator.head.decoder_weight"] = out[WORD]
    return out


# ----------------------------------------------------------------------------------------------
# The export directory


_BERT_INTRO = "A BERT encoder pretrained from scratch, exported as `BertForMaskedLM`."
_DISC_USAGE = "\n".join([
    "## Usage", "",
    "```python",
    "from transformers import AutoTokenizer, ElectraForPreTraining",
    "",
    'tok = AutoTokenizer.from_pretrained("path/to/this/directory")',
    'model = ElectraForPreTraining.from_pretrained("path/to/this/directory")',
    'logits = model(**tok("the people of the united states", return_tensors="pt")).logits  # > 0: replaced',
    "```", "",
    "Fine-tune it like BERT (e.g. `ElectraForSequenceClassification`); the generator is in `generator/`.", ""])


def electra_card(model_cfg: ModelConfig, num_params: int, card: dict, role: str) -> str:
    """`pretrain.export.model_card` with ELECTRA's facts: what this directory holds and how to use it."""
    text = model_card(model_cfg, num_params, card).replace("\n- bert\n", "\n- electra\n", 1)  # a front-matter tag
    if role == "discriminator":  # not a fill-mask model: no such pipeline tag, no such usage
        intro = ("The ELECTRA discriminator (replaced-token detection), exported as `ElectraForPreTraining`: "
                 "the encoder to fine-tune.")
        text = text.replace("pipeline_tag: fill-mask\n", "", 1).replace("\n- fill-mask\n", "\n", 1)
        text = text[:text.index("## Usage")] + _DISC_USAGE if "## Usage" in text else text + _DISC_USAGE
    else:
        intro = ("The ELECTRA generator (a small masked language model trained alongside the discriminator in "
                 "`..`), exported as `ElectraForMaskedLM`.")
    return text.replace(_BERT_INTRO, intro, 1)


def export_electra(model: nn.Module, tokens: SpecialTokens, tokenizer_dir: str | Path, out_dir: str | Path,
                   card: dict) -> Path:
    """Write out_dir (discriminator) and out_dir/generator, each config + safetensors + tokenizer + README,
    swapped into place at once; returns out_dir."""
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    if not tokenizer_dir.is_dir() or not any(tokenizer_dir.iterdir()):
        raise UserError(f"tokenizer directory {tokenizer_dir} is missing or empty")
    gen_cfg = rtd_head(model).generator.config
    disc_state, gen_state = to_hf_electra_state_dicts(model)
    parts = [("discriminator", "", hf_electra_config(model.config, model.config, tokens, "ElectraForPreTraining"),
              disc_state, model.config),
             ("generator", GENERATOR_DIR, hf_electra_config(model.config, gen_cfg, tokens, "ElectraForMaskedLM"),
              gen_state, gen_cfg)]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / (".tmp-" + out_dir.name)
    if tmp.exists():  # left by an export that crashed
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        for role, sub, config, state, body_cfg in parts:
            where = tmp / sub
            where.mkdir(exist_ok=True)
            for item in tokenizer_dir.iterdir():
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, where / item.name)
            config.save_pretrained(where)
            save_file(state, where / "model.safetensors", metadata={"format": "pt"})
            num_params = sum(t.numel() for t in state.values())
            (where / "README.md").write_text(electra_card(body_cfg, num_params, card, role))
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ----------------------------------------------------------------------------------------------
# Verification


def _load(cls, path: Path, architecture: str):
    hf, info = cls.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32)
    problems = {k: sorted(v) for k, v in info.items() if v and k != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise ExportError(f"{path}: transformers loaded the export with problems: {problems} "
                          f"{info.get('error_msgs') or ''}")
    if hf.config.architectures != [architecture] or hf.config.hidden_act != "gelu":
        raise ExportError(f"{path}: config says {hf.config.architectures} / {hf.config.hidden_act}, "
                          f"expected [{architecture}] / gelu (our F.gelu)")
    return hf.eval()


@torch.no_grad()
def verify_electra_export(model: nn.Module, out_dir: str | Path, atol: float = 1e-4) -> dict[str, float]:
    """Load both models with transformers and compare their logits with ours in fp32 on a padded batch:
    discriminator [B, L], generator [B, L, V]. Returns the max abs difference of each."""
    import transformers

    out_dir = Path(out_dir)
    disc = _load(transformers.ElectraForPreTraining, out_dir, "ElectraForPreTraining")
    gen = _load(transformers.ElectraForMaskedLM, out_dir / GENERATOR_DIR, "ElectraForMaskedLM")

    # Compare in fp32 without changing the caller's model: copy it only if a cast is needed.
    ours = model if all(p.dtype == torch.float32 for p in model.parameters()) else copy.deepcopy(model).float()
    was_training = ours.training
    ours.eval()
    try:
        device = next(ours.parameters()).device
        ids, types, mask = _probe_batch(ours.config)
        args = (ids.to(device), types.to(device), mask.to(device))
        head = rtd_head(ours)
        expected = {"discriminator": head.discriminate(ours.encoder(*args)).cpu(),
                    "generator": head.generator_logits(ours.encoder.embeddings, *args).cpu()}
    finally:
        ours.train(was_training)
    got = {"discriminator": disc(input_ids=ids, token_type_ids=types, attention_mask=mask).logits,
           "generator": gen(input_ids=ids, token_type_ids=types, attention_mask=mask).logits}
    diffs = {}
    for role in expected:
        if got[role].shape != expected[role].shape:
            raise ExportError(f"{out_dir}: {role} logits shape {tuple(got[role].shape)} != ours "
                              f"{tuple(expected[role].shape)}")
        # Padded positions included: both models mask keys only, so their outputs must agree there too.
        diffs[role] = (got[role] - expected[role]).abs().max().item()
        if not diffs[role] <= atol:  # `not <=` also catches NaN
            raise ExportError(f"{out_dir}: HF {role} logits differ from ours by {diffs[role]:.3g} (> {atol:g})")
    return diffs
