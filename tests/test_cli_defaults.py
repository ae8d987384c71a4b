"""A command-line option that mirrors a config field (or a library parameter) takes its default from there: one
default, declared once. Re-declaring a different one beside it fails here."""

import argparse
import subprocess
import sys

import pytest

from pretrain.cli import build_parser, main
from pretrain.cli_options import Mirrored, resolve_mirrored
from pretrain.core.config import RunConfig
from pretrain.core.parsing import field_default, field_type

# (command, option) -> (owner, field or parameter): the options that must mirror it; a plain add_argument with its
# own default in their place fails `test_listed_options_parse_to_the_mirrored_default`.
MIRRORED = {
    ("tokenizer", "--type"): ("DataConfig", "tokenizer_type"),
    ("tokenizer", "--vocab-size"): ("DataConfig", "vocab_size"),
    ("tokenizer", "--min-frequency"): ("DataConfig", "min_frequency"),
    ("tokenizer", "--cased"): ("DataConfig", "lowercase"),
    ("tokenizer", "--keep-accents"): ("DataConfig", "strip_accents"),
    ("tokenizer", "--text-field"): ("DataConfig", "text_field"),
    ("tokenizer", "--sample-docs"): ("DataConfig", "tokenizer_sample_docs"),
    ("tokenizer", "--on-bad"): ("DataConfig", "on_bad_document"),
    ("tokenizer", "--max-document-bytes"): ("DataConfig", "max_document_bytes"),
    ("shards", "--workers"): ("DataConfig", "num_workers"),
    ("shards", "--docs-per-shard"): ("DataConfig", "docs_per_shard"),
    ("shards", "--text-field"): ("DataConfig", "text_field"),
    ("shards", "--on-bad"): ("DataConfig", "on_bad_document"),
    ("shards", "--max-document-bytes"): ("DataConfig", "max_document_bytes"),
    ("data inspect", "--samples"): ("pretrain.evaluation.inspect:inspect_data", "num_samples"),
    ("eval", "--max-samples"): ("pretrain.evaluation.evaluate:evaluate_mlm", "max_samples"),
    ("eval", "--max-seq-len"): ("pretrain.evaluation.evaluate:evaluate_mlm", "max_seq_len"),
    ("eval", "--batch-size"): ("pretrain.evaluation.evaluate:evaluate_mlm", "batch_size"),
    ("finetune", "--mode"): ("pretrain.evaluation.configs:FinetuneConfig", "mode"),
    ("finetune", "--max-seq-len"): ("pretrain.evaluation.configs:FinetuneConfig", "max_seq_len"),
    ("finetune", "--task-type"): ("pretrain.evaluation.configs:FinetuneConfig", "task_type"),
    ("finetune", "--pooling"): ("pretrain.evaluation.configs:FinetuneConfig", "pooling"),
    ("finetune", "--max-train"): ("pretrain.evaluation.configs:FinetuneConfig", "max_train"),
    ("finetune", "--random-init"): ("pretrain.evaluation.configs:FinetuneConfig", "random_init"),
    ("finetune", "--heldout-fraction"): ("pretrain.evaluation.configs:FinetuneConfig", "heldout_fraction"),
    ("finetune", "--heldout-seed"): ("pretrain.evaluation.configs:FinetuneConfig", "heldout_seed"),
    ("finetune", "--sweep-seeds"): ("pretrain.evaluation.configs:FinetuneConfig", "sweep_seeds"),
    ("export", "--pooling"): ("pretrain.hf.sentence_transformers:export_sentence_transformers", "pooling"),
}

# The fewest positional arguments each command parses with.
MINIMAL = {
    "tokenizer": ["c.jsonl", "--out", "o"],
    "shards": ["c.jsonl", "--tokenizer", "t", "--out", "o"],
    "data inspect": ["tiny"],
    "eval": ["target"],
    "finetune": ["model", "task"],
    "export": ["run"],
}


def subparsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(command words, parser) of every subcommand, nested ones (`data inspect`) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from subparsers(sub, (*prefix, name))


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings}


def owner_of(spec: str):
    from pretrain.core import config

    return getattr(config, spec) if ":" not in spec else Mirrored(spec, "").target()


def test_every_mirrored_option_defaults_to_its_source():
    checked = 0
    for words, sub in subparsers(build_parser()):
        for flag, action in options(sub).items():
            source = getattr(action, "mirrors", None)
            if source is None:
                continue
            default = action.default.value() if isinstance(action.default, Mirrored) else action.default
            assert default == source.value(), (" ".join(words), flag, default, source.value())
            checked += 1
    assert checked >= len(MIRRORED)


@pytest.mark.parametrize(("command", "flag"), sorted(MIRRORED))
def test_listed_options_parse_to_the_mirrored_default(command, flag):
    owner_spec, name = MIRRORED[(command, flag)]
    owner = owner_of(owner_spec)
    expected = Mirrored(owner, name).value()
    parser = build_parser()
    action = dict(subparsers(parser))[tuple(command.split())]._option_string_actions[flag]
    assert getattr(action, "mirrors", None) is not None, f"{command} {flag} declares its own default"
    assert Mirrored(action.mirrors.target(), action.mirrors.name).value() == expected
    args = resolve_mirrored(parser.parse_args([*command.split(), *MINIMAL[command]]))
    assert getattr(args, action.dest) == expected, (command, flag)


def test_options_named_like_a_config_field_mirror_it():
    """An option whose value lands in args.<a RunConfig field's name> with a default of its own would be a second
    declaration of that default (the paths given without a default, e.g. --tokenizer, are not)."""
    fields = {
        f"{section}.{name}"
        for section in ("data", "model", "train")
        for name in field_type(RunConfig, section).__dataclass_fields__
    }
    names = {key.partition(".")[2] for key in fields}
    unmirrored = [
        f"{' '.join(words)} {flag}"
        for words, sub in subparsers(build_parser())
        for flag, action in options(sub).items()
        if action.dest in names and action.default is not None and not hasattr(action, "mirrors")
    ]
    assert unmirrored == []


def test_finetune_mode_has_one_default():
    from pretrain.evaluation import finetune as library
    from pretrain.evaluation.configs import FinetuneConfig

    args = resolve_mirrored(build_parser().parse_args(["finetune", "model", "task"]))
    assert args.mode == Mirrored(library.finetune, "mode").value() == FinetuneConfig().mode == "full"


def test_shards_workers_is_data_num_workers():
    from pretrain.core.config import DataConfig

    args = resolve_mirrored(build_parser().parse_args(["shards", "c", "--tokenizer", "t", "--out", "o"]))
    assert args.workers == field_default(DataConfig, "num_workers") == RunConfig().data.num_workers


def test_help_shows_the_default_and_key(capsys):
    with pytest.raises(SystemExit):
        main(["shards", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 2; config key data.num_workers)" in out


def test_building_the_parser_imports_no_torch():
    """The library defaults of finetune/eval are read when needed: `pretrain presets` stays fast."""
    code = "import sys, pretrain.cli as c; c.build_parser(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    ("flag", "choices"),
    [
        ("--mode", "{full,probe}"),
        ("--task-type", "{auto,classification,regression,token}"),
        ("--pooling", "{mean,cls}"),
    ],
)
def test_finetune_options_list_the_config_fields_choices(capsys, flag, choices):
    """FinetuneConfig's Literal fields give the choices: listed in --help, anything else refused by argparse."""
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    assert f"{flag} {choices}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["finetune", "model", "task", flag, "nonsense"])
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err


def test_export_st_out_help_says_where_the_default_is(capsys):
    """As cli._sentence_transformers places it: a run's hf/ gets RUN/sentence-transformers, other exports a sibling."""
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "RUN/sentence-transformers for an export in a directory named hf" in out
    assert "<export>-sentence-transformers for any other" in out
