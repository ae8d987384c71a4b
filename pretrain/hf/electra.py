"""Export an ELECTRA (rtd) run: the discriminator as `ElectraForPreTraining` in out_dir, the generator as
`ElectraForMaskedLM` in out_dir/generator; both complete `from_pretrained` directories, written atomically.

Layout, as `save_pretrained` writes it in transformers 5.x:
- discriminator: embedding_size E (model.embedding_size, or H), hidden_size H; `electra.embeddings_project`
  E -> H only when E != H (ELECTRA-small: E 128 under H 256);
- generator: embedding_size E (the shared embeddings), hidden_size Hg, with `electra.embeddings_project`
  E -> Hg; `generator_lm_head.weight` is tied to the word embeddings and left out (as BERT's decoder is).
The embeddings appear in both files (HF has no cross-model sharing); in disentangled mode the discriminator's
word table is the effective one, shared + delta, and the generator's the shared one.

The encoder's names are BERT's with `bert.` read as `electra.`: one table per model (`pretrain.hf.interop`:
`electra_discriminator_table`, `generator_table`), each used in both directions: here to export, by
`pretrain.hf.init_from` to import.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from objectives.rtd import DisentangledWordEmbedding, RTDHead
from pretrain.core.config import ModelConfig
from pretrain.core.errors import UserError
from pretrain.core.tokens import SpecialTokens
from pretrain.hf.export import (
    ExportError,
    _probe_batch,
    check_tokenizer_dir,
    fp32_eval,
    intro_line,
    model_card,
    write_hf_dir,
)
from pretrain.hf.interop import electra_discriminator_table, generator_table, to_hf

GENERATOR_DIR = "generator"


def rtd_head(model: nn.Module) -> RTDHead:
    head = model.heads["rtd"] if "rtd" in model.heads else None
    if not isinstance(head, RTDHead):
        raise UserError(f"ELECTRA export needs the rtd objective; this model has heads {sorted(model.heads) or 'none'}")
    return head


def hf_electra_config(model_cfg: ModelConfig, body: ModelConfig, tokens: SpecialTokens, architecture: str) -> Any:
    """ElectraConfig of a body of width `body.hidden_size` on the shared embeddings (width E:
    model_cfg.embedding_size, or its hidden_size).
    HF's "gelu" (GELUActivation, erf form) is our F.gelu; the generator head's GELU is hard-wired in HF."""
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


def to_hf_electra_state_dicts(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(ElectraForPreTraining, ElectraForMaskedLM) state dicts of our model: fp32, CPU, unshared."""
    head = rtd_head(model)
    ours = dict(model.state_dict())
    disc_src = dict(ours)
    word = model.encoder.embeddings.word_embeddings
    if isinstance(word, DisentangledWordEmbedding):
        disc_src["encoder.embeddings.word_embeddings.weight"] = word.effective_weight().detach()  # what it reads
    return (
        to_hf(electra_discriminator_table(model), disc_src),
        to_hf(generator_table(head.generator), ours),
    )


# ----------------------------------------------------------------------------------------------
# The export directory


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


def electra_card(model_cfg: ModelConfig, num_params: int, card: dict, role: str) -> str:
    """`pretrain.hf.export.model_card` with ELECTRA's facts: what this directory holds and how to use it."""
    text = model_card(model_cfg, num_params, card).replace("\n- bert\n", "\n- electra\n", 1)  # a front-matter tag
    if role == "discriminator":  # not a fill-mask model: no such pipeline tag, no such usage
        intro = (
            "The ELECTRA discriminator (replaced-token detection), exported as `ElectraForPreTraining`: "
            "the encoder to fine-tune."
        )
        text = text.replace("pipeline_tag: fill-mask\n", "", 1).replace("\n- fill-mask\n", "\n", 1)
        text = text[: text.index("## Usage")] + _DISC_USAGE if "## Usage" in text else text + _DISC_USAGE
    else:
        intro = (
            "The ELECTRA generator (a small masked language model trained alongside the discriminator in "
            "`..`), exported as `ElectraForMaskedLM`."
        )
    return text.replace(intro_line("bert", "BertForMaskedLM", bool(card.get("init_from"))), intro, 1)


def export_electra(
    model: nn.Module,
    tokens: SpecialTokens,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    card: dict,
    inputs: dict[str, Path] | None = None,
    check: Callable[[Path], Any] | None = None,
) -> Path:
    """Write out_dir (discriminator) and out_dir/generator, each config + safetensors + tokenizer + README,
    written in full (and checked by `check`, e.g. `lambda d: verify_electra_export(model, d)`) before they
    replace the previous export's files (`write_hf_dir`); returns out_dir."""
    tokenizer_dir, out_dir = check_tokenizer_dir(tokenizer_dir), Path(out_dir)
    gen_cfg = rtd_head(model).generator.config
    disc_state, gen_state = to_hf_electra_state_dicts(model)
    parts = [
        (
            "discriminator",
            "",
            hf_electra_config(model.config, model.config, tokens, "ElectraForPreTraining"),
            disc_state,
            model.config,
        ),
        (
            "generator",
            GENERATOR_DIR,
            hf_electra_config(model.config, gen_cfg, tokens, "ElectraForMaskedLM"),
            gen_state,
            gen_cfg,
        ),
    ]

    return write_hf_dir(
        out_dir,
        [
            (sub, config, state, electra_card(body_cfg, sum(t.numel() for t in state.values()), card, role))
            for role, sub, config, state, body_cfg in parts
        ],
        tokenizer_dir,
        inputs,
        check,
    )


# ----------------------------------------------------------------------------------------------
# Verification


def _load(cls, path: Path, architecture: str):
    hf, info = cls.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32)
    problems = {k: sorted(v) for k, v in info.items() if v and k != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise ExportError(
            f"{path}: transformers loaded the export with problems: {problems} {info.get('error_msgs') or ''}"
        )
    if hf.config.architectures != [architecture] or hf.config.hidden_act != "gelu":
        raise ExportError(
            f"{path}: config says {hf.config.architectures} / {hf.config.hidden_act}, "
            f"expected [{architecture}] / gelu (our F.gelu)"
        )
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
        expected = {
            "discriminator": head.discriminate(ours.encoder(*args)).cpu(),
            "generator": head.generator_logits(ours.encoder.embeddings, *args).cpu(),
        }
    got = {
        "discriminator": disc(input_ids=ids, token_type_ids=types, attention_mask=mask).logits,
        "generator": gen(input_ids=ids, token_type_ids=types, attention_mask=mask).logits,
    }
    diffs = {}
    for role in expected:
        if got[role].shape != expected[role].shape:
            raise ExportError(
                f"{out_dir}: {role} logits shape {tuple(got[role].shape)} != ours {tuple(expected[role].shape)}"
            )
        # Padded positions included: both models mask keys only, so their outputs must agree there too.
        diffs[role] = (got[role] - expected[role]).abs().max().item()
        if not diffs[role] <= atol:  # `not <=` also catches NaN
            raise ExportError(f"{out_dir}: HF {role} logits differ from ours by {diffs[role]:.3g} (> {atol:g})")
    return diffs
