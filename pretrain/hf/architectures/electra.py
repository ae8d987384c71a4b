"""ELECTRA (an rtd run): the discriminator as `ElectraForPreTraining` in out_dir, the generator as
`ElectraForMaskedLM` in out_dir/generator; two `Part`s of one record.

Layout, as `save_pretrained` writes it in transformers 5.x:
- discriminator: embedding_size E (model.embedding_size, or H), hidden_size H; `electra.embeddings_project`
  E -> H only when E != H (ELECTRA-small: E 128 under H 256);
- generator: embedding_size E (the shared embeddings), hidden_size Hg, with `electra.embeddings_project`
  E -> Hg; `generator_lm_head.weight` is tied to the word embeddings and left out (as BERT's decoder is).
The embeddings appear in both files (HF has no cross-model sharing); in disentangled mode the discriminator's
word table is the effective one, shared + delta, and the generator's the shared one. The encoder's names are
BERT's with `bert.` read as `electra.`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from objectives.rtd import DisentangledWordEmbedding, RTDHead
from pretrain.core.config import ModelConfig
from pretrain.core.errors import UserError
from pretrain.hf.architectures.base import (
    Architecture,
    Card,
    Link,
    Part,
    Table,
    Target,
    check_act,
    has,
    lin,
    lm_head_name,
    mlm_head,
    register,
    require,
    require_global,
)
from pretrain.hf.architectures.bert import BERT_COMPUTES, BERT_OPTIONS, bert_body, bert_from_config
from pretrain.hf.architectures.weights import fill_aliases, from_hf_state_dict, normalise, read_hf_weights, to_hf
from pretrain.hf.parity import ExportError, fp32_eval, load_checked, probe_batch

ELECTRA_HEAD = "heads.rtd"
GENERATOR_DIR = "generator"
DISCRIMINATOR, GENERATOR = "ElectraForPreTraining", "ElectraForMaskedLM"


def rtd_head(model: nn.Module) -> RTDHead:
    head = model.heads["rtd"] if "rtd" in model.heads else None
    if not isinstance(head, RTDHead):
        raise UserError(f"ELECTRA export needs the rtd objective; this model has heads {sorted(model.heads) or 'none'}")
    return head


# ----------------------------------------------------------------------------------------------
# Tables


def _body(num_layers: int, our_layers: str) -> Table:
    """Embeddings + encoder layers: BERT's body under electra.*, our layers under `our_layers`."""
    table = []
    for link in bert_body(num_layers, "electra"):
        if link.ours.startswith("encoder.layers."):
            link = link._replace(ours=our_layers + link.ours[len("encoder.layers") :])
        table.append(link)
    return table


def discriminator_weight_map(num_layers: int) -> Table:
    """Our names <-> ElectraForPreTraining names; several names = our tensor is their concatenation on dim 0."""
    return (
        _body(num_layers, "encoder.layers")
        + lin(f"{ELECTRA_HEAD}.dense", "discriminator_predictions.dense")
        + lin(f"{ELECTRA_HEAD}.dense_prediction", "discriminator_predictions.dense_prediction")
    )


def generator_table(generator: nn.Module) -> Table:
    """Our names <-> ElectraForMaskedLM names of our rtd generator. The decoder is the word-embedding Parameter:
    no entry. `electra.embeddings_project` (E -> Hg) exists where the widths differ, on both sides."""
    gen = f"{ELECTRA_HEAD}.generator"
    project = generator.embeddings_project is not None
    return (
        _body(generator.config.num_layers, f"{gen}.layers")
        + (lin(f"{gen}.embeddings_project", "electra.embeddings_project") if project else [])
        + lin(f"{gen}.head.dense", "generator_predictions.dense")
        + lin(f"{gen}.head.layer_norm", "generator_predictions.LayerNorm")
        + [Link(f"{gen}.head.bias", ("generator_lm_head.bias",))]
    )


def _projection(model: nn.Module) -> Table:
    """ELECTRA with embedding_size != hidden_size projects LN-ed embeddings up, as ALBERT (and we) do."""
    if not has(model, "encoder.embeddings.projection.weight"):
        return []
    return lin("encoder.embeddings.projection", "electra.embeddings_project")


def electra_discriminator_table(model: nn.Module) -> Table:
    """ElectraForPreTraining: BERT's body under `electra.` + the discriminator head, when our model has one."""
    table = discriminator_weight_map(model.config.num_layers) + _projection(model)
    return table if "rtd" in model.heads else [link for link in table if link.ours.startswith("encoder.")]


def electra_generator_as_mlm_table(model: nn.Module) -> Table:
    """ElectraForMaskedLM imported as a plain MLM model: its head is ours (same math, other names)."""
    return (
        bert_body(model.config.num_layers, "electra")
        + _projection(model)
        + mlm_head(
            lm_head_name(model),
            "generator_predictions.dense",
            "generator_predictions.LayerNorm",
            "generator_lm_head.bias",
        )
    )


# ----------------------------------------------------------------------------------------------
# Export: target, configs, the two parts


def electra_claims(model: nn.Module) -> str | None:
    return "an rtd (ELECTRA) run exports as electra only" if "rtd" in model.heads else None


def electra_target(model: nn.Module) -> Target:
    cfg = model.config
    if "rtd" not in model.heads:
        raise UserError("--arch electra needs an rtd run (ElectraForPreTraining is a replaced-token detector)")
    require(cfg, BERT_OPTIONS, "electra")
    require_global(cfg, "electra")
    if getattr(cfg, "share_layers", False):  # factorized embeddings are ELECTRA's own (embeddings_project)
        raise UserError("ELECTRA export has no shared layers on the discriminator (model.share_layers=true)")
    return Target("electra", DISCRIMINATOR, ("the generator is in generator/ (ElectraForMaskedLM)", *_dropped(model)))


def _dropped(model: nn.Module) -> tuple[str, ...]:
    """A sentence head trained beside rtd (rtd + sop, rtd + nsp): ElectraForPreTraining has no place for it."""
    return tuple(
        f"the {h} head has no place in {DISCRIMINATOR} and is not exported"
        for h in sorted(model.heads)
        if h in ("nsp", "sop")
    )


def hf_electra_config(model_cfg: ModelConfig, body: ModelConfig, tokens, architecture: str) -> Any:
    """ElectraConfig of a body of width `body.hidden_size` on the shared embeddings (width E:
    model_cfg.embedding_size, or its hidden_size). The generator head's GELU is hard-wired in HF."""
    import transformers

    if tokens.vocab_size > model_cfg.vocab_size:  # smaller is fine: checkpoints often pad their tables
        raise UserError(
            f"tokenizer vocabulary ({tokens.vocab_size}) is larger than model.vocab_size ({model_cfg.vocab_size})"
        )
    return transformers.ElectraConfig(
        architectures=[architecture],
        vocab_size=model_cfg.vocab_size,
        embedding_size=model_cfg.embedding_size or model_cfg.hidden_size,
        hidden_size=body.hidden_size,
        num_hidden_layers=body.num_layers,
        num_attention_heads=body.num_heads,
        intermediate_size=body.intermediate_size,
        hidden_act="gelu",  # HF's "gelu" (GELUActivation, erf form) is our F.gelu
        hidden_dropout_prob=body.hidden_dropout,
        attention_probs_dropout_prob=body.attention_dropout,
        type_vocab_size=model_cfg.type_vocab_size,
        layer_norm_eps=model_cfg.layer_norm_eps,
        use_cache=False,
        max_position_embeddings=model_cfg.max_position_embeddings,
        initializer_range=model_cfg.initializer_range,
        pad_token_id=tokens.pad,
        tie_word_embeddings=True,
        is_decoder=False,
    )


def to_hf_electra_state_dicts(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(ElectraForPreTraining, ElectraForMaskedLM) state dicts of our model: fp32, CPU, unshared."""
    head = rtd_head(model)
    ours = dict(model.state_dict())
    disc_src = dict(ours)
    word = model.encoder.embeddings.word_embeddings
    if isinstance(word, DisentangledWordEmbedding):
        disc_src["encoder.embeddings.word_embeddings.weight"] = word.effective_weight().detach()  # what it reads
    return to_hf(electra_discriminator_table(model), disc_src), to_hf(generator_table(head.generator), ours)


_DISC_USAGE = "\n".join(
    [
        "## Usage",
        "",
        "```python",
        "from transformers import AutoTokenizer, ElectraForPreTraining",
        "",
        'tok = AutoTokenizer.from_pretrained("path/to/this/directory")',
        'model = ElectraForPreTraining.from_pretrained("path/to/this/directory")',
        'logits = model(**tok("the people of the united states", return_tensors="pt")).logits  # > 0: replaced',
        "```",
        "",
        "Fine-tune it like BERT (e.g. `ElectraForSequenceClassification`); the generator is in `generator/`.",
        "",
    ]
)
DISCRIMINATOR_CARD = Card(
    intro="The ELECTRA discriminator (replaced-token detection), exported as `ElectraForPreTraining`: the encoder "
    "to fine-tune.",
    fill_mask=False,  # not a fill-mask model: no such pipeline tag, no such usage
    usage=_DISC_USAGE,
)
GENERATOR_CARD = Card(
    intro="The ELECTRA generator (a small masked language model trained alongside the discriminator in `..`), "
    "exported as `ElectraForMaskedLM`."
)


def electra_parts(model: nn.Module, target: Target, tokens) -> list[Part]:
    gen_cfg = rtd_head(model).generator.config
    disc_state, gen_state = to_hf_electra_state_dicts(model)
    disc_config = hf_electra_config(model.config, model.config, tokens, DISCRIMINATOR)
    gen_config = hf_electra_config(model.config, gen_cfg, tokens, GENERATOR)
    return [
        Part(
            "", DISCRIMINATOR, disc_config, disc_state, model.config, replace(DISCRIMINATOR_CARD, notes=_dropped(model))
        ),
        Part(GENERATOR_DIR, GENERATOR, gen_config, gen_state, gen_cfg, GENERATOR_CARD),
    ]


def electra_config(model: nn.Module, target: Target, tokens) -> Any:
    """The discriminator's config (the generator's is in `electra_parts`)."""
    return hf_electra_config(model.config, model.config, tokens, target.hf_class)


def electra_from_config(hf_cfg: Any, where: str) -> dict[str, Any]:
    fields = bert_from_config(hf_cfg, where)
    if hf_cfg.embedding_size != hf_cfg.hidden_size:
        fields["embedding_size"] = hf_cfg.embedding_size
    return fields


# ----------------------------------------------------------------------------------------------
# Import and verification


def electra_import(model: nn.Module, directory: Path, sd: dict, classes: list[str], where: str):
    """An ELECTRA directory: the discriminator (ElectraForPreTraining) is our encoder (+ our rtd head, and the
    generator from DIR/generator as our own exports write it); a generator alone (ElectraForMaskedLM) is
    imported as a BERT-style MLM model (its prediction head is ours under other names)."""
    if GENERATOR in classes or any(k.startswith("generator_") for k in sd):
        if "rtd" in model.heads:
            raise UserError(
                f"{where} is an ELECTRA generator (ElectraForMaskedLM). An rtd run imports the "
                "discriminator directory (ElectraForPreTraining, with the generator in generator/); a "
                "generator alone can start an mlm/span/plm run as its encoder + MLM head"
            )
        return from_hf_state_dict(sd, model, "electra", where, electra_generator_as_mlm_table(model))
    state, absent, unused = from_hf_state_dict(sd, model, "electra", where, electra_discriminator_table(model))
    gen_dir = Path(directory) / GENERATOR_DIR
    if "rtd" not in model.heads or not (gen_dir / "config.json").is_file():
        return state, absent, unused
    _check_generator_shape(model.heads["rtd"].generator.config, gen_dir)
    gen_sd = normalise(read_hf_weights(gen_dir), "electra")
    gen_table = generator_table(model.heads["rtd"].generator)
    gen_state, gen_absent, gen_unused = from_hf_state_dict(gen_sd, model, "electra", f"{where}/generator", gen_table)
    state = _merge_generator(model, state, gen_state, where)
    return fill_aliases(model, state), absent + gen_absent, unused + [f"generator/{k}" for k in gen_unused]


def _check_generator_shape(ours: ModelConfig, gen_dir: Path) -> None:
    """The generator an rtd run builds (objectives.rtd.generator_size and generator_layers, which config.json cannot
    give it) against the checkpoint's: another depth loaded its first layers and left the rest behind with a warning,
    another width failed on a tensor's shape; either is named with the options to set."""
    import json

    theirs = json.loads((gen_dir / "config.json").read_text())
    where = f"model.init_from {gen_dir}"

    def refuse_differences(mine: dict, remedy: str) -> None:
        differ = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) not in (None, v)}
        if differ:
            said = ", ".join(f"{k} {a} (this run's: {b})" for k, (a, b) in differ.items())
            raise UserError(f"{where}: the checkpoint's generator has {said}{remedy}")

    refuse_differences(
        {"num_hidden_layers": ours.num_layers, "hidden_size": ours.hidden_size},
        ": set objectives.rtd.generator_layers (its depth) and objectives.rtd.generator_size (its width over the "
        "encoder's) to the checkpoint's",
    )
    # What the sizes above do not fix: same-shaped weights computing something else (another head split, another
    # activation or epsilon) loaded unsaid, the generator's logits off by up to 0.3 on a random model
    check_act(theirs.get("hidden_act", "gelu"), where)
    refuse_differences(  # the generator's heads and FFN follow generator_size; its epsilon is the encoder's
        {
            "num_attention_heads": ours.num_heads,
            "intermediate_size": ours.intermediate_size,
            "layer_norm_eps": ours.layer_norm_eps,
        },
        ", which this run's generator (derived from the encoder by objectives.rtd.generator_size) cannot take: import "
        "the discriminator without it (a directory without generator/) to train a fresh generator",
    )


def _merge_generator(model: nn.Module, state: dict, gen_state: dict, where: str) -> dict:
    """The discriminator's and the generator's tensors in one state: their embeddings are ours, shared (or, when
    disentangled, the generator's the shared table and the discriminator's shared + delta)."""
    word = "encoder.embeddings.word_embeddings.weight"
    disentangled = "encoder.embeddings.word_embeddings.delta" in model.state_dict()
    for name, tensor in gen_state.items():
        if name.startswith("encoder.embeddings.") and name in state and not torch.equal(state[name], tensor):
            if name == word and disentangled:
                continue  # handled below
            raise UserError(
                f"{where}: the generator's {name} differs from the discriminator's; ours share it"
                + (  # an export of objectives.rtd.disentangled=true: the discriminator's table is shared + delta
                    ": this checkpoint was trained with objectives.rtd.disentangled=true; set it to import both parts"
                    if name == word
                    else ""
                )
            )
    if disentangled:
        return {**state, **gen_state, "encoder.embeddings.word_embeddings.delta": state[word] - gen_state[word]}
    return {**gen_state, **state}


def _load(path: Path, architecture: str) -> nn.Module:
    import transformers

    hf = load_checked(getattr(transformers, architecture), path)
    if hf.config.architectures != [architecture] or hf.config.hidden_act != "gelu":
        raise ExportError(
            f"{path}: config says {hf.config.architectures} / {hf.config.hidden_act}, "
            f"expected [{architecture}] / gelu (our F.gelu)"
        )
    return hf


@torch.no_grad()
def verify_electra_export(model: nn.Module, out_dir: str | Path, atol: float = 1e-4) -> dict[str, float]:
    """Load both models with transformers and compare their logits with ours in fp32 on a padded batch:
    discriminator [B, L], generator [B, L, V]. Returns the max abs difference of each."""
    out_dir = Path(out_dir)
    disc, gen = _load(out_dir, DISCRIMINATOR), _load(out_dir / GENERATOR_DIR, GENERATOR)
    with fp32_eval(model) as ours:
        device = next(ours.parameters()).device
        ids, types, mask = probe_batch(ours.config)
        args = (ids.to(device), types.to(device), mask.to(device))
        head = rtd_head(ours)
        expected = {
            "discriminator": head.discriminate(ours.encoder(*args)).cpu(),
            "generator": head.generator_logits(ours.encoder.embeddings, *args).cpu(),
        }
    got = {
        "discriminator": disc(input_ids=ids, token_type_ids=types, attention_mask=mask).logits,
        "generator": gen(input_ids=ids, token_type_ids=types, attention_mask=mask).logits,
    }
    unpadded = getattr(model.config, "unpadded", False)
    real = mask.bool() if unpadded else torch.ones_like(mask, dtype=torch.bool)  # [B, L]
    diffs = {}
    for role in expected:
        if got[role].shape != expected[role].shape:
            raise ExportError(
                f"{out_dir}: {role} logits shape {tuple(got[role].shape)} != ours {tuple(expected[role].shape)}"
            )
        # Padded positions included (both models mask keys only, so their outputs agree there too), except where our
        # encoder computes nothing there (model.unpadded leaves zeros): real tokens only
        diffs[role] = (got[role][real] - expected[role][real]).abs().max().item()
        if not diffs[role] <= atol:  # `not <=` also catches NaN
            raise ExportError(f"{out_dir}: HF {role} logits differ from ours by {diffs[role]:.3g} (> {atol:g})")
    return diffs


ELECTRA = register(
    Architecture(
        name="electra",
        title="ELECTRA",
        prefix="electra",
        computes=f"{BERT_COMPUTES}, an rtd run (embedding_size allowed, share_layers not)",
        table=electra_discriminator_table,
        target=electra_target,
        to_config=electra_config,
        from_config=electra_from_config,
        decoder=("generator_lm_head.weight", "electra.embeddings.word_embeddings.weight"),  # a generator's
        tied=("generator_lm_head.weight", "electra.embeddings.position_ids", "electra.embeddings.token_type_ids"),
        claims=electra_claims,
        priority=30,
        parts=electra_parts,
        import_weights=electra_import,
        verify=verify_electra_export,
        demo=GENERATOR_DIR,
    )
)
