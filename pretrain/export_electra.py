"""Export an ELECTRA (rtd) run: the discriminator as `ElectraForPreTraining` in out_dir, the generator as
`ElectraForMaskedLM` in out_dir/generator; both complete `from_pretrained` directories, written atomically.

Layout, as `save_pretrained` writes it in transformers 5.x:
- discriminator: embedding_size = hidden_size = H, so no `electra.embeddings_project`;
- generator: embedding_size = H (the shared embeddings), hidden_size = Hg, with `electra.embeddings_project`
  E -> Hg; `generator_lm_head.weight` is tied to the word embeddings and left out (as BERT's decoder is).
The embeddings appear in both files (HF has no cross-model sharing); in disentangled mode the discriminator's
word table is the effective one, shared + delta, and the generator's the shared one.

The encoder's names are BERT's with `bert.` read as `electra.` (`hf_interop.bert_body`): one table per model
below, each used in both directions by `hf_interop.to_hf` / `from_hf`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from objectives.base import SpecialTokens
from objectives.rtd import DisentangledWordEmbedding, RTDHead
from pretrain.config import ModelConfig
from pretrain.errors import UserError
from pretrain.export import (ExportError, _probe_batch, check_tokenizer_dir, fp32_eval, intro_line, model_card,
                             write_hf_dir)
from pretrain.hf_interop import Link, Table, bert_body, from_hf, to_hf

HEAD = "heads.rtd"
WORD = "encoder.embeddings.word_embeddings.weight"
DELTA = "encoder.embeddings.word_embeddings.delta"
GENERATOR_DIR = "generator"
_HF_BUFFERS = ("electra.embeddings.position_ids", "electra.embeddings.token_type_ids")
_TIED = {"generator_lm_head.weight": "electra.embeddings.word_embeddings.weight"}



def rtd_head(model: nn.Module) -> RTDHead:
    head = model.heads["rtd"] if "rtd" in model.heads else None
    if not isinstance(head, RTDHead):
        raise UserError(f"ELECTRA export needs the rtd objective; this model has heads {sorted(model.heads) or 'none'}")
    return head


def hf_electra_config(model_cfg: ModelConfig, body: ModelConfig, tokens: SpecialTokens, architecture: str) -> Any:
    """ElectraConfig of a body of width `body.hidden_size` on embeddings of width model_cfg.hidden_size.
    HF's "gelu" (GELUActivation, erf form) is our F.gelu; the generator head's GELU is hard-wired in HF."""
    import transformers

    if tokens.vocab_size > model_cfg.vocab_size:  # smaller is fine: checkpoints often pad their tables
        raise UserError(f"tokenizer vocabulary ({tokens.vocab_size}) is larger than model.vocab_size "
                        f"({model_cfg.vocab_size})")
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


def _linear_or_norm(ours: str, hf: str) -> Table:
    return [Link(f"{ours}.{p}", (f"{hf}.{p}",)) for p in ("weight", "bias")]


def _body(num_layers: int, our_layers: str) -> Table:
    """Embeddings + encoder layers: BERT's body under electra.*, our layers under `our_layers`."""
    table = []
    for link in bert_body(num_layers, "electra"):
        if link.ours.startswith("encoder.layers."):
            link = link._replace(ours=our_layers + link.ours[len("encoder.layers"):])
        table.append(link)
    return table


def discriminator_weight_map(num_layers: int) -> Table:
    """Our names <-> ElectraForPreTraining names; several names = our tensor is their concatenation on dim 0."""
    return (_body(num_layers, "encoder.layers")
            + _linear_or_norm(f"{HEAD}.dense", "discriminator_predictions.dense")
            + _linear_or_norm(f"{HEAD}.dense_prediction", "discriminator_predictions.dense_prediction"))


def generator_weight_map(num_layers: int) -> Table:
    """Our names <-> ElectraForMaskedLM names. The decoder is the word-embedding Parameter: no entry."""
    gen = f"{HEAD}.generator"
    return (_body(num_layers, f"{gen}.layers")
            + _linear_or_norm(f"{gen}.embeddings_project", "electra.embeddings_project")
            + _linear_or_norm(f"{gen}.head.dense", "generator_predictions.dense")
            + _linear_or_norm(f"{gen}.head.layer_norm", "generator_predictions.LayerNorm")
            + [Link(f"{gen}.head.bias", ("generator_lm_head.bias",))])


def to_hf_electra_state_dicts(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(ElectraForPreTraining, ElectraForMaskedLM) state dicts of our model: fp32, CPU, unshared."""
    head = rtd_head(model)
    ours = dict(model.state_dict())
    disc_src = dict(ours)
    word = model.encoder.embeddings.word_embeddings
    if isinstance(word, DisentangledWordEmbedding):
        disc_src[WORD] = word.effective_weight().detach()  # what our encoder actually reads
    return (to_hf(discriminator_weight_map(model.config.num_layers), disc_src),
            to_hf(generator_weight_map(head.generator.config.num_layers), ours))


def from_hf_electra_state_dicts(disc_sd: dict[str, torch.Tensor], gen_sd: dict[str, torch.Tensor],
                                model: nn.Module) -> dict[str, torch.Tensor]:
    """The inverse: a state dict `model.load_state_dict` accepts (strict). The embeddings must agree between
    the two files except, in disentangled mode, the word table, whose difference becomes the delta."""
    head = rtd_head(model)
    disentangled = isinstance(model.encoder.embeddings.word_embeddings, DisentangledWordEmbedding)
    ref = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for what, sd, table in (("ElectraForPreTraining", disc_sd, discriminator_weight_map(model.config.num_layers)),
                            ("ElectraForMaskedLM", gen_sd, generator_weight_map(head.generator.config.num_layers))):
        known = {h for link in table for h in link.hf}
        missing = sorted(known - sd.keys())
        unexpected = sorted(sd.keys() - known - _TIED.keys() - set(_HF_BUFFERS))
        if missing or unexpected:
            raise UserError(f"not the {what} state dict of this model: missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]}")
        mapped, _ = from_hf(table, sd, ref, what)
        for name, tensor in mapped.items():
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
    return text.replace(intro_line("bert", "BertForMaskedLM", bool(card.get("init_from"))), intro, 1)


def export_electra(model: nn.Module, tokens: SpecialTokens, tokenizer_dir: str | Path, out_dir: str | Path,
                   card: dict, inputs: dict[str, Path] | None = None) -> Path:
    """Write out_dir (discriminator) and out_dir/generator, each config + safetensors + tokenizer + README,
    swapped into place at once; returns out_dir."""
    tokenizer_dir, out_dir = check_tokenizer_dir(tokenizer_dir), Path(out_dir)
    gen_cfg = rtd_head(model).generator.config
    disc_state, gen_state = to_hf_electra_state_dicts(model)
    parts = [("discriminator", "", hf_electra_config(model.config, model.config, tokens, "ElectraForPreTraining"),
              disc_state, model.config),
             ("generator", GENERATOR_DIR, hf_electra_config(model.config, gen_cfg, tokens, "ElectraForMaskedLM"),
              gen_state, gen_cfg)]

    return write_hf_dir(out_dir, [(sub, config, state, electra_card(body_cfg, sum(t.numel() for t in state.values()),
                                                                     card, role))
                                  for role, sub, config, state, body_cfg in parts], tokenizer_dir, inputs)


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

    with fp32_eval(model) as ours:
        device = next(ours.parameters()).device
        ids, types, mask = _probe_batch(ours.config)
        args = (ids.to(device), types.to(device), mask.to(device))
        head = rtd_head(ours)
        expected = {"discriminator": head.discriminate(ours.encoder(*args)).cpu(),
                    "generator": head.generator_logits(ours.encoder.embeddings, *args).cpu()}
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
