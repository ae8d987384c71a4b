"""Replaced-token detection (ELECTRA): a small generator fills in masked tokens, the encoder learns to spot them.

Per batch, on the model side (`before_encoder`):
    masked input  -> generator (shared embeddings -> projection -> small layers -> tied LM head)
                  -> generator MLM loss at the masked positions, and a token SAMPLED there (no gradient)
    original ids with the masked positions replaced by the samples -> the discriminator (= the run's encoder)
    rtd_labels = 1 where the sample differs from the original token, 0 elsewhere, -100 at padding.
Loss: gen_weight * generator MLM + disc_weight * binary cross-entropy of the discriminator over all
non-padding tokens (ELECTRA's 1 and 50). Sampling is discrete, so the discriminator loss never reaches the
generator's own weights; it does update the embeddings both share (that is ELECTRA), unless `disentangled`.

Shapes: B batch, L length, H discriminator width (= embedding width E), Hg generator width, M masked tokens,
T non-padding tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from objectives.base import Objective, ObjectiveOutput, flat_targets, option, register, summed_ce_and_correct
from objectives.lm_head import TiedLMHead, lm_head
from objectives.mlm import MaskingRates, candidate_positions, choose_positions, corrupt
from pretrain.core.measures import BinaryAUC, Mean
from pretrain.core.tokens import IGNORE_INDEX
from pretrain.model.compiling import compiled
from pretrain.model.encoder import (
    Embeddings,
    EncoderLayer,
    layer_stack,
    layer_windows,
    make_norm,
    padded_layer_inputs,
)


@dataclass
class RTDOptions(MaskingRates):
    # MLM's masking rates, with ELECTRA's defaults: 85% [MASK], 15% left as is, no random tokens (the generator's
    # samples are the "random" replacements). No whole words or n-grams: ELECTRA masks single tokens.  rtd admits
    # mask_prob=1 (every token predicted, then replaced by a sample); mlm does not (nothing left to predict from).
    mask_prob: float = option(
        0.15,
        "Fraction of non-special tokens the generator predicts (and then replaces by a sample).",
        gt=0,
        le=1,
        schedulable=True,
    )
    mask_token_prob: float = option(
        0.85,
        "Of the chosen tokens, the fraction shown to the generator as [MASK] (the rest as themselves or random).",
        ge=0,
        le=1,
    )
    random_token_prob: float = option(
        0.0, "Of the chosen tokens, the fraction shown to the generator as a random token.", ge=0, le=1
    )
    generator_size: float = option(
        0.25,
        "Generator width as a fraction of the encoder's hidden size, intermediate size and heads (ELECTRA-Small "
        "and -Large: 1/4, -Base: 1/3; the paper finds 1/4-1/2 best).",
        gt=0,
        le=1,
    )
    generator_layers: int = option(0, "Generator depth; 0 = as many layers as the encoder.", ge=0)
    temperature: float = option(1.0, "Replacements are sampled from softmax(generator logits / temperature).", gt=0)
    gen_weight: float = option(1.0, "Weight of the generator MLM loss inside this objective's loss.", ge=0)
    disc_weight: float = option(
        50.0, "Weight of the discriminator loss inside this objective's loss (ELECTRA: 50).", ge=0
    )
    disentangled: bool = option(
        False,
        "DeBERTa-v3 gradient-disentangled embedding sharing: the encoder reads word "
        "embeddings sg(shared) + delta (delta zero-initialised), so replaced-token "
        "detection cannot move the shared table.",
    )


def generator_config(cfg, opts: RTDOptions):
    """The generator's ModelConfig: hidden, intermediate and heads scaled by generator_size, the width
    rounded to a multiple of the head count so attention splits evenly (256 x 1/3 -> 85, 1 head); under RoPE, which
    rotates pairs of dimensions, to a multiple of twice the head count (-> 86)."""
    heads = max(1, round(cfg.num_heads * opts.generator_size))
    step = heads * (2 if cfg.position_embedding == "rope" else 1)
    hidden = max(step, round(cfg.hidden_size * opts.generator_size / step) * step)
    return replace(
        cfg,
        hidden_size=hidden,
        num_heads=heads,
        intermediate_size=max(1, round(cfg.intermediate_size * opts.generator_size)),
        num_layers=opts.generator_layers or cfg.num_layers,
    )


class DisentangledWordEmbedding(nn.Embedding):
    """Word embeddings for gradient-disentangled sharing (DeBERTa-v3): `weight` is the shared table E
    (the generator's, tied to its decoder), `delta` is E_delta. The encoder reads E.detach() + E_delta, the
    generator reads E (inside `generator_view()`), so only the generator's loss trains E.

    It replaces the encoder's nn.Embedding in place (same `weight` Parameter), so Embeddings.forward and
    the state-dict name of the shared table are unchanged; the delta is `...word_embeddings.delta`."""

    def __init__(self, shared: nn.Embedding):
        super().__init__(shared.num_embeddings, shared.embedding_dim, padding_idx=shared.padding_idx)
        self.weight = shared.weight  # the same Parameter: whatever is tied to it stays tied
        # Zero at start: the encoder begins from the shared table. init_weights only touches `.weight`.
        self.delta = nn.Parameter(torch.zeros_like(shared.weight))
        self._generator_view = False

    @contextlib.contextmanager
    def generator_view(self):
        self._generator_view = True
        try:
            yield
        finally:
            self._generator_view = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [B, L] -> [B, L, E]
        if self._generator_view:
            return super().forward(ids)
        # Two lookups rather than one into (E + delta): no [V, E] temporary; same values bit for bit.
        return F.embedding(ids, self.weight.detach(), self.padding_idx) + F.embedding(ids, self.delta, self.padding_idx)

    def effective_weight(self) -> torch.Tensor:
        """The table the encoder sees, [V, E]: what an export of the discriminator must carry."""
        return self.weight + self.delta


class GeneratorHead(TiedLMHead):
    """ELECTRA's generator predictions: the shared LM head (dense Hg -> E, GELU, LayerNorm, decoder tied to the
    shared word embeddings + own bias). Not an MLMHead on purpose: BERT export looks for one, and must not find
    this."""


class Generator(nn.Module):
    """The small MLM. It has no embeddings of its own: callers pass the encoder's `Embeddings` module
    (shared, as in ELECTRA), so the shared tables are registered once, under `encoder.embeddings`."""

    def __init__(self, gen_cfg, embedding_size: int, word_embeddings: nn.Embedding):
        super().__init__()
        self.config = gen_cfg
        # E -> Hg, only where the widths differ (as in ELECTRA and transformers' ElectraModel)
        self.embeddings_project = (
            nn.Linear(embedding_size, gen_cfg.hidden_size) if embedding_size != gen_cfg.hidden_size else None
        )
        # The encoder's layer pattern: global and local (model.local_attention) layers, their RoPE bases, and under
        # pre-LN one LN on the output. Layer 0 keeps its attn_norm where the encoder's has none (the state-dict
        # names of generators trained before stay; a LN of the embedding LN's output is only a learned affine).
        windows = layer_windows(gen_cfg)
        self.windows = tuple(sorted(set(windows)))
        self.layers = nn.ModuleList(EncoderLayer(gen_cfg, window=w) for w in windows)
        self.final_norm = make_norm(gen_cfg, gen_cfg.hidden_size) if gen_cfg.norm_placement == "pre" else None
        self.head = lm_head(GeneratorHead, gen_cfg, word_embeddings)  # E = word_embeddings.embedding_dim

    def forward(
        self,
        embeddings: Embeddings,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # input_ids [B, L] -> generator hidden states [B, L, Hg]
        return self.encode(self.embed(embeddings, input_ids, token_type_ids), attention_mask)

    def embed(
        self, embeddings: Embeddings, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """The shared embeddings as the generator reads them: input_ids [B, L] -> [B, L, E]."""
        word = embeddings.word_embeddings
        view = word.generator_view() if isinstance(word, DisentangledWordEmbedding) else contextlib.nullcontext()
        with view:
            return embeddings(input_ids, token_type_ids, project=False)

    def encode(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        # embeddings x [B, L, E] -> generator hidden states [B, L, Hg]
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)  # [B, L, Hg]
        # the encoder's stack: each layer with its window's mask, activation checkpointing, the final norm
        return layer_stack(self, x, padded_layer_inputs(self.windows, x, attention_mask), None)[0]


class RTDHead(nn.Module):
    """model.heads["rtd"]: the generator, and the discriminator's per-token head (HF's
    ElectraDiscriminatorPredictions: dense H -> H, GELU, dense_prediction H -> 1)."""

    def __init__(self, cfg, opts: RTDOptions, encoder: nn.Module, special_ids: tuple[int, ...] = ()):
        super().__init__()
        # The ids never sampled (`never_sampled`), on the model's device with it: indexing by a Python list copied
        # the list to the device in every micro-batch (a pageable host-to-device copy, which waits for the stream on
        # CUDA).
        # Not persistent: it is the tokenizer's, so checkpoints and exports stay as they were.
        self.register_buffer("special_ids", torch.tensor(sorted(special_ids), dtype=torch.long), persistent=False)
        if opts.disentangled:
            encoder.embeddings.word_embeddings = DisentangledWordEmbedding(encoder.embeddings.word_embeddings)
        # The generator reads the shared E-wide embeddings (E = H unless model.embedding_size is set, as in
        # ELECTRA-small: E 128 under H 256) through its own E -> Hg projection, and its head maps back to E.
        word = encoder.embeddings.word_embeddings
        self.generator = Generator(generator_config(cfg, opts), word.embedding_dim, word)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dense_prediction = nn.Linear(cfg.hidden_size, 1)

    def reset_parameters(self) -> None:
        self.generator.head.reset_parameters()

    def discriminate(self, hidden: torch.Tensor) -> torch.Tensor:
        # [..., H] -> logits [...] (> 0: "replaced")
        return self.dense_prediction(F.gelu(self.dense(hidden))).squeeze(-1)

    def generator_logits(self, embeddings: Embeddings, input_ids, token_type_ids=None, attention_mask=None):
        """Dense generator MLM logits [B, L, V] (for export checks; training uses the masked rows only)."""
        return self.generator.head(self.generator(embeddings, input_ids, token_type_ids, attention_mask))


def _generate(
    generator: Generator,
    x: torch.Tensor,
    attention_mask: torch.Tensor | None,
    positions: torch.Tensor,
    targets: torch.Tensor,
    special_ids: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The generator over its embeddings x [B, L, E], predicting the masked `positions` [M] (flat into [B * L]):
    (its cross-entropy summed over `targets`, how many its argmax gets right, one token sampled per position [M]).
    Sparse, like mlm's head. A plain function, compiled with the model.

    Samples come from softmax(logits / temperature) with the special tokens never drawn: the discriminator should
    only ever see real text (no [MASK] at pretraining that fine-tuning would not show). They use torch's default
    generator (CPU or CUDA per device; a compiled graph draws its seeds from it): checkpoints save and restore both,
    so a resumed run draws the same samples."""
    hidden = generator.encode(x, attention_mask)  # [B, L, Hg]
    logits = generator.head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)).float()  # [M, V]
    gen_sum, correct = summed_ce_and_correct(logits, targets)
    with torch.no_grad():
        scores = (logits / temperature).index_fill(1, special_ids, float("-inf"))
        sampled = sample_categorical(torch.softmax(scores, dim=-1))  # [M]
    return gen_sum, correct, sampled


def _discriminator_loss(
    head: RTDHead, hidden: torch.Tensor, labels: torch.Tensor, real: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The discriminator's logits [B, L] (> 0: "replaced") over hidden [B, L, H], and its binary cross-entropy
    against labels [B, L] summed over the real tokens (`real`: 1.0, padding 0.0). Compiled with the model."""
    logits = head.discriminate(hidden).float()
    return logits, F.binary_cross_entropy_with_logits(logits, labels, weight=real, reduction="sum")


def sample_categorical(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs [M, V] by inverting the CDF: one uniform per row instead of the V random
    numbers torch.multinomial spends per row on CPU (the same distribution, several times faster)."""
    cdf = probs.cumsum(dim=-1)  # [M, V]
    u = torch.rand(probs.shape[0], 1, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]  # [M, 1]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


class Sampled(NamedTuple):
    """What the generator's pass leaves for the losses."""

    gen_sum: torch.Tensor  # generator cross-entropy summed over the M masked tokens
    gen_correct: torch.Tensor  # its argmax right at how many of them
    replaced: torch.Tensor  # [M] 1.0 where the sample differs from the original token
    labels: torch.Tensor  # [B, L] the discriminator's targets: 1.0 at replaced tokens


@register
class ReplacedTokenDetection(Objective):
    name = "rtd"
    Options = RTDOptions
    rewrites_inputs = True
    pad_values = {"rtd_mlm_labels": IGNORE_INDEX}

    def prepare(self, sample, rng):
        positions = choose_positions(candidate_positions(sample, self.tokens), self.options.mask_prob, rng)
        sample["input_ids"], sample["rtd_mlm_labels"] = corrupt(
            sample["input_ids"], positions, self.options, self.tokens, rng
        )
        return sample

    def collate(self, arrays):
        positions, targets = flat_targets(arrays["rtd_mlm_labels"])  # [M] into [B * L], [M] the original tokens
        return {"rtd_positions": positions, "rtd_targets": targets}

    def target_counts(self, arrays):
        # The generator predicts the masked tokens; the discriminator scores every non-padding token.
        return {
            f"{self.name}_gen": len(arrays["rtd_positions"]),
            f"{self.name}_disc": int(arrays["attention_mask"].sum()),
        }

    def build_head(self, model_config, encoder):
        return RTDHead(model_config, self.options, encoder, self.never_sampled(model_config.vocab_size))

    def never_sampled(self, vocab_size: int) -> tuple[int, ...]:
        """Ids the generator never samples: all but the tokenizer's replaceable ones (special tokens, [unusedN]
        fillers, and rows of a vocabulary wider than the tokenizer), as mlm's random replacements."""
        replaceable = self.tokens.replaceable
        if not len(replaceable):  # special ids given without a tokenizer (tests)
            return self.tokens.special_ids
        keep = np.zeros(vocab_size, dtype=bool)  # [V]
        keep[replaceable[replaceable < vocab_size]] = True
        return tuple(int(i) for i in np.flatnonzero(~keep))

    def before_encoder(self, batch, forward, model):
        """Run the generator at the masked positions, keep its loss, and give the encoder (the discriminator) the
        original ids with the masked positions replaced by samples."""
        head: RTDHead = model.heads[self.name]
        ids = forward.input_ids  # [B, L] as masked for the generator
        positions, targets = batch["rtd_positions"], batch["rtd_targets"]  # [M] each
        x = head.generator.embed(model.encoder.embeddings, ids, forward.token_type_ids)  # [B, L, E]
        gen_sum, gen_correct, sampled = compiled(_generate, model.config, varying=(positions, targets))(
            head.generator, x, forward.attention_mask, positions, targets, head.special_ids, self.options.temperature
        )
        with torch.no_grad():
            flat = ids.reshape(-1)
            disc_ids = flat.index_copy(0, positions, sampled).view_as(ids)  # [B, L] the original ids, samples in
            replaced = (sampled != targets).float()  # [M]: a sample equal to the original is not a replacement
            # ELECTRA scores every non-padding token, [CLS]/[SEP] included (never replaced: label 0).
            labels = torch.zeros_like(flat, dtype=torch.float32).index_copy(0, positions, replaced).view_as(ids)
        forward.input_ids = disc_ids
        forward.carry[self.name] = Sampled(gen_sum, gen_correct, replaced, labels)

    def loss(self, batch, forward, model, weights):
        head: RTDHead = model.heads[self.name]
        gen_sum, gen_correct, replaced, labels = forward.carry[self.name]  # Sampled
        real = batch["attention_mask"].float()  # [B, L]: padding weighs 0
        logits, disc_sum = compiled(_discriminator_loss, model.config)(head, forward.hidden, labels, real)
        gen_term, disc_term = f"{self.name}_gen", f"{self.name}_disc"
        total = self.options.gen_weight * gen_sum * weights(gen_term) + self.options.disc_weight * disc_sum * weights(
            disc_term
        )
        m, t = replaced.shape[0], weights.counts.get(disc_term, 0)  # host numbers
        return ObjectiveOutput(
            total,
            {
                "gen_loss": Mean(gen_sum.detach(), m),
                "gen_accuracy": Mean(gen_correct, m),
                # how often the generator's sample is the original token (then it is no replacement)
                "gen_sampled_original": Mean(m - replaced.sum(), m),
                "disc_loss": Mean(disc_sum.detach(), t),
                "disc_accuracy": Mean((((logits > 0).float() == labels).float() * real).sum(), t),
                "disc_auc": BinaryAUC(logits, labels, real),
                "replaced_fraction": Mean((labels * real).sum(), t),  # of non-padding tokens: the positive rate
            },
        )
