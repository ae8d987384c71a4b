"""Options that cannot work together, or values that mean nothing, are refused by name before any work starts."""

from __future__ import annotations

import pytest

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
