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
