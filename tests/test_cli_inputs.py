"""Options that cannot work together, or values that mean nothing, are refused by name before any work starts."""

from __future__ import annotations

import pytest
import torch

from pretrain.cli import main
from pretrain.core.errors import UserError


def _refused(argv: list[str], capsys) -> str:
    """argparse's refusal of `argv`: exit status 2, and its stderr."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_eval_takes_shards_or_corpus_not_both(tmp_path, capsys):
    err = _refused(["eval", str(tmp_path), "--corpus", "valid.jsonl", "--shards", str(tmp_path)], capsys)
    assert "argument --shards: not allowed with argument --corpus" in err
    from pretrain.evaluation.evaluate import evaluate_mlm

    # the library says it too, before it loads the model (the target here does not even exist)
    with pytest.raises(UserError, match="not both"):
        evaluate_mlm(tmp_path / "missing", shards=str(tmp_path), corpus=["valid.jsonl"])


def test_finetune_takes_one_learning_rate_or_a_sweep_not_both(capsys):
    """--lr beside --lrs was dropped without a word: the sweep's choice replaced it."""
    err = _refused(["finetune", "M", "T", "--lr", "0.5", "--lrs", "0.01", "0.02"], capsys)
    assert "argument --lrs: not allowed with argument --lr" in err


@pytest.mark.parametrize(
    "options,expected",
    [
        ([], "transformers"),
        (["--normalize"], "sentence-transformers"),
        (["--pooling", "mean"], "sentence-transformers"),  # the default value, but asked for
        (["--st-out", "st"], "sentence-transformers"),
        (["--format", "sentence-transformers"], "sentence-transformers"),
    ],
)
def test_export_sentence_transformers_options_imply_the_format(options, expected):
    from pretrain.cli import build_parser
    from pretrain.cli_options import export_format

    args, _ = build_parser().parse_known_args(["export", "runs/r", *options])
    assert export_format(args) == expected


def test_export_refuses_sentence_transformers_options_with_format_transformers(tmp_path, capsys):
    argv = ["export", str(tmp_path / "missing"), "--format", "transformers", "--pooling", "cls", "--normalize"]
    assert main(argv) == 2  # refused before the run is even looked for
    assert "--pooling, --normalize: sentence-transformers option(s), not read with --format transformers" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "argv,option,message",
    [
        (["eval", "RUN", "--shards", "S", "--batch-size", "0"], "--batch-size", "above 0"),
        (["eval", "RUN", "--shards", "S", "--max-samples", "-5"], "--max-samples", "0 or more"),
        (["eval", "RUN", "--shards", "S", "--max-seq-len", "-1"], "--max-seq-len", "0 or more"),
        (["data", "inspect", "SHARDS", "--samples", "-2"], "--samples", "0 or more"),
        (["finetune", "M", "T", "--epochs", "-1"], "--epochs", "0 or more"),
        (["finetune", "M", "T", "--batch-size", "-8"], "--batch-size", "0 or more"),
        (["finetune", "M", "T", "--seeds", "0"], "--seeds", "above 0"),
        (["finetune", "M", "T", "--lr", "-0.001"], "--lr", "above 0"),
        (["finetune", "M", "T", "--lr", "inf"], "--lr", "finite number above 0"),  # passed `> 0`
        (["finetune", "M", "T", "--lrs", "1e-4", "inf"], "--lrs", "finite number above 0"),
        (["finetune", "M", "T", "--max-train", "-3"], "--max-train", "0 or more"),
    ],
)
def test_numbers_without_meaning_are_refused_by_option(argv, option, message, capsys):
    assert f"argument {option}: must be a " in (err := _refused(argv, capsys)) and message in err


def test_finetune_help_says_what_zero_epochs_and_batch_size_mean(capsys):
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "epochs (default, or 0: 3 full, 20 probe)" in out and "batch size (default, or 0: 32 full, 64 probe)" in out


def test_evaluate_mlm_refuses_a_batch_size_of_zero_before_loading(tmp_path):
    from pretrain.evaluation.evaluate import evaluate_mlm

    with pytest.raises(UserError, match="batch_size must be >= 1"):
        evaluate_mlm(tmp_path / "missing", shards=str(tmp_path), batch_size=0)


class _Embeddings(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(8, 4)


class _DiscriminatorOnly(torch.nn.Module):
    """What an ELECTRA (rtd) checkpoint loads as for `pretrain eval`: no head tied to the word embeddings."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Module()
        self.encoder.embeddings = _Embeddings()
        self.heads = torch.nn.ModuleDict({"rtd": torch.nn.Linear(4, 1)})


@pytest.mark.parametrize("exported", [True, False])
def test_eval_of_an_electra_run_points_to_its_export(tmp_path, monkeypatch, exported):
    """It said 'BertForMaskedLM export needs a token-prediction objective', though RUN/hf (its generator) scores."""
    import types

    import pretrain.train.setup as setup
    from pretrain.evaluation.evaluate import load_target

    run = tmp_path / "tiny-rtd"
    (run / "checkpoints").mkdir(parents=True)
    if exported:
        (run / "hf").mkdir()
        (run / "hf" / "config.json").write_text("{}")
    cfg = types.SimpleNamespace(objectives={"rtd": {}}, name="tiny-rtd")
    loaded = (cfg, _DiscriminatorOnly(), None, run / "tokenizer", {"step": 3})
    monkeypatch.setattr(setup, "load_checkpoint_model", lambda target, ema=True: loaded)
    with pytest.raises(UserError) as err:
        load_target(run)
    message = str(err.value)
    assert "an ELECTRA (rtd) checkpoint's discriminator predicts no tokens" in message
    assert "BertForMaskedLM" not in message
    assert (
        f"`pretrain eval {run.resolve() / 'hf'}` scores its generator" if exported else "`pretrain export"
    ) in message


@pytest.mark.parametrize(
    "argv,says",
    [
        (["config", "ablation"], "ablation is an ablation config (top-level arms, run, budget): `pretrain ablate"),
        (["train", "ablation-tiny", "--dry-run"], "`pretrain ablate ablation-tiny` reads it; `pretrain train` takes"),
        (["ablate", "tiny"], "tiny is a run config (top-level data, model, train): `pretrain run tiny` (or train)"),
    ],
)
def test_a_config_of_the_other_kind_is_named_with_the_command_that_reads_it(argv, says, capsys):
    """They said "unknown config key 'run' (did you mean 'train'?)" and "unknown config key 'name' (... 'arms'?)"."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "unknown config key" not in err


@pytest.mark.parametrize("st_out", ["a-file", "foreign", "run", "run/checkpoints/st"])
def test_export_st_out_is_refused_before_the_export(tmp_path, capsys, st_out):
    """--st-out a file, a folder of the user's, or the run itself was refused only after the whole transformers
    export and its parity check (minutes on a large model), which had replaced the run's hf/ meanwhile. Refused
    first: the run here does not even exist, and nothing is written."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.md").write_text("mine")
    run = tmp_path / "run"
    if st_out.startswith("run/"):  # inside the run's checkpoints, which rotation deletes
        from pretrain.core.outputs import mark_output

        mark_output(run, "run")
        (run / "checkpoints").mkdir()
    target = run if st_out == "run" else tmp_path / st_out
    assert main(["export", str(run), "--st-out", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --st-out {target}") and "export:" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "foreign", *(["run"] if "/" in st_out else [])]
    assert "/" not in st_out or not (tmp_path / st_out).exists()
