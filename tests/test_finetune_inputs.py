"""What `pretrain finetune` reads and refuses before it trains: a task's TSV files (encoding, quoting, columns), the
task type a directory allows, the seeds, the model's positions and an existing classification head."""

import pytest

from pretrain.core.errors import UserError
from pretrain.evaluation.finetune import load_task, read_tsv


def write_task(directory, train: str | bytes, dev: str | bytes | None = None):
    """train.tsv and dev.tsv (dev: train's text unless given); str written as UTF-8, bytes as they are."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, text in (("train", train), ("dev", train if dev is None else dev)):
        path = directory / f"{split}.tsv"
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text, encoding="utf-8")
    return directory


def test_a_file_not_in_utf8_names_file_and_line(tmp_path):
    task = write_task(tmp_path / "t", "sentence\tlabel\na b\t0\ncaf\xe9 c\t1\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"train\.tsv:3: byte 0xe9 is not UTF-8"):
        load_task(task)


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    task = write_task(tmp_path / "t", "\ufeffsentence\tlabel\na b\t0\nc d\t1\n")
    assert read_tsv(task / "train.tsv") == (["a b", "c d"], None, ["0", "1"])
    assert load_task(task).kind == "classification"
