"""`pretrain`: the command line. Every subcommand explains its options with --help.

Errors in the user's input (paths, config keys and values, corrupt files) print one line naming the
culprit and exit with status 2; nothing already built is lost.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pretrain.cli_options import (
    Parser,
    ablate_args,
    average_args,
    check_st_out,
    compare_args,
    config_args,
    config_epilog,
    data_inspect_args,
    decay_args,
    eval_args,
    export_args,
    export_format,
    finetune_args,
    run_args,
    shards_args,
    tokenizer_args,
    train_args,
)
from pretrain.core.config import RunConfig
from pretrain.core.errors import UserError, no_access, no_room

# Top-level keys only one kind of config has: the other kind's key check would name one as unknown ("unknown config
# key 'run' (did you mean 'train'?)"), so the kind is said first, with the command that reads it
ABLATION_KEYS = ("arms", "run", "budget")
RUN_KEYS = ("data", "model", "objectives", "train", "schedule")


def config_kind(config: str | None) -> tuple[str, list[str]] | None:
    """('ablation' or 'run', the keys that say so) for the config file or preset `config`, None where it is neither
    or cannot be read (loading it then says what is wrong)."""
    import yaml

    from pretrain.core.errors import ConfigError
    from pretrain.core.parsing import resolve_preset

    if not config:
        return None
    try:
        data = yaml.safe_load(resolve_preset(config).read_text(encoding="utf-8"))
    except (ConfigError, OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(data, dict):
        return None
    ablation, run = [k for k in ABLATION_KEYS if k in data], [k for k in RUN_KEYS if k in data]
    if ablation and not run:
        return "ablation", ablation
    if run and not ablation:
        return "run", run
    return None


def refuse_ablation_config(config: str | None, command: str) -> None:
    kind = config_kind(config)
    if kind and kind[0] == "ablation":
        raise UserError(
            f"{config} is an ablation config (top-level {', '.join(kind[1])}): `pretrain ablate {config}` reads it; "
            f"`pretrain {command}` takes a run config (e.g. tiny, default, or a file with data, model, train)"
        )


def _load(args) -> RunConfig:
    from pretrain.train.setup import load_config

    refuse_ablation_config(args.config, args.command)
    return load_config(args.config, args.overrides)


def not_a_trained_runs(out: Path) -> None:
    """--out of `pretrain tokenizer` or `pretrain shards` naming a run's own tokenizer/ or shards/, which its
    checkpoints trained on: replaced, the run could not resume, and its refusal blamed the corpus."""
    from pretrain.core.outputs import marked_kind

    run = out.resolve().parent
    if out.name in ("tokenizer", "shards") and marked_kind(run) == "run" and any((run / "checkpoints").glob("step_*")):
        raise UserError(
            f"--out {out} is the {out.name} of the run {run}, whose checkpoints trained on it: replaced, the run could "
            "not resume; choose another directory"
        )


def cmd_tokenizer(args) -> int:
    from data_pipeline.readers import expand_inputs
    from data_pipeline.tokenizer import train_tokenizer

    out = Path(args.out)
    not_a_trained_runs(out)
    tok = train_tokenizer(
        expand_inputs(args.corpus),
        out,
        kind=args.type,
        vocab_size=args.vocab_size,
        lowercase=args.lowercase,
        strip_accents=args.strip_accents,
        min_frequency=args.min_frequency,
        text_field=args.text_field,
        text_documents=args.text_documents,
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

    not_a_trained_runs(Path(args.out))
    manifest = build_shards(
        expand_inputs(args.corpus),
        Path(args.tokenizer),
        Path(args.out),
        text_field=args.text_field,
        text_documents=args.text_documents,
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
        refuse_ablation_config(args.config, "data inspect")
        cfg = load_config(
            args.config, args.overrides + ([f"data.tokenizer={args.tokenizer}"] if args.tokenizer else [])
        )
        from pretrain.evaluation.inspect import shards_to_rebuild

        try:
            rebuilt = shards_to_rebuild(cfg)
        except UserError as err:  # the corpus moved or gone: the shards are still there to inspect
            print(f"warning: cannot tell whether the shards are what a run would build now: {err}", file=sys.stderr)
            rebuilt = []
        for stale in rebuilt:  # reported as they are; a run would train on others
            print(
                f"warning: {stale} is not what `pretrain run` would train on now: its corpus files (or the tokenizer "
                "or data settings) changed since it was built, and a run would build it again; the figures below "
                "are of the shards as they are",
                file=sys.stderr,
            )
    print(format_report(inspect_data(cfg, args.out, args.samples)))
    return 0


def cmd_train(args) -> int:
    if not args.dry_run and (args.world_size is not None or args.gpus_per_node is not None):
        from pretrain.core.errors import UserError

        # a launcher sets the ranks (WORLD_SIZE); these only plan a dry run, and would be ignored here
        raise UserError("--world-size and --gpus-per-node plan a --dry-run; to train on several ranks use a launcher")
    if args.dry_run:
        from pretrain.train.dryrun import dry_run

        print(dry_run(_load(args), args.world_size, args.gpus_per_node))
        return 0
    from pretrain.pipeline import stage_train

    return stage_train(_load(args))["exit_code"]


def cmd_decay(args) -> int:
    from pretrain.pipeline import say, stage_export, stage_train
    from pretrain.train.branch import branch_for_decay, ema_note

    cfg, summary = branch_for_decay(Path(args.source), args.steps, args.name, args.overrides)
    say(f"decay: {summary}")
    if note := ema_note(cfg, args.steps):
        say(f"note: {note}")
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
    from pretrain.hf.hub import check_hub_token, push_to_hub
    from pretrain.hf.sentence_transformers import HUB_FILES
    from pretrain.pipeline import fill_mask_demo, say, stage_export

    fmt = export_format(args)  # before exporting: a refused option must not cost an export
    if (args.private or args.revision) and not args.push_to_hub:
        raise UserError("--private and --revision say how --push-to-hub uploads: give --push-to-hub REPO too")
    hub = {"private": args.private, "revision": args.revision}
    # a sentence-transformers directory is what goes up, once converted: the transformers export went up before
    push_converted = args.push_to_hub if fmt == "sentence-transformers" else None
    token = check_hub_token(push_converted) if push_converted else None  # before anything is exported
    if fmt == "sentence-transformers":  # where it goes, before the export it is converted from
        check_st_out(args)
    with export_failures_in_one_line():
        out = stage_export(
            Path(args.run_or_checkpoint),
            Path(args.out) if args.out else None,
            verify=not args.no_verify,
            arch=args.arch,
            push_to_hub=None if push_converted else args.push_to_hub,
            raw_weights=args.raw_weights,
            **hub,
        )
    if fmt == "sentence-transformers":
        converted = _sentence_transformers(out, args)
        if push_converted:
            url = push_to_hub(converted, push_converted, token, HUB_FILES, **hub)
            say(f"export: uploaded {converted} to {url}")
    if args.demo:
        fill_mask_demo(out)
    return 0


def _sentence_transformers(hf_out: Path, args) -> Path:
    """`--format sentence-transformers`: the HF export (for ELECTRA its discriminator) laid out for
    SentenceTransformer, truncating at the run's sequence length: in --st-out, else beside the export (a run's hf/
    gets the run's sentence-transformers/)."""
    from pretrain.hf.sentence_transformers import export_sentence_transformers
    from pretrain.pipeline import say
    from pretrain.train.checkpoint import resolve_checkpoint
    from pretrain.train.setup import checkpoint_config

    encoder_dir = hf_out.parent if hf_out.name == "generator" else hf_out
    # the length the checkpoint's last step trained at: under a schedule its phase's, not config.yaml's (phase 0's)
    max_len = checkpoint_config(resolve_checkpoint(Path(args.run_or_checkpoint)))[0].data.max_seq_len
    name = "sentence-transformers" if encoder_dir.name == "hf" else f"{encoder_dir.name}-sentence-transformers"
    out = Path(args.st_out) if args.st_out else encoder_dir.parent / name
    out = export_sentence_transformers(encoder_dir, out, args.pooling, args.normalize, max_len)
    say(f"export: {out} (sentence-transformers, {args.pooling} pooling{', normalized' if args.normalize else ''})")
    return out


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


def json_output(option: str | None) -> Path | None:
    """--json PATH, checked before the work whose result it keeps: not a directory, and its missing directories
    creatable (`write_json` makes them), so that a finished evaluation is not lost to a bad path."""
    if not option:
        return None
    path = Path(option)
    if path.is_dir():
        raise UserError(f"--json {path} is a directory: give the path of a file to write the result to")
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"--json {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"--json {path}: cannot write in {ancestor} (permission denied)")
    return path


def write_json(path: Path | None, result: dict) -> None:
    """The --json file, whole or not at all: a full disk keeps the results a previous command wrote there."""
    import json

    from pretrain.core.files import write_atomic

    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1)
    if path.exists() and not path.is_file():  # a pipe or a terminal (--json /dev/stdout): written, not replaced
        path.write_text(text)
    else:  # through a link, its target: the link stays, as when the file was written in place
        write_atomic(path.resolve(), text, sync=False)


def cmd_eval(args) -> int:
    import json

    from pretrain.evaluation.evaluate import evaluate_mlm, format_eval

    json_path = json_output(args.json)
    result = evaluate_mlm(
        Path(args.target),
        args.shards,
        args.corpus,
        args.max_samples,
        args.max_seq_len,
        args.batch_size,
        text_field=args.text_field,
        text_documents=args.text_documents,
        raw_weights=args.raw_weights,
    )
    print(format_eval(result))
    write_json(json_path, result)
    print(json.dumps(result))
    return 0


def cmd_finetune(args) -> int:
    from pretrain.evaluation.configs import FinetuneConfig
    from pretrain.evaluation.finetune import finetune, format_finetune

    json_path = json_output(args.json)
    seeds = list(range(1, args.seeds + 1)) if args.seed_list is None else args.seed_list
    defaults = FinetuneConfig()
    sweep_only = [
        f"--{name.replace('_', '-')} {getattr(args, name)}"
        for name in ("heldout_fraction", "heldout_seed", "sweep_seeds")
        if getattr(args, name) != getattr(defaults, name)
    ]
    if sweep_only and args.lrs is None:  # taken with no word, and nothing they set happened
        raise UserError(f"{', '.join(sweep_only)}: only with --lrs (they set up its learning-rate sweep)")
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
        args.heldout_seed,
        args.sweep_seeds,
    )
    print(format_finetune(result))
    write_json(json_path, result)
    return 0


def cmd_ablate(args) -> int:
    import shlex

    from pretrain.evaluation.ablate import data_only, run_ablation
    from pretrain.evaluation.ablation_commands import print_commands
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import copy_record

    kind = config_kind(args.config)
    if kind and kind[0] == "run":
        raise UserError(
            f"{args.config} is a run config (top-level {', '.join(kind[1])}): `pretrain run {args.config}` (or "
            "train) reads it; `pretrain ablate` takes an ablation config, with run, arms and budget (e.g. "
            "ablation-tiny)"
        )
    ablation = load_ablation(args.config, args.overrides)
    if args.print_commands:
        print("\n".join(print_commands(ablation)))
        return 0
    if args.data_only:
        data_only(ablation)
        print(
            f"[ablate] the data of {ablation.out} is built: {ablation.base.tokenizer_dir}, {ablation.base.shards_dir}"
        )
        return 0
    if args.copy_record:
        done = copy_record(ablation, Path(args.copy_record))
        print(
            f"[ablate] copied the record of {len(done)} of {len(ablation.arms)} finished runs and the tokenizer from "
            f"{ablation.out} to {args.copy_record}: with output_dir={args.copy_record}, the same command skips them"
        )
        return 0
    command = " ".join(shlex.quote(a) for a in ["pretrain", "ablate", args.config, *args.overrides])
    run_ablation(ablation, command, args.within_minutes)
    return 0


def cmd_compare(args) -> int:
    from pretrain.evaluation.compare import FILES, compare_runs

    out, table = compare_runs([Path(r) for r in args.runs], Path(args.out))
    print(table)
    print(f"\nwritten to {out}: {', '.join(FILES)}")
    return 0


# ----------------------------------------------------------------------------------------------
# Each command's arguments


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
        run_args,
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
        train_args,
        """\
        Pretrain under DeepSpeed. Resumes from <run_dir>/checkpoints/latest when present. For several processes,
        start it with a launcher in launch/ (deepspeed, torchrun, srun). Exit status 75: stopped by SIGTERM or
        SIGINT after saving a checkpoint; run again to resume.""",
        True,
    ),
    Command(
        "decay",
        cmd_decay,
        "decay a checkpoint into a finished model, in a new run directory",
        decay_args,
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
        average_args,
        """\
        Average the fp32 weights of checkpoints of one model (the last few of a run, say) and export the result like
        a run, with its parity check; checkpoints of different shapes are refused, naming the first difference.""",
    ),
    Command(
        "tokenizer",
        cmd_tokenizer,
        "train a tokenizer on a corpus",
        tokenizer_args,
        "Train a tokenizer and save it as a HuggingFace fast tokenizer directory.",
    ),
    Command(
        "shards",
        cmd_shards,
        "tokenize a corpus into verified memory-mapped shards",
        shards_args,
        """\
        Tokenize in parallel into shards (token ids, document/sentence/word boundaries) with a manifest of counts
        and checksums. Re-running with the same inputs and tokenizer is a cache hit.""",
    ),
    Command(
        "data inspect",
        cmd_data_inspect,
        "counts, length histogram, packing efficiency and masked samples",
        data_inspect_args,
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
        export_args,
        """\
        Write config.json, model.safetensors, tokenizer files and a model card, load the result with transformers
        and check its logits against ours; only then does it replace the previous export's files. Safe while the
        run trains: the checkpoint being read is not rotated away.""",
    ),
    Command(
        "eval",
        cmd_eval,
        "masked-token accuracy and perplexity of a checkpoint or exported model",
        eval_args,
        """\
        Score a run / checkpoint directory, or an exported HuggingFace directory, on held-out shards: BERT masking
        (15%, 80/10/10) drawn from a fixed seed, so every model sees the same masks. Perplexity = exp(mean
        cross-entropy over the masked tokens).""",
    ),
    Command(
        "finetune",
        cmd_finetune,
        "downstream scores on a GLUE-format TSV task or a CoNLL token-level task, over several seeds",
        finetune_args,
        """\
        Fine-tune (--mode full) or linearly probe a frozen encoder (--mode probe) from a HF directory on
        TASK_DIR/train.tsv, score on TASK_DIR/dev.tsv. Columns: sentence, or a pair (sentence1 and sentence2, or
        question and sentence as QNLI); and label (ints/strings: classification; floats: regression); an id column
        (index, idx or id) may be there. Reports accuracy (and MCC for two classes) or Pearson/Spearman, mean +- std
        over seeds. TASK_DIR/train.txt and dev.txt in CoNLL columns (token first, BIO tag last, blank line between
        sentences) make a token classification task, labels on each word's first sub-token: reports conlleval's chunk F1
        (main), precision, recall and token accuracy.""",
    ),
    Command(
        "ablate",
        cmd_ablate,
        "compare objectives at an equal budget: train, evaluate, report",
        ablate_args,
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
        compare_args,
        """\
        Plot every loss and metric the runs logged, one panel per key, against tokens seen (vs_tokens.png) and
        wall time (vs_time.png); each run is a line in the panels of the keys it logged, so runs with different
        objectives keep each loss apart. compare.md (and compare.json) give each run's final values, median
        tokens/s, TFLOP/s and MFU, tokens and steps. Wall time is rebuilt from each log line's tokens and tokens/s
        where the records carry no time.""",
    ),
    Command("config", cmd_config, "print the resolved config", config_args, lists_config_keys=True),
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
            epilog=config_epilog() if command.lists_config_keys else None,
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
    except Exception as err:
        message = no_room(err) or no_access(err)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
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
