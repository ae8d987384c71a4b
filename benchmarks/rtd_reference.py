"""Our ELECTRA (the rtd objective) against a reference built from transformers' classes, trained side by side on the
same batches: does ours follow the reference's training dynamics?

Why: an ELECTRA discriminator first sits at its base rate, the loss of always predicting the replaced fraction p
(binary entropy H(p): about 0.41 nats at the usual p of 0.14, AUC near 0.5), often for thousands of steps, until
the generator's samples and the discriminator's features let it leave. A stall of ours there is a bug only if the
reference leaves earlier on the same data and budget. The reference is transformers' ElectraForMaskedLM (generator)
+ ElectraForPreTraining (discriminator) with ELECTRA's embedding sharing: one embeddings module (word, position and
type tables and the embedding LayerNorm) for both, and the generator's output layer tied to the word table.

Both sides see the same batches, built as the trainer builds them (PretrainDataset + Collator through build_loader,
masked by our rtd objective's `prepare`), and train with the same optimizer: our AdamW and parameter groups
(`pretrain.train.optim.build_optimizer`, clipping on the device as the trainer's fp32 ZeRO-0 path does) and our
learning-rate schedule (`build_scheduler`). Ours runs from `build_model` and computes its loss exactly as the
trainer does for one micro-batch (`step_loss_weights`, then `model(batch, weights)`); plain PyTorch, fp32, no
DeepSpeed, no autocast. The reference's loss is gen_weight x HF's generator MLM mean + disc_weight x HF's
discriminator BCE mean over the real tokens. Each side keeps its own torch random stream (dropout, sampling), both
seeded as the trainer seeds its stream. The reference samples with `--ref-sampler`: gumbel (ELECTRA's argmax of
logits + Gumbel noise), multinomial, or ours (this step's replacement tokens of ours, so that with --copy-init and
--dropout 0 both sides see identical inputs and the curves differ by rounding only); special tokens are never drawn,
as in ours. For a fixed --seed (and --threads) a CPU run is deterministic.

    # CPU, small (about 1 s a step for both sides on one thread; neither leaves the base rate this soon)
    python benchmarks/rtd_reference.py --steps 300
    # step-0 equivalence only, then identical inputs for 40 steps (the CI setting, about 10 s)
    python benchmarks/rtd_reference.py --check --steps 0
    python benchmarks/rtd_reference.py --copy-init --ref-sampler ours --dropout 0 --hidden 64 --layers 2 \\
        --heads 1 --inter 256 --vocab 512 --batch 16 --seq 64 --steps 40 --log-every 10
    # GPU: BERT-mini-ish with ELECTRA-small's factorized embeddings, long enough for the reference's discriminator
    # to leave its base rate (raise --steps if its disc_loss still sits on base_loss at the end)
    python benchmarks/rtd_reference.py --device cuda --threads 0 --hidden 256 --layers 4 --heads 4 --inter 1024 \\
        --embedding-size 128 --vocab 8192 --batch 128 --seq 128 --lr 5e-4 --warmup 1000 --steps 20000 \\
        --log-every 200

`--check` first compares one step at dropout 0, the reference copied from our initial weights and fed our sampled
tokens: losses, discriminator logits and every gradient (ours mapped to HF names by the export tables); it exits
with status 1 if they differ beyond float rounding (--check-tol). `--steps 0` stops there. `--which ours|ref` trains
one side only (e.g. the two in separate processes, to time them or to fit a time limit).

Outputs under --out (default <work>/rtd-reference): curves.jsonl (one line per log step: step, tokens (real tokens
seen), lr, wall_s, and per side loss, disc_loss, base_loss, disc_auc (exact, over the interval's tokens), disc_acc,
replaced_fraction, gen_loss, gen_acc, sampled_original, grad_norm; written as it goes), summary.json (settings,
device, the step-0 check, final values per side, the max |ours - ref| of each metric over the logged curve, wall
time) and curves.png (discriminator loss with its base rate, AUC and generator accuracy, ours against the
reference); a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "en-mix.train.jsonl"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from data_pipeline.loader import PretrainDataset, build_loader  # noqa: E402
from data_pipeline.shards import ShardSet, build_shards  # noqa: E402
from data_pipeline.tokenizer import load_tokenizer, special_tokens, tokenizer_hash, train_tokenizer  # noqa: E402
from pretrain.core.config import RunConfig  # noqa: E402
from pretrain.hf.electra import hf_electra_config, to_hf_electra_state_dicts  # noqa: E402
from pretrain.hf.interop import electra_discriminator_table, generator_table, to_hf  # noqa: E402
from pretrain.model.pretraining import PretrainingModel  # noqa: E402
from pretrain.train.optim import build_optimizer, build_scheduler  # noqa: E402
from pretrain.train.setup import build_model, build_sample_source, config_from_dict  # noqa: E402
from pretrain.train.trainer import step_loss_weights  # noqa: E402

SIDES = ("ours", "ref")
METRICS = (
    "loss",
    "disc_loss",
    "base_loss",
    "disc_auc",
    "disc_acc",
    "replaced_fraction",
    "gen_loss",
    "gen_acc",
    "sampled_original",
    "grad_norm",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--corpus",
        type=Path,
        default=DEFAULT_CORPUS if DEFAULT_CORPUS.is_file() else ROOT / "data" / "us-speeches.public-domain.jsonl",
    )
    p.add_argument("--tokenizer", type=Path, help="an existing tokenizer directory (with --shards: nothing is built)")
    p.add_argument("--shards", type=Path, help="existing shards of the corpus made with --tokenizer")
    p.add_argument("--work", type=Path, help="where the tokenizer and shards are built and kept (default: a temp dir)")
    p.add_argument("--out", type=Path, help="output directory (default: <work>/rtd-reference)")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary of a tokenizer built here")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--embedding-size", type=int, default=0, help="0 = hidden (ELECTRA-small: 128 under 256)")
    p.add_argument("--gen-size", type=float, default=0.25, help="generator width / discriminator width")
    p.add_argument("--gen-layers", type=int, default=0, help="generator depth (0 = --layers)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (0 with --check: the check only)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0 = off)")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    p.add_argument("--disc-weight", type=float, default=50.0)
    p.add_argument("--gen-weight", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0 = torch's default). 1: small models gain little from more, and an intra-op pool "
        "fights any other load on the machine (40 steps of the tiny CI setting: 8 s on 1 thread, 54 s on 2 beside "
        "another job on 2 cores)",
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--which", choices=("both", "ours", "ref"), default="both", help="which side(s) to train")
    p.add_argument("--ref-sampler", choices=("gumbel", "multinomial", "ours"), default="gumbel")
    p.add_argument("--copy-init", action="store_true", help="the reference starts from our initial weights")
    p.add_argument("--check", action="store_true", help="first the step-0 equivalence check (see above)")
    p.add_argument("--check-tol", type=float, default=1e-4, help="largest relative difference the check accepts")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop training after this long (0 = no limit)")
    a = p.parse_args(argv)
    if a.ref_sampler == "ours" and a.which != "both":
        p.error("--ref-sampler ours needs --which both (the reference takes our samples)")
    if a.log_every < 1:
        p.error("--log-every must be >= 1")
    if (a.tokenizer is None) != (a.shards is None):
        p.error("give --tokenizer and --shards together (or neither, to build them under --work)")
    return a


# ----------------------------------------------------------------------------------------------
# Data and models


def prepare_data(a: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """(tokenizer, shards): as given, or built under `work` once per corpus and vocabulary and reused."""
    if a.tokenizer is not None:
        return a.tokenizer, a.shards
    base = work / f"{a.corpus.stem}-v{a.vocab}"
    tok, shards = base / "tokenizer", base / "shards"
    if not (tok / "tokenizer.json").is_file():
        train_tokenizer([str(a.corpus)], tok, vocab_size=a.vocab, show_progress=False)
    build_shards([str(a.corpus)], tok, shards, num_workers=0, show_progress=False)  # a no-op when built
    return tok, shards


def run_config(a: argparse.Namespace, tok: Path, shards: Path, out: Path, dropout: float) -> RunConfig:
    """The run config a `pretrain train` of this setting would resolve: our side is built from it as the trainer
    builds it (model, samples, optimizer, schedule)."""
    return config_from_dict(
        {
            "name": "ours",
            "output_dir": str(out),
            "data": {"tokenizer": str(tok), "shards": str(shards), "max_seq_len": a.seq, "loader_workers": 0},
            "model": {
                "hidden_size": a.hidden,
                "num_layers": a.layers,
                "num_heads": a.heads,
                "intermediate_size": a.inter,
                "embedding_size": a.embedding_size,
                "max_position_embeddings": max(512, a.seq),
                "hidden_dropout": dropout,
                "attention_dropout": dropout,
            },
            "objectives": {
                "rtd": {
                    "generator_size": a.gen_size,
                    "generator_layers": a.gen_layers,
                    "gen_weight": a.gen_weight,
                    "disc_weight": a.disc_weight,
                    "temperature": a.temperature,
                    "mask_prob": a.mask_prob,
                }
            },
            "train": {
                "micro_batch_size": a.batch,
                "grad_accum_steps": 1,
                "max_steps": max(1, a.steps),
                "lr": a.lr,
                "warmup_steps": a.warmup,
                "weight_decay": a.wd,
                "adam_beta2": a.beta2,
                "adam_eps": a.eps,
                "grad_clip": a.clip,
                "precision": "fp32",
                "seed": a.seed,
                "log_every": a.log_every,
            },
            "wandb": {"mode": "disabled"},
        }
    )


class Reference(nn.Module):
    """ELECTRA from transformers' classes: the generator's embeddings module IS the discriminator's (tables and
    LayerNorm), and generator_lm_head.weight IS the word table. Each model projects the E-wide embeddings to its
    own width (`embeddings_project`) where the widths differ."""

    def __init__(self, disc_config, gen_config):
        import transformers

        super().__init__()
        self.disc = transformers.ElectraForPreTraining(disc_config)
        self.gen = transformers.ElectraForMaskedLM(gen_config)
        self.gen.electra.embeddings = self.disc.electra.embeddings
        self.gen.generator_lm_head.weight = self.disc.electra.embeddings.word_embeddings.weight
        self.check_shared()

    def check_shared(self) -> None:
        assert self.gen.electra.embeddings is self.disc.electra.embeddings
        assert self.gen.generator_lm_head.weight is self.disc.electra.embeddings.word_embeddings.weight


def build_reference(ours: PretrainingModel, tokens, seed: int, copy_init: bool) -> Reference:
    """The reference of our model's shape (`hf_electra_config`, as the export writes it): its own initialisation
    (HF's, seeded), or ours copied through the export's state dicts."""
    import transformers

    transformers.logging.set_verbosity_error()
    gen_body = ours.heads["rtd"].generator.config
    disc_config = hf_electra_config(ours.config, ours.config, tokens, "ElectraForPreTraining")
    gen_config = hf_electra_config(ours.config, gen_body, tokens, "ElectraForMaskedLM")
    torch.manual_seed(seed)
    ref = Reference(disc_config, gen_config)
    if copy_init:
        disc_state, gen_state = to_hf_electra_state_dicts(ours)
        for model, state in ((ref.disc, disc_state), (ref.gen, gen_state)):
            missing, unexpected = model.load_state_dict(state, strict=False)
            missing = [k for k in missing if k != "generator_lm_head.weight"]  # tied to the word table
            if missing or unexpected:
                raise SystemExit(f"copy-init: {type(model).__name__} missing {missing}, unexpected {unexpected}")
        ref.check_shared()  # load_state_dict copies in place: the sharing holds
    return ref


def our_stream(a: argparse.Namespace, cfg: RunConfig, model: PretrainingModel, tokens):
    """Our micro-batches, host-side, exactly as the trainer's loader yields them for one rank, no accumulation."""
    shards = ShardSet(cfg.shards_dir, verify=True, expected_tokenizer_hash=tokenizer_hash(cfg.tokenizer_dir))
    samples = build_sample_source(cfg, shards, tokens, model.objectives)
    dataset = PretrainDataset(samples, model.objectives, cfg.train.seed)
    return iter(build_loader(dataset, tokens.pad, 0, a.batch, 1, 0, 1, num_workers=0))


def loss_weights(cfg: RunConfig, batch) -> dict[str, float] | None:
    """The per-target weights the trainer passes for a step of this one micro-batch."""
    return step_loss_weights([batch]) if cfg.train.loss_normalization == "step" else None


class RngStream:
    """One side's torch random stream (dropout, sampling): entered, it is the global one; left, it is kept."""

    def __init__(self, device: torch.device):
        self.cuda = device if device.type == "cuda" else None
        self.state = self._get()

    def _get(self):
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.cuda) if self.cuda else None

    def __enter__(self):
        torch.set_rng_state(self.state[0])
        if self.cuda:
            torch.cuda.set_rng_state(self.state[1], self.cuda)

    def __exit__(self, *exc):
        self.state = self._get()


# ----------------------------------------------------------------------------------------------
# One step of each side, and what it shows


@dataclass
class Observation:
    """One step of one side. Tensors stay on the device until a log step. T real tokens, M masked ones."""

    loss: torch.Tensor  # the weighted total that was backpropagated
    logits: torch.Tensor  # [T] discriminator logits at the real tokens (> 0: "replaced")
    labels: torch.Tensor  # [T] 1.0 where the token was replaced
    sampled: torch.Tensor  # [M] the generator's samples at the masked positions
    gen_sum: torch.Tensor  # generator cross-entropy summed over the M masked tokens
    gen_correct: torch.Tensor  # argmax right at how many
    sampled_original: torch.Tensor  # samples equal to the original token
    tokens: int  # T, a host number
    masked: int  # M, a host number


class OursProbe:
    """Watches our forward without changing it: the discriminator's input ids (an encoder pre-hook: the original
    ids with the samples in) and its logits (a hook on the rtd head's last layer)."""

    def __init__(self, model: PretrainingModel):
        self.seen: dict[str, torch.Tensor] = {}
        model.encoder.register_forward_pre_hook(lambda m, args: self.seen.__setitem__("ids", args[0]))
        model.heads["rtd"].dense_prediction.register_forward_hook(
            lambda m, args, out: self.seen.__setitem__("logits", out.detach().squeeze(-1))  # [B, L]
        )

    def step(self, model: PretrainingModel, batch, weights) -> tuple[torch.Tensor, dict, Observation]:
        loss, metrics = model(batch, weights)  # as the trainer's step: engine(batch, weights)
        positions, targets = batch["rtd_positions"], batch["rtd_targets"]  # [M] into [B * L], [M]
        real = batch["attention_mask"]  # [B, L] bool
        sampled = self.seen["ids"].reshape(-1).index_select(0, positions)  # [M]
        replaced = (sampled != targets).float()
        labels = torch.zeros(real.numel(), device=real.device).index_copy(0, positions, replaced).view_as(real)
        observed = Observation(
            loss=loss.detach(),
            logits=self.seen["logits"][real].float(),
            labels=labels[real],
            sampled=sampled,
            gen_sum=metrics["rtd/gen_loss"].total,
            gen_correct=metrics["rtd/gen_accuracy"].total,
            sampled_original=(sampled == targets).sum(),
            tokens=batch.tokens,
            masked=int(positions.shape[0]),
        )
        return loss, metrics, observed


def draw(logits: torch.Tensor, special: list[int], temperature: float, how: str) -> torch.Tensor:
    """The reference's sample at each masked row of logits [M, V] -> [M], from softmax(logits / T) with the
    special tokens excluded (as ours excludes them)."""
    scores = logits.detach().float() / temperature
    scores[:, special] = float("-inf")
    if how == "gumbel":  # ELECTRA's sample_from_softmax
        u = torch.rand_like(scores)
        return (scores - torch.log(-torch.log(u + 1e-9) + 1e-9)).argmax(-1)
    return torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)


def reference_step(
    ref: Reference, batch, a: argparse.Namespace, special: list[int], ours_sampled: torch.Tensor | None
) -> tuple[torch.Tensor, dict, Observation]:
    """The reference's loss on our masked batch: HF's own MLM and discriminator losses. `ours_sampled` [M]: use
    these replacements instead of drawing."""
    ids, real = batch["input_ids"], batch["attention_mask"]  # [B, L] masked for the generator; bool
    mask, types = real.long(), batch.get("token_type_ids")
    positions, targets = batch["rtd_positions"], batch["rtd_targets"]  # [M] into [B * L], [M]
    gen = ref.gen(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=batch["rtd_mlm_labels"])
    logits = gen.logits.reshape(-1, gen.logits.shape[-1]).index_select(0, positions)  # [M, V]
    with torch.no_grad():
        sampled = ours_sampled if ours_sampled is not None else draw(logits, special, a.temperature, a.ref_sampler)
        disc_ids = ids.reshape(-1).index_copy(0, positions, sampled).view_as(ids)  # original ids, samples in
        replaced = (sampled != targets).float()
        labels = torch.zeros(ids.numel(), device=ids.device).index_copy(0, positions, replaced).view_as(ids)
    disc = ref.disc(input_ids=disc_ids, attention_mask=mask, token_type_ids=types, labels=labels)
    loss = a.gen_weight * gen.loss + a.disc_weight * disc.loss
    observed = Observation(
        loss=loss.detach(),
        logits=disc.logits.detach()[real].float(),
        labels=labels[real],
        sampled=sampled,
        gen_sum=gen.loss.detach() * positions.shape[0],
        gen_correct=(logits.argmax(-1) == targets).sum(),
        sampled_original=(sampled == targets).sum(),
        tokens=batch.tokens,
        masked=int(positions.shape[0]),
    )
    return loss, {"gen_loss": gen.loss.detach(), "disc_loss": disc.loss.detach()}, observed


# ----------------------------------------------------------------------------------------------
# Metrics of a log interval


def exact_auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Mann-Whitney AUC of scores [N] against labels [N] in {0, 1}, ties at their average rank; None without both
    classes."""
    positive = labels > 0.5
    n1 = int(positive.sum())
    n0 = positive.numel() - n1
    if n1 == 0 or n0 == 0:
        return None
    ordered, order = torch.sort(scores.double())
    _, run, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()  # 1-based rank of each run's last element
    average = ends - (counts.double() - 1) / 2  # [runs]: the mean rank of each run of equal scores
    rank_sum = average[run][positive[order]].sum()
    return float((rank_sum - n1 * (n1 + 1) / 2) / (n1 * n0))


def binary_entropy(p: float) -> float:
    """Nats: the BCE of always predicting p, the discriminator's base rate."""
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log(p) + (1 - p) * math.log1p(-p))


class Interval:
    """One side's sums since the last log step, on the device; `read` moves them to the host once."""

    def __init__(self):
        self.observed: list[Observation] = []
        self.grad_norms: list[torch.Tensor] = []

    def add(self, observed: Observation, grad_norm: torch.Tensor | None) -> None:
        self.observed.append(observed)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm.detach().reshape(()))

    def read(self) -> dict[str, float | None]:
        obs, self.observed = self.observed, []
        logits = torch.cat([o.logits for o in obs]).double()  # [T over the interval]; float64 sums: rounding shows
        labels = torch.cat([o.labels for o in obs]).double()
        sums = torch.stack(
            [
                torch.stack([o.loss.double() for o in obs]).sum(),
                F.binary_cross_entropy_with_logits(logits, labels, reduction="sum"),
                ((logits > 0).double() == labels).double().sum(),
                labels.sum(),
                sum(o.gen_sum.double() for o in obs),
                sum(o.gen_correct.double() for o in obs),
                sum(o.sampled_original.double() for o in obs),
            ]
        ).tolist()
        loss, disc_sum, disc_correct, replaced, gen_sum, gen_correct, sampled_original = sums
        tokens, masked = sum(o.tokens for o in obs), sum(o.masked for o in obs)
        norms, self.grad_norms = self.grad_norms, []
        return {
            "loss": loss / len(obs),
            "disc_loss": disc_sum / tokens,
            "base_loss": binary_entropy(replaced / tokens),
            "disc_auc": exact_auc(logits, labels),
            "disc_acc": disc_correct / tokens,
            "replaced_fraction": replaced / tokens,
            "gen_loss": gen_sum / masked if masked else None,
            "gen_acc": gen_correct / masked if masked else None,
            "sampled_original": sampled_original / masked if masked else None,
            "grad_norm": float(torch.stack(norms).double().mean()) if norms else None,
        }


# ----------------------------------------------------------------------------------------------
# Step-0 equivalence


def relative(diff: float, scale: float) -> float:
    return diff / max(scale, 1e-30)


def step0_check(a: argparse.Namespace, tok: Path, shards: Path, out: Path, device: torch.device) -> dict:
    """One step at dropout 0, the reference a copy of our initial weights fed our samples: losses, discriminator
    logits and every gradient (ours under HF names through the export tables) must agree to rounding."""
    cfg = run_config(a, tok, shards, out, dropout=0.0)
    tokens = special_tokens(load_tokenizer(cfg.tokenizer_dir))
    ours = build_model(cfg, tokens)
    ref = build_reference(ours, tokens, a.seed + 1, copy_init=True)
    ours.to(device).train()
    ref.to(device).train()
    probe = OursProbe(ours)
    batch = next(our_stream(a, cfg, ours, tokens))
    torch.manual_seed(a.seed * 1000)
    loss_o, metrics_o, obs_o = probe.step(ours, batch.to(device), loss_weights(cfg, batch))
    loss_o.backward()
    loss_r, parts_r, obs_r = reference_step(ref, batch.to(device), a, list(tokens.special_ids), obs_o.sampled)
    loss_r.backward()

    # Ours' gradients under HF names, one dict per HF model (both name their layers electra.encoder.layer.*).
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    mapped = {
        "disc": to_hf(electra_discriminator_table(ours), grads),
        "gen": to_hf(generator_table(ours.heads["rtd"].generator), grads),
    }
    # Each tensor's difference relative to its own scale, floored at 1e-6 of the largest gradient: the attention
    # key biases' gradients are zero in exact arithmetic (softmax ignores a shift shared by all keys), rounding only.
    floor = 1e-6 * max(float(g.abs().max()) for g in grads.values())
    rows, unmatched, seen = [], [], set()
    for side, model in (("disc", ref.disc), ("gen", ref.gen)):
        for name, param in model.named_parameters():
            if id(param) in seen:  # the shared embeddings: compared once, under the discriminator
                continue
            seen.add(id(param))
            if name not in mapped[side] or param.grad is None:
                unmatched.append(f"{side}:{name}")
                continue
            ours_grad, ref_grad = mapped[side][name], param.grad.detach().cpu().float()
            diff, scale = float((ours_grad - ref_grad).abs().max()), float(ref_grad.abs().max())
            rows.append({"tensor": f"{side}:{name}", "abs": diff, "rel": diff / (scale + floor), "scale": scale})
    rows.sort(key=lambda r: -r["rel"])

    gen_o, disc_o = metrics_o["rtd/gen_loss"].value(), metrics_o["rtd/disc_loss"].value()
    gen_r, disc_r = float(parts_r["gen_loss"]), float(parts_r["disc_loss"])
    logits_diff = float((obs_o.logits - obs_r.logits).abs().max())
    result = {
        "loss_ours": float(loss_o.detach()),
        "loss_ref": float(loss_r.detach()),
        "loss_rel_diff": relative(abs(float(loss_o.detach()) - float(loss_r.detach())), abs(float(loss_r.detach()))),
        "gen_loss_ours": gen_o,
        "gen_loss_ref": gen_r,
        "disc_loss_ours": disc_o,
        "disc_loss_ref": disc_r,
        "disc_logits_max_abs_diff": logits_diff,
        "disc_logits_scale": float(obs_r.logits.abs().max()),
        "labels_equal": bool(torch.equal(obs_o.labels, obs_r.labels)),
        "replaced_fraction": float(obs_o.labels.mean()),
        "masked_tokens": obs_o.masked,
        "real_tokens": obs_o.tokens,
        "grad_tensors_compared": len(rows),
        "grad_unmatched": unmatched,
        "grad_max_abs_diff": max(r["abs"] for r in rows),
        "grad_max_rel_diff": rows[0]["rel"],
        "grad_worst": rows[:5],
    }
    result["ok"] = (
        result["labels_equal"]
        and not unmatched
        and result["loss_rel_diff"] <= a.check_tol
        and relative(abs(gen_o - gen_r), gen_r) <= a.check_tol
        and relative(abs(disc_o - disc_r), disc_r) <= a.check_tol
        and relative(logits_diff, result["disc_logits_scale"]) <= a.check_tol
        and result["grad_max_rel_diff"] <= a.check_tol
    )
    return result


# ----------------------------------------------------------------------------------------------
# Training side by side


@dataclass
class Side:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rng: RngStream
    interval: Interval


def make_side(model: nn.Module, cfg: RunConfig, device: torch.device) -> Side:
    model.to(device).train()
    # the trainer's fp32 ZeRO-0 optimizer: our AdamW and parameter groups, clipping itself on the device
    optimizer = build_optimizer(model, cfg.train, guard=True)
    return Side(model, optimizer, build_scheduler(optimizer, cfg.train), RngStream(device), Interval())


def train(a: argparse.Namespace, tok: Path, shards: Path, out: Path, device: torch.device, info: dict) -> list[dict]:
    cfg = run_config(a, tok, shards, out, dropout=a.dropout)
    tokens = special_tokens(load_tokenizer(cfg.tokenizer_dir))
    special = list(tokens.special_ids)
    ours = build_model(cfg, tokens)  # seeded by train.seed, as the trainer builds it
    ref = build_reference(ours, tokens, a.seed + 1, a.copy_init) if a.which != "ours" else None
    data = our_stream(a, cfg, ours, tokens)
    torch.manual_seed(a.seed * 1000)  # the trainer's dropout / sampling stream on rank 0; each side starts from it
    sides: dict[str, Side] = {}
    if a.which != "ref":
        probe = OursProbe(ours)
        sides["ours"] = make_side(ours, cfg, device)
    if ref is not None:
        sides["ref"] = make_side(ref, cfg, device)
    info.update(
        params={name: sum(p.numel() for p in side.model.parameters()) for name, side in sides.items()},
        vocab_size=ours.config.vocab_size,
        generator={
            k: getattr(ours.heads["rtd"].generator.config, k)
            for k in ("hidden_size", "num_layers", "num_heads", "intermediate_size")
        },
        attn_implementation=ref.disc.config._attn_implementation if ref is not None else None,
    )

    curves: list[dict] = []
    curves_path = out / "curves.jsonl"
    curves_path.write_text("")
    seen_tokens, started = 0, time.time()
    for step in range(1, a.steps + 1):
        batch = next(data)
        weights = loss_weights(cfg, batch)
        on_device = batch.to(device)
        seen_tokens += batch.tokens
        ours_sampled = None
        for name, side in sides.items():
            with side.rng:
                if name == "ours":
                    loss, _, observed = probe.step(side.model, on_device, weights)
                    ours_sampled = observed.sampled if a.ref_sampler == "ours" else None
                else:
                    loss, _, observed = reference_step(side.model, on_device, a, special, ours_sampled)
                loss.backward()
                side.optimizer.step()  # clips (train.grad_clip), then AdamW
                side.scheduler.step()
                side.optimizer.zero_grad(set_to_none=True)
            side.interval.add(observed, getattr(side.optimizer, "grad_norm", None))
        out_of_time = a.max_minutes > 0 and time.time() - started > 60 * a.max_minutes
        if step % a.log_every == 0 or step == a.steps or out_of_time:
            record = {
                "step": step,
                "tokens": seen_tokens,
                "lr": next(iter(sides.values())).scheduler.get_last_lr()[0],
                "wall_s": round(time.time() - started, 2),
            }
            for name, side in sides.items():
                record[name] = side.interval.read()  # unrounded: the two sides may differ by rounding only
            curves.append(record)
            with curves_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"step {step}: " + "  ".join(_brief(record, name) for name in sides), file=sys.stderr, flush=True)
        if out_of_time:
            print(f"stopping at step {step}: --max-minutes {a.max_minutes}", file=sys.stderr)
            break
    return curves


def _brief(record: dict, side: str) -> str:
    m = record[side]
    return (
        f"{side} disc {m['disc_loss']:.4f}/{m['base_loss']:.4f} auc {_fmt(m['disc_auc'])} gen_acc {_fmt(m['gen_acc'])}"
    )


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ----------------------------------------------------------------------------------------------
# Outputs


def max_differences(curves: list[dict]) -> dict[str, float | None]:
    """Per metric, the largest |ours - ref| over the logged steps where both have a value."""
    out = {}
    for metric in METRICS:
        diffs = [
            abs(r["ours"][metric] - r["ref"][metric])
            for r in curves
            if "ours" in r and "ref" in r and r["ours"][metric] is not None and r["ref"][metric] is not None
        ]
        out[metric] = max(diffs) if diffs else None
    return out


def plot(curves: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("disc_loss", "discriminator loss (dashed: base rate)"), ("disc_auc", "discriminator AUC"))
    panels += (("gen_acc", "generator accuracy"),)
    for ax, (metric, title) in zip(axes, panels):
        for side, color in zip(SIDES, ("C0", "C1")):
            rows = [r for r in curves if side in r and r[side][metric] is not None]
            if not rows:
                continue
            steps = [r["step"] for r in rows]
            ax.plot(steps, [r[side][metric] for r in rows], color=color, label=side)
            if metric == "disc_loss":
                ax.plot(steps, [r[side]["base_loss"] for r in rows], color=color, linestyle="--", linewidth=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def markdown_table(curves: list[dict], max_rows: int = 20) -> str:
    sides = [s for s in SIDES if curves and s in curves[-1]]
    stride = max(1, math.ceil(len(curves) / max_rows))
    rows = [r for i, r in enumerate(curves) if i % stride == 0 or i == len(curves) - 1]
    head = ["step", "tokens"]
    for label in ("disc loss / base", "AUC", "disc acc / 1-rep", "gen acc", "sampled = orig"):
        head += [f"{s} {label}" for s in sides]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["step"]), _count(r["tokens"])]
        cells += [f"{r[s]['disc_loss']:.4f} / {r[s]['base_loss']:.4f}" for s in sides]
        cells += [_fmt(r[s]["disc_auc"]) for s in sides]
        cells += [f"{r[s]['disc_acc']:.3f} / {1 - r[s]['replaced_fraction']:.3f}" for s in sides]
        cells += [_fmt(r[s]["gen_acc"]) for s in sides]
        cells += [_fmt(r[s]["sampled_original"]) for s in sides]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    started = time.time()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    work = a.work or Path(tempfile.mkdtemp(prefix="rtd-reference-"))
    work.mkdir(parents=True, exist_ok=True)
    out = a.out or work / "rtd-reference"
    out.mkdir(parents=True, exist_ok=True)
    tok, shards = prepare_data(a, work)
    prepared = time.time()

    import transformers

    summary: dict = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "tokenizer": str(tok),
        "shards": str(shards),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    status = 0
    if a.check:
        summary["check"] = check = step0_check(a, tok, shards, out, device)
        print(
            f"step-0 check: {'ok' if check['ok'] else 'FAILED'}: loss {check['loss_ours']:.6f} vs "
            f"{check['loss_ref']:.6f}, logits max |diff| {check['disc_logits_max_abs_diff']:.2e}, gradients "
            f"max rel diff {check['grad_max_rel_diff']:.2e} over {check['grad_tensors_compared']} tensors"
        )
        status = 0 if check["ok"] else 1
    curves = train(a, tok, shards, out, device, summary) if a.steps > 0 else []
    if curves:
        summary["steps_run"] = curves[-1]["step"]
        summary["tokens"] = curves[-1]["tokens"]
        summary["final"] = {s: curves[-1][s] for s in SIDES if s in curves[-1]}
        summary["max_abs_diff"] = max_differences(curves) if a.which == "both" else None
        plot(curves, out / "curves.png")
        print(markdown_table(curves))
        if summary["max_abs_diff"]:
            print(
                "\nmax |ours - ref| over the curve: "
                + ", ".join(f"{k} {v:.2e}" for k, v in summary["max_abs_diff"].items() if v is not None)
            )
    summary["prepare_s"] = round(prepared - started, 2)
    summary["wall_s"] = round(time.time() - started, 2)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{out}: summary.json" + (", curves.jsonl, curves.png" if curves else "") + f" ({summary['wall_s']} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
