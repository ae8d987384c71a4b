"""`pretrain`: the command line. Every subcommand explains its options with --help.

Errors in the user's input (paths, config keys and values, corrupt files) print one line naming the
culprit and exit with status 2; nothing already built is lost.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import importlib
import inspect
import os
import sys
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.core.config import CHOICES, DataConfig, RunConfig
from pretrain.core.errors import UserError
from pretrain.core.parsing import field_default, field_doc, field_type

CONFIG_HELP = "a config file, or the name of a preset in configs/ (e.g. 'default', 'bert-mini'); see `pretrain presets`"
OVERRIDE_HELP = "dotted overrides of config keys, e.g. model.hidden_size=128 train.max_steps=500"


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


def _config_epilog() -> str:
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


def _load(args) -> RunConfig:
    from pretrain.train.setup import load_config

    return load_config(args.config, args.overrides)


def cmd_tokenizer(args) -> int:
    from data_pipeline.readers import expand_inputs
    from data_pipeline.tokenizer import train_tokenizer

    out = Path(args.out)
    tok = train_tokenizer(
        expand_inputs(args.corpus),
        out,
        kind=args.type,
        vocab_size=args.vocab_size,
        lowercase=args.lowercase,
        strip_accents=args.strip_accents,
        min_frequency=args.min_frequency,
        text_field=args.text_field,
        sample_docs=args.sample_docs,
        on_bad=args.on_bad,
        max_document_bytes=args.max_document_bytes,
    )
    where = f"{out} (-> {os.path.realpath(out)})" if out.is_symlink() else str(out)  # a link is written through
    print(f"tokenizer ({args.type}, {len(tok)} tokens) saved to {where}")
    return 0


def cmd_shards(args) -> int:
    from data_pipeline.readers import expand_inputs
    from data_pipeline.shards import build_shards

    manifest = build_shards(
        expand_inputs(args.corpus),
        Path(args.tokenizer),
        Path(args.out),
        text_field=args.text_field,
        num_workers=args.workers,
        docs_per_shard=args.docs_per_shard,
        on_bad=args.on_bad,
        max_document_bytes=args.max_document_bytes,
    )
    c = manifest["counts"]
    print(
        f"{c['documents']} documents, {c['tokens']} tokens in {len(manifest['shards'])} shard(s) at {args.out}; "
        f"skipped: {c.get('skipped') or 'none'}"
    )
    return 0


def cmd_data_inspect(args) -> int:
    from pretrain.core.errors import DataError
    from pretrain.evaluation.inspect import format_report, inspect_data
    from pretrain.train.setup import load_config

    target = Path(args.config)
    if target.is_dir():  # a shards directory: the tokenizer is --tokenizer, or the run's one beside it
        if not (target / "manifest.json").is_file():
            raise DataError(f"{target} has no manifest.json: not a shard directory (build it with `pretrain shards`)")
        tokenizer = Path(args.tokenizer) if args.tokenizer else target.parent / "tokenizer"
        cfg = load_config(None, [f"data.shards={target}", f"data.tokenizer={tokenizer}", *args.overrides])
    else:
        cfg = load_config(
            args.config, args.overrides + ([f"data.tokenizer={args.tokenizer}"] if args.tokenizer else [])
        )
    print(format_report(inspect_data(cfg, args.out, args.samples)))
    return 0


def cmd_train(args) -> int:
    if args.dry_run:
        from pretrain.train.dryrun import dry_run

        print(dry_run(_load(args), args.world_size, args.gpus_per_node))
        return 0
    from pretrain.pipeline import stage_train

    return stage_train(_load(args))["exit_code"]


def cmd_decay(args) -> int:
    from pretrain.pipeline import say, stage_export, stage_train
    from pretrain.train.branch import branch_for_decay

    cfg, summary = branch_for_decay(Path(args.source), args.steps, args.name, args.overrides)
    say(f"decay: {summary}")
    result = stage_train(cfg)
    if result["complete"]:
        stage_export(cfg.run_dir, cfg.hf_dir)
    return result["exit_code"]


@contextlib.contextmanager
def export_failures_in_one_line():
    """A failed parity or tokenizer check (ExportError) is a bug to report, but said in one line like the rest, by
    `pretrain run` as by `pretrain export`."""
    from pretrain.hf.export import ExportError

    try:
        yield
    except ExportError as err:
        raise UserError(f"{err} (the export does not reproduce the model: please report this)") from None


def cmd_run(args) -> int:
    from pretrain.pipeline import run_all

    with export_failures_in_one_line():
        return run_all(_load(args), demo=not args.no_demo)["exit_code"]


def cmd_export(args) -> int:
    from pretrain.pipeline import fill_mask_demo, stage_export

    with export_failures_in_one_line():
        out = stage_export(
            Path(args.run_or_checkpoint),
            Path(args.out) if args.out else None,
            verify=not args.no_verify,
            arch=args.arch,
            push_to_hub=args.push_to_hub,
            raw_weights=args.raw_weights,
        )
    if args.format == "sentence-transformers":
        _sentence_transformers(out, args)
    if args.demo:
        fill_mask_demo(out)
    return 0


def _sentence_transformers(hf_out: Path, args) -> None:
    """`--format sentence-transformers`: the HF export (for ELECTRA its discriminator) laid out for
    SentenceTransformer, truncating at the run's sequence length: in --st-out, else beside the export (a run's hf/
    gets the run's sentence-transformers/)."""
    from pretrain.core.config import load_yaml
    from pretrain.hf.sentence_transformers import export_sentence_transformers
    from pretrain.pipeline import say
    from pretrain.train.checkpoint import resolve_checkpoint

    encoder_dir = hf_out.parent if hf_out.name == "generator" else hf_out
    trained = load_yaml(resolve_checkpoint(Path(args.run_or_checkpoint)) / "config.yaml")
    max_len = (trained.get("data") or {}).get("max_seq_len")
    name = "sentence-transformers" if encoder_dir.name == "hf" else f"{encoder_dir.name}-sentence-transformers"
    out = Path(args.st_out) if args.st_out else encoder_dir.parent / name
    export_sentence_transformers(encoder_dir, out, args.pooling, args.normalize, max_len)
    say(f"export: {out} (sentence-transformers, {args.pooling} pooling{', normalized' if args.normalize else ''})")


def cmd_average(args) -> int:
    from pretrain.pipeline import say, stage_average

    out = stage_average([Path(c) for c in args.checkpoints], Path(args.out), args.arch, not args.no_verify)
    say(f"average: {len(args.checkpoints)} checkpoints exported to {out}")
    return 0


def cmd_config(args) -> int:
    import yaml

    from pretrain.core.parsing import to_dict

    print(yaml.safe_dump(to_dict(_load(args)), sort_keys=False), end="")
    return 0


def cmd_presets(args) -> int:
    from pretrain.core.parsing import CONFIG_DIR

    paths = sorted(CONFIG_DIR.glob("*.yaml"))
    width = max(len(p.stem) for p in paths)
    for path in paths:
        first = path.read_text().splitlines()[0] if path.read_text() else ""
        print(f"{path.stem:<{width}}  {first.lstrip('# ')}")
    return 0


def cmd_objectives(args) -> int:
    from objectives import REGISTRY

    for _, cls in sorted(REGISTRY.items()):
        print("\n".join(cls.describe()))  # each option with its default, the values it admits and its doc
    return 0


def cmd_eval(args) -> int:
    import json

    from pretrain.evaluation.evaluate import evaluate_mlm, format_eval

    result = evaluate_mlm(
        Path(args.target), args.shards, args.corpus, args.max_samples, args.max_seq_len, args.batch_size
    )
    print(format_eval(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


def cmd_finetune(args) -> int:
    import json

    from pretrain.evaluation.finetune import finetune, format_finetune

    seeds = list(range(1, args.seeds + 1)) if args.seed_list is None else args.seed_list
    result = finetune(
        Path(args.model_dir),
        Path(args.task_dir),
        seeds,
        args.mode,
        args.epochs,
        args.lr,
        args.batch_size,
        args.max_seq_len,
        args.task_type,
        args.pooling,
        args.max_train,
        args.random_init,
        args.lrs,
        args.heldout_fraction,
    )
    print(format_finetune(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def cmd_ablate(args) -> int:
    import shlex

    from pretrain.evaluation.ablate import load_ablation, print_commands, run_ablation

    ablation = load_ablation(args.config, args.overrides)
    if args.print_commands:
        print("\n".join(print_commands(ablation)))
        return 0
    command = " ".join(shlex.quote(a) for a in ["pretrain", "ablate", args.config, *args.overrides])
    run_ablation(ablation, command)
    return 0


def cmd_compare(args) -> int:
    from pretrain.evaluation.compare import FILES, compare_runs

    out, table = compare_runs([Path(r) for r in args.runs], Path(args.out))
    print(table)
    print(f"\nwritten to {out}: {', '.join(FILES)}")
    return 0


# ----------------------------------------------------------------------------------------------
# Each command's arguments


# The library functions whose parameters the evaluation commands mirror (imported lazily: they import torch)
INSPECT = "pretrain.evaluation.inspect:inspect_data"
EVALUATE = "pretrain.evaluation.evaluate:evaluate_mlm"
FINETUNE = "pretrain.evaluation.configs:FinetuneConfig"
ST_EXPORT = "pretrain.hf.sentence_transformers:export_sentence_transformers"


def _config_args(p: argparse.ArgumentParser, what: str = CONFIG_HELP) -> None:
    p.add_argument("config", help=what)
    p.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDE_HELP)


def _bad_input_args(p: argparse.ArgumentParser) -> None:
    add_field_option(
        p,
        "--on-bad",
        DataConfig,
        "on_bad_document",
        help="bad documents (invalid UTF-8, bad JSON, missing field, too long): skip and count, or stop "
        "naming file and line",
    )
    add_field_option(p, "--max-document-bytes", DataConfig, "max_document_bytes")


def _run_args(p):
    _config_args(p)
    p.add_argument("--no-demo", action="store_true", help="do not print the fill-mask example at the end")


def _train_args(p):
    _config_args(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, batch arithmetic, parameter "
        "counts and a per-device memory estimate, then exit without training",
    )
    p.add_argument(
        "--world-size", type=int, help="with --dry-run: data-parallel ranks to plan for (default: $WORLD_SIZE or 1)"
    )
    p.add_argument("--gpus-per-node", type=int, help="with --dry-run: ranks per node (default: all on one node)")


def _tokenizer_args(p):
    p.add_argument("corpus", nargs="+", help="JSON Lines or text files, directories or globs")
    p.add_argument("--out", required=True, help="output directory")
    add_field_option(
        p,
        "--type",
        DataConfig,
        "tokenizer_type",
        help="tokenizer model: WordPiece (BERT), byte-level BPE (RoBERTa) or Unigram",
    )
    add_field_option(p, "--vocab-size", DataConfig, "vocab_size")
    add_field_option(p, "--min-frequency", DataConfig, "min_frequency")
    add_field_option(p, "--cased", DataConfig, "lowercase", help="keep case")
    add_field_option(p, "--keep-accents", DataConfig, "strip_accents", help="keep accents")
    add_field_option(p, "--text-field", DataConfig, "text_field")
    add_field_option(
        p,
        "--sample-docs",
        DataConfig,
        "tokenizer_sample_docs",
        help="train on about N documents, an equal share from the start of each input file (0 = all)",
    )
    _bad_input_args(p)


def _shards_args(p):
    p.add_argument("corpus", nargs="+", help="JSON Lines or text files, directories or globs")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (from `pretrain tokenizer`)")
    p.add_argument("--out", required=True, help="output shard directory")
    add_field_option(p, "--workers", DataConfig, "num_workers")
    add_field_option(p, "--docs-per-shard", DataConfig, "docs_per_shard")
    add_field_option(p, "--text-field", DataConfig, "text_field")
    _bad_input_args(p)


def _data_inspect_args(p):
    _config_args(p, CONFIG_HELP + "; or a shard directory")
    p.add_argument(
        "--tokenizer", help="tokenizer directory (default: the config's; for a shard directory, tokenizer/ beside it)"
    )
    p.add_argument("--out", help="histogram PNG path (default: inspect/doc_lengths.png beside the shard directory)")
    add_field_option(p, "--samples", INSPECT, "num_samples", type=int, help="decoded samples to show")


def _export_args(p):
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
        help="upload the export to this Hub model repo (created if missing); needs HF_TOKEN or a stored "
        "`hf auth login` token, checked before anything is exported",
    )
    p.add_argument(
        "--raw-weights",
        action="store_true",
        help="a run that kept a weight EMA (train.ema_decay) exports the EMA; this exports the training weights",
    )
    p.add_argument(
        "--format",
        choices=["transformers", "sentence-transformers"],
        default="transformers",
        help="sentence-transformers: also write the encoder with a pooling layer for SentenceTransformer(dir)",
    )
    add_field_option(
        p, "--pooling", ST_EXPORT, "pooling", choices=["mean", "cls"], help="sentence-transformers pooling"
    )
    p.add_argument("--normalize", action="store_true", help="sentence-transformers: unit-length embeddings")
    p.add_argument(
        "--st-out", help="sentence-transformers directory (default: <export>-sentence-transformers beside the export)"
    )


def _average_args(p):
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories (or run directories: their latest)")
    p.add_argument("--out", required=True, help="output directory of the averaged export")
    p.add_argument("--arch", choices=ArchChoices(), metavar="ARCH", help="as for export")
    p.add_argument("--no-verify", action="store_true", help="skip the parity check with transformers")


def _eval_args(p):
    p.add_argument("target", help="run directory, checkpoint directory, or exported HF directory")
    p.add_argument("--shards", help="held-out shard directory built with the model's tokenizer")
    p.add_argument(
        "--corpus",
        nargs="+",
        help="held-out corpus file(s): shards are built with the model's tokenizer (cached beside the target)",
    )
    add_field_option(
        p, "--max-samples", EVALUATE, "max_samples", type=int, help="evaluate at most N sequences (0 = all)"
    )
    add_field_option(p, "--max-seq-len", EVALUATE, "max_seq_len", type=int, help="tokens per sequence")
    add_field_option(p, "--batch-size", EVALUATE, "batch_size", type=int, help="sequences per batch")
    p.add_argument("--json", help="also write the result to this JSON file")


def _finetune_args(p):
    p.add_argument("model_dir", help="exported HuggingFace directory (BERT, ELECTRA, any *ForSequenceClassification)")
    p.add_argument(
        "task_dir",
        help="directory with train.tsv and dev.tsv, or with train.txt and dev.txt in CoNLL columns (token-level: "
        "BIO tags, scored by chunk F1)",
    )
    p.add_argument("--seeds", type=int, default=3, help="number of seeds, 1..N (default: 3)")
    p.add_argument("--seed-list", type=int, nargs="+", help="explicit seeds (instead of --seeds)")
    add_field_option(
        p,
        "--mode",
        FINETUNE,
        "mode",
        help="full fine-tuning, or a linear probe on frozen features",
    )
    p.add_argument("--epochs", type=int, help="epochs (default: 3 full, 20 probe)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 5e-5 full, 1e-2 probe)")
    p.add_argument("--batch-size", type=int, help="batch size (default: 32 full, 64 probe)")
    add_field_option(p, "--max-seq-len", FINETUNE, "max_seq_len", type=int, help="truncate inputs to this many tokens")
    add_field_option(
        p,
        "--task-type",
        FINETUNE,
        "task_type",
        help="auto: inferred from the labels (CoNLL columns are token-level)",
    )
    add_field_option(p, "--pooling", FINETUNE, "pooling", help="probe features")
    add_field_option(
        p, "--max-train", FINETUNE, "max_train", type=int, help="use a fixed subset of N training examples (0 = all)"
    )
    add_field_option(
        p,
        "--random-init",
        FINETUNE,
        "random_init",
        action="store_true",
        help="same config, random weights (a no-pretraining baseline)",
    )
    p.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        help="learning rates to sweep: each trained on train minus a held-out part and scored there (never on dev); "
        "the best is trained on all of train and scored on dev",
    )
    add_field_option(p, "--heldout-fraction", FINETUNE, "heldout_fraction", type=float, help="with --lrs")
    p.add_argument("--json", help="also write the result to this JSON file")


def _decay_args(p):
    p.add_argument("source", help="a run directory (its latest checkpoint) or a checkpoint directory")
    p.add_argument("--steps", type=int, required=True, help="length of the decay, in optimizer steps")
    p.add_argument("--name", help="the new run's name (default: <source name>-decay<step>), beside the source run")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.decay_shape=1-sqrt")


def _ablate_args(p):
    p.add_argument("config", help="ablation config file (or a preset name in configs/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of the ablation config")
    p.add_argument(
        "--print-commands",
        action="store_true",
        help="write each arm's config and print launch commands for a cluster instead of running",
    )


def _compare_args(p):
    p.add_argument("runs", nargs="+", metavar="RUN", help="two or more run directories, e.g. runs/mlm runs/electra")
    p.add_argument(
        "--out",
        default="compare",
        help="output directory: new, empty, or an earlier comparison (default: compare/ in the current directory)",
    )


# ----------------------------------------------------------------------------------------------
# The table: subcommand -> what runs it


@dataclass(frozen=True)
class Command:
    name: str  # "data inspect": the subcommand `inspect` of `data`
    run: Callable[[argparse.Namespace], int]
    help: str
    args: Callable[[argparse.ArgumentParser], None] | None = None
    description: str = ""
    lists_config_keys: bool = False  # --help ends with every config key


COMMANDS = (
    Command(
        "run",
        cmd_run,
        "all stages from one config, skipping those whose output exists",
        _run_args,
        """\
        Train a tokenizer (unless data.tokenizer exists), build shards (cache hit if unchanged), pretrain under
        DeepSpeed (resuming from the latest checkpoint), export to HuggingFace format in <run_dir>/hf, and print a
        fill-mask example loaded with transformers.""",
        True,
    ),
    Command(
        "train",
        cmd_train,
        "pretrain from a config (tokenizer and shards must exist)",
        _train_args,
        """\
        Pretrain under DeepSpeed. Resumes from <run_dir>/checkpoints/latest when present. For several processes,
        start it with a launcher in launch/ (deepspeed, torchrun, srun). Exit status 75: stopped by SIGTERM after
        saving a checkpoint; run again to resume.""",
        True,
    ),
    Command(
        "decay",
        cmd_decay,
        "decay a checkpoint into a finished model, in a new run directory",
        _decay_args,
        """\
        Warmup-stable-decay: start a new run beside the source from one of its checkpoints (the same data order and
        optimizer state; the source is left as it was) and train it for --steps steps while the learning rate decays
        from train.lr (train.decay_shape, to train.min_lr_ratio), then export it. Running the same command again
        resumes the decay run.""",
    ),
    Command(
        "average",
        cmd_average,
        "export the uniform average of several checkpoints",
        _average_args,
        """\
        Average the fp32 weights of checkpoints of one model (the last few of a run, say) and export the result like
        a run, with its parity check; checkpoints of different shapes are refused, naming the first difference.""",
    ),
    Command(
        "tokenizer",
        cmd_tokenizer,
        "train a tokenizer on a corpus",
        _tokenizer_args,
        "Train a tokenizer and save it as a HuggingFace fast tokenizer directory.",
    ),
    Command(
        "shards",
        cmd_shards,
        "tokenize a corpus into verified memory-mapped shards",
        _shards_args,
        """\
        Tokenize in parallel into shards (token ids, document/sentence/word boundaries) with a manifest of counts
        and checksums. Re-running with the same inputs and tokenizer is a cache hit.""",
    ),
    Command(
        "data inspect",
        cmd_data_inspect,
        "counts, length histogram, packing efficiency and masked samples",
        _data_inspect_args,
        """\
        Report a run's shards: document, sentence and token counts and skips; a histogram of document lengths as a
        PNG; the packing efficiency of each sample builder; and a few samples decoded after the run's objectives
        prepared them, showing what they mask. Needs the tokenizer and shards (from `pretrain run`, or `pretrain
        shards`).""",
        True,
    ),
    Command(
        "export",
        cmd_export,
        "export a checkpoint to a HuggingFace save_pretrained directory",
        _export_args,
        """\
        Write config.json, model.safetensors, tokenizer files and a model card, load the result with transformers
        and check its logits against ours; only then does it replace the previous export's files. Safe while the
        run trains: the checkpoint being read is not rotated away.""",
    ),
    Command(
        "eval",
        cmd_eval,
        "masked-token accuracy and perplexity of a checkpoint or exported model",
        _eval_args,
        """\
        Score a run / checkpoint directory, or an exported HuggingFace directory, on held-out shards: BERT masking
        (15%, 80/10/10) drawn from a fixed seed, so every model sees the same masks. Perplexity = exp(mean
        cross-entropy over the masked tokens).""",
    ),
    Command(
        "finetune",
        cmd_finetune,
        "downstream scores on a GLUE-format TSV task or a CoNLL token-level task, over several seeds",
        _finetune_args,
        """\
        Fine-tune (--mode full) or linearly probe a frozen encoder (--mode probe) from a HF directory on
        TASK_DIR/train.tsv, score on TASK_DIR/dev.tsv. Columns: sentence, or sentence1 and sentence2; and label
        (ints/strings: classification; floats: regression). Reports accuracy (and MCC for two classes) or
        Pearson/Spearman, mean +- std over seeds. TASK_DIR/train.txt and dev.txt in CoNLL columns (token first,
        BIO tag last, blank line between sentences) make a token classification task, labels on each word's first
        sub-token: reports conlleval's chunk F1 (main), precision, recall and token accuracy.""",
    ),
    Command(
        "ablate",
        cmd_ablate,
        "compare objectives at an equal budget: train, evaluate, report",
        _ablate_args,
        """\
        Train every arm of an ablation config (see configs/ablation-tiny.yaml) on the same tokenizer, shards and
        encoder, once per pretraining seed, at a budget matched in FLOPs, tokens or time; export each, score it
        downstream, compare every arm with a random encoder and with each other, and write
        <output_dir>/report.md with plots. Re-running skips finished arms and resumes an interrupted one from its
        checkpoint. Overrides address the ablation file: budget.amount=1e6 run.train.lr=1e-3.""",
    ),
    Command(
        "compare",
        cmd_compare,
        "plot and tabulate the metrics of two or more runs side by side",
        _compare_args,
        """\
        Plot every loss and metric the runs logged, one panel per key, against tokens seen (vs_tokens.png) and
        wall time (vs_time.png); each run is a line in the panels of the keys it logged, so runs with different
        objectives keep each loss apart. compare.md (and compare.json) give each run's final values, median
        tokens/s, TFLOP/s and MFU, tokens and steps. Wall time is rebuilt from each log line's tokens and tokens/s
        where the records carry no time.""",
    ),
    Command("config", cmd_config, "print the resolved config", _config_args, lists_config_keys=True),
    Command("presets", cmd_presets, "list the presets in configs/"),
    Command("objectives", cmd_objectives, "list the objectives and their options"),
)
GROUPS = {"data": "look at the data a run will train on (`pretrain data inspect`)"}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pretrain",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pretrain BERT-family encoders: tokenizer -> shards -> DeepSpeed training -> HuggingFace export.",
        epilog="Run `pretrain COMMAND --help` for the options of each command.",
    )
    # the deepspeed launcher passes --local_rank before the subcommand; LOCAL_RANK in the environment says the same
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    groups = {"": parser.add_subparsers(dest="command", metavar="COMMAND", required=True)}
    for command in COMMANDS:
        group, _, name = command.name.rpartition(" ")
        if group not in groups:  # a command with subcommands of its own, at the place of its first one
            sub = groups[""].add_parser(group, help=GROUPS[group])
            groups[group] = sub.add_subparsers(
                dest=f"{group}_command", metavar=f"{group.upper()}_COMMAND", required=True
            )
        p = groups[group].add_parser(
            name,
            help=command.help,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            description=textwrap.dedent(command.description) or command.help,
            epilog=_config_epilog() if command.lists_config_keys else None,
        )
        if command.args:
            command.args(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_MODE", "offline")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may come after options (`train CFG --dry-run a.b=1`): argparse leaves them over
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        where = f" while writing {err.filename}" if err.filename else ""
        print(
            f"error: no space left on device{where}; free some space and run the same command again (finished "
            "work is kept)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def leave_process_group() -> bool:
    """Destroy the process group(s) of a finished run, as PyTorch asks; True if there were any."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.destroy_process_group()
    return True


def entry() -> None:
    """The `pretrain` command (and `python -m pretrain.cli`, which the launchers run): main, then the exit.

    After a distributed run the process leaves without interpreter finalization. DeepSpeed's module globals keep
    its process groups alive past destroy_process_group, so their gloo threads would be torn down during
    finalization, which can abort a finished run ("terminate called without an active exception", exit status
    250; seen in CI after 2-rank runs). By now every file is written and closed, and wandb is finished."""
    code = int(main() or 0)
    if leave_process_group():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
