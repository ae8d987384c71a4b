"""What each `pretrain` subcommand accepts (`pretrain.cli` runs them): its arguments, and the options that mirror a
config field or a library parameter, whose default, help, type and choices are declared there, once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import math
import typing
from pathlib import Path
from typing import Any

from pretrain.core.config import CHOICES, CORPUS_FORMATS, DataConfig, RunConfig
from pretrain.core.errors import UserError
from pretrain.core.parsing import field_default, field_doc, field_type
from pretrain.evaluation.configs import FinetuneConfig

CONFIG_HELP = "a config file, or the name of a preset in configs/ (e.g. 'default', 'bert-mini'); see `pretrain presets`"
OVERRIDE_HELP = "dotted overrides of config keys, e.g. model.hidden_size=128 train.max_steps=500"


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0 (argparse names the option in its error); `inf` passed `> 0` and
    fine-tuned at an infinite learning rate, as a config's value would not (`parsing._coerce_scalar`)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def _whole_number(text: str, least: int, wanted: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number above 0, where 0 or less has no meaning (argparse names the option)."""
    return _whole_number(text, 1, "a whole number above 0")


def non_negative_int(text: str) -> int:
    """argparse type: a whole number, 0 or more, for an option whose 0 says 'all' or 'the default'."""
    return _whole_number(text, 0, "a whole number, 0 or more")


class StoreGiven(argparse.Action):
    """Stores the value as `store` does, and records the option in `args.given_options`: typed, even at its default
    value (`--pooling mean` asks for what the default would give, but asks for it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given_options = [*getattr(namespace, "given_options", []), option_string]


# ----------------------------------------------------------------------------------------------
# Options that mirror a config field or a library parameter: the default is declared there, once


class Mirrored:
    """The default of field (or parameter) `name` of `owner`: a dataclass, a function, or "module:attribute" for one
    imported only when the value is wanted (building every parser must not import torch for `finetune`'s)."""

    def __init__(self, owner: Any, name: str):
        self.owner, self.name = owner, name

    def target(self) -> Any:
        if not isinstance(self.owner, str):
            return self.owner
        module, _, attr = self.owner.partition(":")
        return getattr(importlib.import_module(module), attr)

    def value(self) -> Any:
        target = self.target()
        if dataclasses.is_dataclass(target):
            return field_default(target, self.name)
        default = inspect.signature(target).parameters[self.name].default
        assert default is not inspect.Parameter.empty, f"{self.owner}: parameter {self.name} has no default"
        return default

    def __str__(self) -> str:  # what --help shows as the default
        return str(self.value())


class ArchChoices:
    """--arch's choices: the registered HF architectures (`pretrain.hf.architectures`), imported only when the
    choices are wanted (building the parser must not import torch)."""

    def names(self) -> tuple[str, ...]:
        return importlib.import_module("pretrain.hf.architectures").names()

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __iter__(self):
        return iter(self.names())


def config_key(owner: Any, name: str) -> str | None:
    """'data.num_workers' for DataConfig's num_workers: the dotted key of a RunConfig section's field."""
    for f in dataclasses.fields(RunConfig):
        if field_type(RunConfig, f.name) is owner:
            return f"{f.name}.{name}"
    return None


def add_field_option(p: argparse.ArgumentParser, flag: str, owner: Any, name: str, **kwargs) -> argparse.Action:
    """`--flag`, its default taken from `owner`'s field or parameter `name` (see `Mirrored`), so it is declared once.

    A dataclass field also gives the help (its `doc`), type, choices (`CHOICES`, or a Literal) and, for a bool, the
    action: a flag that turns the default off or on. The action records `mirrors`, which tests/test_cli_defaults.py
    checks."""
    source = Mirrored(owner, name)
    key = config_key(owner, name)
    if dataclasses.is_dataclass(owner):
        default, tp = source.value(), field_type(owner, name)
        kwargs.setdefault("help", field_doc(owner, name).replace("%", "%%"))  # argparse formats help
        if tp is bool:  # args.<field>, whichever way the flag turns it (--cased: args.lowercase = False)
            kwargs.setdefault("action", "store_false" if default else "store_true")
            kwargs.setdefault("dest", name)
        elif tp in (int, float):
            kwargs.setdefault("type", tp)
        choices = CHOICES.get(key or "") or (typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None)
        if choices and "action" not in kwargs:
            kwargs.setdefault("choices", list(choices))
    else:
        default = source  # resolved after parsing (`resolve_mirrored`) or when --help prints it
    if kwargs.get("action") in ("store_true", "store_false"):
        said = f"sets {key}={str(kwargs['action'] == 'store_true').lower()}" if key else "default: off"
    else:
        said = f"default: %(default)s{f'; config key {key}' if key else ''}"
    kwargs["help"] = f"{kwargs.get('help', '').rstrip('.')} ({said})".lstrip()
    action = p.add_argument(flag, default=default, **kwargs)
    action.mirrors = source  # type: ignore[attr-defined]
    return action


def resolve_mirrored(args: argparse.Namespace) -> argparse.Namespace:
    """Replace the defaults left lazy by `add_field_option` by their values (importing their module only now)."""
    for key, value in vars(args).items():
        if isinstance(value, Mirrored):
            setattr(args, key, value.value())
    return args


class Parser(argparse.ArgumentParser):
    """Parses to plain values: the lazy defaults of `add_field_option` resolved (its subparsers are of this class)."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = super().parse_known_args(args, namespace)
        return resolve_mirrored(parsed), extra


def config_epilog() -> str:
    from pretrain.core.config import RunConfig
    from pretrain.core.parsing import describe_fields

    rows = describe_fields(RunConfig)
    width = max(len(k) for k, _, _ in rows)
    lines = [f"  {k:<{width}}  {doc} (default: {default})" for k, default, doc in rows]
    return (
        "config keys (set in the YAML file or as key=value overrides):\n"
        + "\n".join(lines)
        + "\n\nobjectives: objectives.<name>.<option>=value, e.g. objectives.mlm.mask_prob=0.2; "
        "see `pretrain objectives`"
    )


# The library functions whose parameters the evaluation commands mirror (imported lazily: they import torch)
INSPECT = "pretrain.evaluation.inspect:inspect_data"
EVALUATE = "pretrain.evaluation.evaluate:evaluate_mlm"
# finetune's options: a dataclass with no torch behind it, imported now so that its Literal fields give the choices
FINETUNE = FinetuneConfig
ST_EXPORT = "pretrain.hf.sentence_transformers:export_sentence_transformers"


def config_args(p: argparse.ArgumentParser, what: str = CONFIG_HELP) -> None:
    p.add_argument("config", help=what)
    p.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDE_HELP)


def bad_input_args(p: argparse.ArgumentParser) -> None:
    add_field_option(
        p,
        "--on-bad",
        DataConfig,
        "on_bad_document",
        help="bad documents (invalid UTF-8, bad JSON, missing field, too long): skip and count, or stop "
        "naming file and line",
    )
    add_field_option(p, "--max-document-bytes", DataConfig, "max_document_bytes")


def run_args(p):
    config_args(p)
    p.add_argument("--no-demo", action="store_true", help="do not print the fill-mask example at the end")


def train_args(p):
    config_args(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, batch arithmetic, the schedule's phases and values (under schedule:), "
        "parameter counts, a per-device memory estimate and the DeepSpeed config derived, then exit without training",
    )
    p.add_argument(
        "--world-size",
        type=positive_int,
        help="with --dry-run: data-parallel ranks to plan for (default: $WORLD_SIZE or 1)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=positive_int,
        help="with --dry-run: ranks per node, at most (default: all on one node); a world size above it must be a "
        "multiple of it",
    )


def tokenizer_args(p):
    p.add_argument("corpus", nargs="+", help=f"corpus files, directories or globs ({CORPUS_FORMATS})")
    p.add_argument("--out", required=True, help="output directory")
    add_field_option(
        p,
        "--type",
        DataConfig,
        "tokenizer_type",
        help="tokenizer model: WordPiece (BERT), byte-level BPE (RoBERTa) or Unigram",
    )
    add_field_option(p, "--vocab-size", DataConfig, "vocab_size", type=positive_int)
    add_field_option(p, "--min-frequency", DataConfig, "min_frequency", type=non_negative_int)
    add_field_option(p, "--cased", DataConfig, "lowercase", help="keep case")
    add_field_option(p, "--keep-accents", DataConfig, "strip_accents", help="keep accents")
    add_field_option(p, "--text-field", DataConfig, "text_field")
    add_field_option(p, "--text-documents", DataConfig, "text_documents")
    add_field_option(
        p,
        "--sample-docs",
        DataConfig,
        "tokenizer_sample_docs",
        type=non_negative_int,
        help="train on about N documents, an equal share from the start of each input file (0 = all)",
    )
    bad_input_args(p)


def shards_args(p):
    p.add_argument("corpus", nargs="+", help=f"corpus files, directories or globs ({CORPUS_FORMATS})")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (from `pretrain tokenizer`)")
    p.add_argument("--out", required=True, help="output shard directory")
    add_field_option(p, "--workers", DataConfig, "num_workers")
    add_field_option(p, "--docs-per-shard", DataConfig, "docs_per_shard")
    add_field_option(p, "--text-field", DataConfig, "text_field")
    add_field_option(p, "--text-documents", DataConfig, "text_documents")
    bad_input_args(p)


def data_inspect_args(p):
    config_args(p, CONFIG_HELP + "; or a shard directory")
    p.add_argument(
        "--tokenizer", help="tokenizer directory (default: the config's; for a shard directory, tokenizer/ beside it)"
    )
    p.add_argument(
        "--out",
        help="histogram path, .png, .pdf, .svg or another format matplotlib writes (default: "
        "inspect/doc_lengths.png beside the shard directory); an existing file is replaced only if this command "
        "wrote it",
    )
    add_field_option(p, "--samples", INSPECT, "num_samples", type=non_negative_int, help="decoded samples to show")


def export_args(p):
    p.add_argument("run_or_checkpoint", help="a run directory (its latest checkpoint) or a checkpoint directory")
    p.add_argument(
        "--out",
        help="output directory (default: hf/ in the run directory given, or the one holding the checkpoint "
        "given; needed for a checkpoint outside a run). A symlink is written through. Re-exporting replaces only "
        "the files an export writes: anything else you keep there stays",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the parity check with transformers (by default it runs on the new export before it replaces "
        "the previous one)",
    )
    p.add_argument("--demo", action="store_true", help="print a fill-mask example from the exported model")
    p.add_argument(
        "--arch",
        choices=ArchChoices(),
        metavar="ARCH",  # argparse would list the choices now, importing the registry (and torch) for every command
        help="HF architecture to write (default: the one the model options match: bert, or albert with "
        "embedding_size/share_layers, modernbert with pre-LN+rope+geglu+no bias, electra for rtd; "
        "roberta only on request). Options with no HF equivalent are an error",
    )
    p.add_argument(
        "--push-to-hub",
        metavar="REPO",
        help="upload the export (with --format sentence-transformers, that directory) to this Hub model repo "
        "(created if missing, public unless --private); needs HF_TOKEN or a stored `hf auth login` token, checked "
        "before anything is exported. Files of an earlier export there that this one does not write are deleted",
    )
    p.add_argument(
        "--private",
        action="store_true",
        help="with --push-to-hub: create the repo private (a repo that exists keeps its visibility)",
    )
    p.add_argument(
        "--revision",
        metavar="BRANCH",
        help="with --push-to-hub: upload to this branch (created from main if missing) rather than main",
    )
    p.add_argument(
        "--raw-weights",
        action="store_true",
        help="a run that kept a weight EMA (train.ema_decay) exports the EMA; this exports the training weights",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        help="sentence-transformers: also write the encoder with a pooling layer for SentenceTransformer(dir) "
        f"(default: transformers; sentence-transformers when {', '.join(ST_OPTIONS)} is given)",
    )
    add_field_option(
        p,
        "--pooling",
        ST_EXPORT,
        "pooling",
        choices=["mean", "cls"],
        action=StoreGiven,
        help="sentence-transformers pooling; implies --format sentence-transformers",
    )
    p.add_argument(
        "--normalize",
        action="store_true",
        help="sentence-transformers: unit-length embeddings; implies --format sentence-transformers",
    )
    p.add_argument(
        "--st-out",
        help="sentence-transformers directory (default: beside the export: RUN/sentence-transformers for an export "
        "in a directory named hf, as a run's hf/ is; <export>-sentence-transformers for any other); implies "
        "--format sentence-transformers",
    )


FORMATS = ("transformers", "sentence-transformers")
ST_OPTIONS = ("--pooling", "--normalize", "--st-out")  # export's options that only a sentence-transformers one reads


def export_format(args: argparse.Namespace) -> str:
    """--format, or sentence-transformers where an option only it reads was given (which would do nothing else);
    --format transformers beside such an option is refused naming it."""
    typed = set(getattr(args, "given_options", []))
    given = [
        o
        for o in ST_OPTIONS
        if o in typed or (o == "--normalize" and args.normalize) or (o == "--st-out" and args.st_out)
    ]
    if args.format == "transformers" and given:
        raise UserError(
            f"{', '.join(given)}: sentence-transformers option(s), not read with --format transformers; drop them or "
            "give --format sentence-transformers"
        )
    return args.format or ("sentence-transformers" if given else "transformers")


def average_args(p):
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories (or run directories: their latest)")
    p.add_argument("--out", required=True, help="output directory of the averaged export")
    p.add_argument("--arch", choices=ArchChoices(), metavar="ARCH", help="as for export")
    p.add_argument("--no-verify", action="store_true", help="skip the parity check with transformers")


def eval_args(p):
    p.add_argument("target", help="run directory, checkpoint directory, or exported HF directory")
    data = p.add_mutually_exclusive_group()  # one source of held-out data: the other would be ignored
    data.add_argument("--shards", help="held-out shard directory built with the model's tokenizer")
    data.add_argument(
        "--corpus",
        nargs="+",
        help="held-out corpus file(s): shards are built with the model's tokenizer (cached beside the target)",
    )
    add_field_option(
        p,
        "--max-samples",
        EVALUATE,
        "max_samples",
        type=non_negative_int,
        help="evaluate at most N sequences (0 = all)",
    )
    add_field_option(
        p,
        "--max-seq-len",
        EVALUATE,
        "max_seq_len",
        type=non_negative_int,
        help="tokens per sequence (0 = the length a run or checkpoint last trained at; for a HuggingFace directory "
        "its positions, at most 128)",
    )
    add_field_option(p, "--batch-size", EVALUATE, "batch_size", type=positive_int, help="sequences per batch")
    add_field_option(
        p,
        "--raw-weights",
        EVALUATE,
        "raw_weights",
        action="store_true",
        help="a run that kept a weight EMA (train.ema_decay) is scored by the EMA; this scores the training weights",
    )
    run_reads = "default: as a run or checkpoint target read its own corpus, its data.{}; for an HF directory, {}"
    p.add_argument(
        "--text-field",
        metavar="FIELD",
        help="--corpus: the JSON field holding each document's text ("
        + run_reads.format("text_field", field_default(DataConfig, "text_field"))
        + ")",
    )
    p.add_argument(
        "--text-documents",
        choices=CHOICES["data.text_documents"],
        help="--corpus: what a document is in a plain-text file: paragraphs (separated by blank lines) or lines ("
        + run_reads.format("text_documents", field_default(DataConfig, "text_documents"))
        + ")",
    )
    p.add_argument("--json", help="also write the result to this JSON file (missing directories are created)")


def finetune_args(p):
    p.add_argument("model_dir", help="exported HuggingFace directory (BERT, ELECTRA, any *ForSequenceClassification)")
    p.add_argument(
        "task_dir",
        help="directory with train.tsv and dev.tsv, or with train.txt and dev.txt in CoNLL columns (token-level: "
        "BIO tags, scored by chunk F1)",
    )
    seeds = p.add_mutually_exclusive_group()  # one way to give the seeds: --seed-list replaced --seeds
    seeds.add_argument("--seeds", type=positive_int, default=3, help="number of seeds, 1..N (default: 3)")
    seeds.add_argument("--seed-list", type=int, nargs="+", help="explicit seeds (instead of --seeds)")
    add_field_option(p, "--mode", FINETUNE, "mode")  # help, type and choices: FinetuneConfig's field
    # 0 means the mode's default, as in FinetuneConfig (and an ablation's eval:)
    p.add_argument("--epochs", type=non_negative_int, help="epochs (default, or 0: 3 full, 20 probe)")
    rate = p.add_mutually_exclusive_group()  # one learning rate or a sweep: the sweep's choice replaced --lr
    rate.add_argument("--lr", type=positive_float, help="peak learning rate (default: 5e-5 full, 1e-2 probe)")
    p.add_argument("--batch-size", type=non_negative_int, help="batch size (default, or 0: 32 full, 64 probe)")
    add_field_option(p, "--max-seq-len", FINETUNE, "max_seq_len", type=non_negative_int)
    add_field_option(p, "--task-type", FINETUNE, "task_type")
    add_field_option(p, "--pooling", FINETUNE, "pooling")
    add_field_option(p, "--max-train", FINETUNE, "max_train", type=non_negative_int)
    add_field_option(p, "--random-init", FINETUNE, "random_init")
    rate.add_argument(
        "--lrs",
        type=positive_float,
        nargs="+",
        help="learning rates to sweep: each trained on train minus a held-out part and scored there (never on dev); "
        "the best is trained on all of train and scored on dev",
    )
    add_field_option(p, "--heldout-fraction", FINETUNE, "heldout_fraction", type=float, help="with --lrs")
    add_field_option(p, "--heldout-seed", FINETUNE, "heldout_seed", type=non_negative_int)
    add_field_option(p, "--sweep-seeds", FINETUNE, "sweep_seeds", type=positive_int)
    p.add_argument("--json", help="also write the result to this JSON file (missing directories are created)")


def decay_args(p):
    p.add_argument("source", help="a run directory (its latest checkpoint) or a checkpoint directory")
    p.add_argument("--steps", type=int, required=True, help="length of the decay, in optimizer steps")
    p.add_argument("--name", help="the new run's name (default: <source name>-decay<step>), beside the source run")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.decay_shape=1-sqrt")


def ablate_args(p):
    p.add_argument("config", help="ablation config file (or a preset name in configs/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of the ablation config")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--print-commands",
        action="store_true",
        help="write each arm's config and print launch commands for a cluster instead of running",
    )
    how.add_argument(
        "--within-minutes",
        type=positive_float,
        default=0.0,
        metavar="M",
        help="start no run that would not finish within M minutes (judged by the runs timed so far) and stop there; "
        "the same command again goes on, and writes the report once every run has finished",
    )
    how.add_argument(
        "--data-only",
        action="store_true",
        help="build the tokenizer and shards the runs share, then stop (step 1 of --print-commands where the data "
        "has weighted data.sources)",
    )
    how.add_argument(
        "--copy-record",
        metavar="DIR",
        help="instead of running, copy into the new directory DIR what the report and a resumed ablation need "
        "(the tokenizer, each finished run's config, state, metrics and provenance), without weights, checkpoints "
        "or shards: with output_dir=DIR, on another machine, the same command skips those runs",
    )


def compare_args(p):
    p.add_argument("runs", nargs="+", metavar="RUN", help="two or more run directories, e.g. runs/mlm runs/electra")
    p.add_argument(
        "--out",
        default="compare",
        help="output directory: new, empty, or an earlier comparison (default: compare/ in the current directory)",
    )


def check_st_out(args: argparse.Namespace) -> None:
    """--st-out checked as an output before the transformers export it is converted from: refused after it, the
    export (minutes on a large model) had replaced the run's hf/ in vain."""
    if not args.st_out:
        return
    from pretrain.core.outputs import check_not_input, check_output_place, claim_output
    from pretrain.hf.sentence_transformers import KIND

    out, exported = Path(args.st_out), {"the run or checkpoint exported": Path(args.run_or_checkpoint)}
    check_not_input(out, exported, "--st-out")
    check_output_place(out, exported, "--st-out")
    claim_output(out, KIND, "--st-out")
