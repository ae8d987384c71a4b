"""End to end through the `pretrain` CLI, DeepSpeed on CPU: run, interrupt, resume, export, fill-mask;
and bad input that fails in one line without losing what was built."""

import functools
import json
from pathlib import Path

import pytest
from helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"
pretrain = functools.partial(run_cli, wandb_mode="offline")  # the e2e runs keep their wandb files


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "speeches.jsonl"
    lines = CORPUS.read_text().splitlines()[:30]
    path.write_text("\n".join(lines) + "\n")
    return path


def overrides(tmp, corpus, *extra):
    return [
        f"output_dir={tmp}",
        "name=e2e",
        f"data.corpus=[{corpus}]",
        "train.max_steps=6",
        "train.save_every=3",
        "train.log_every=1",
        "train.warmup_steps=2",
        "data.vocab_size=512",
        "data.num_workers=2",
        *extra,
    ]


@pytest.mark.slow
def test_run_interrupt_resume_export(tmp_path, small_corpus):
    # first invocation stops after 3 steps with a checkpoint, like a job that hit its time limit
    pretrain(
        "run",
        "tiny",
        *overrides(tmp_path, small_corpus, "train.exit_after_steps=3", "wandb.mode=offline"),
        cwd=tmp_path,
    )
    run = tmp_path / "e2e"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert not (run / "hf").exists()
    assert (run / "tokenizer" / "tokenizer.json").is_file() and (run / "shards" / "manifest.json").is_file()
    tok_mtime = (run / "tokenizer" / "tokenizer.json").stat().st_mtime

    # the same command again resumes from step 3, finishes, exports, and fills a mask with transformers
    proc = pretrain("run", "tiny", *overrides(tmp_path, small_corpus, "wandb.mode=offline"), cwd=tmp_path)
    assert "resumed from" in proc.stderr and "step 3" in proc.stderr
    assert "tokenizer:" in proc.stderr and "skipped" in proc.stderr
    assert (run / "tokenizer" / "tokenizer.json").stat().st_mtime == tok_mtime
    assert "fill-mask with transformers" in proc.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert {"loss", "mlm/loss", "mlm/accuracy", "lr", "tokens", "tokens_per_s"} <= set(r)
    assert records[-1]["tokens"] > records[2]["tokens"] > 0
    assert (
        json.loads((run / "checkpoints" / "latest").parent.joinpath("step_00000006", "trainer_state.json").read_text())[
            "step"
        ]
        == 6
    )
    assert (run / "config.yaml").is_file() and (run / "wandb_run_id").is_file()

    from transformers import AutoModelForMaskedLM

    model, info = AutoModelForMaskedLM.from_pretrained(run / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    card = (run / "hf" / "README.md").read_text()
    assert "mlm" in card and "6" in card

    # export again from the checkpoint into another directory, through the CLI
    out = tmp_path / "exported"
    proc = pretrain("export", run, "--out", out, cwd=tmp_path)
    assert (out / "model.safetensors").is_file() and "max |logit diff|" in proc.stderr


def test_run_exports_what_its_time_budget_trained(tmp_path, small_corpus):
    """train.max_minutes (the demo's cap on a slow or busy machine) ends `pretrain run` with an export and the
    fill-mask demo of the steps it trained, not with a checkpoint alone."""
    proc = pretrain(
        "run",
        "tiny",
        *overrides(tmp_path, small_corpus, "train.max_minutes=0.0001", "wandb.mode=disabled"),
        cwd=tmp_path,
    )
    run = tmp_path / "e2e"
    assert "train.max_minutes=0.0001 ended training at step 1 of 6" in proc.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert (run / "hf" / "model.safetensors").is_file() and "fill-mask with transformers" in proc.stdout


def test_bad_inputs_fail_in_one_line(tmp_path, small_corpus):
    proc = pretrain("run", "tiny", *overrides(tmp_path, tmp_path / "missing.jsonl"), cwd=tmp_path, rc=2)
    assert proc.stderr.strip().startswith("error:") and "missing.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "   "}\n\n')
    proc = pretrain("tokenizer", empty, "--out", tmp_path / "tok", cwd=tmp_path, rc=2)
    assert "empty.jsonl" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "tok").exists()

    # a corpus shorter than one packed sequence: a message, not a ZeroDivisionError
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "Too short to train on."}\n')
    args = overrides(tmp_path / "short", short, "data.max_seq_len=128")
    proc = pretrain("run", "tiny", *args, "--no-demo", cwd=tmp_path, rc=2)
    last = proc.stderr.strip().splitlines()[-1]  # after the stages' progress lines
    assert last.startswith("error:") and "gives no sample of data.max_seq_len=128" in last, proc.stderr
    assert "Traceback" not in proc.stderr

    # sentence pairs from a corpus of one sentence per document: said so (it blamed packing and the corpus's size)
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"Line number {i} is a sentence of its own about the union.\n" for i in range(300)))
    args = overrides(tmp_path / "lines", lines, "data.text_documents=lines", "objectives={mlm: {}, nsp: {}}")
    proc = pretrain("run", "tiny", *args, "--no-demo", cwd=tmp_path, rc=2)
    assert "has no document of two sentences or more: nsp and sop" in proc.stderr.strip().splitlines()[-1]

    afile = tmp_path / "afile"
    afile.write_text("mine")
    proc = pretrain("run", "tiny", *overrides(afile, small_corpus), "--no-demo", cwd=tmp_path, rc=2)
    assert f"{afile} is a file, not a directory" in proc.stderr and "Traceback" not in proc.stderr  # NotADirectoryError
    assert afile.read_text() == "mine"

    proc = pretrain("train", "tiny", "model.hidden_size=wide", cwd=tmp_path, rc=2)
    assert "model.hidden_size" in proc.stderr and "'wide'" in proc.stderr and "Traceback" not in proc.stderr
    # values out of range: tracebacks before (an OverflowError, torch's dropout check), or silently one document per
    # shard
    for flag, value, needle in (
        ("--vocab-size", "-5", "argument --vocab-size: must be a whole number above 0, got '-5'"),
        ("--min-frequency", "-1", "argument --min-frequency: must be a whole number, 0 or more"),  # an OverflowError
        ("--vocab-size", "1000000000000", "vocab_size must be within 1..8,388,608"),  # the trainer's abort, rc 134
    ):
        proc = pretrain("tokenizer", small_corpus, "--out", tmp_path / "neg", f"{flag}={value}", cwd=tmp_path, rc=2)
        assert needle in proc.stderr and "Traceback" not in proc.stderr and not (tmp_path / "neg").exists()
    # the presets' demo corpus is relative to the project: from elsewhere, the message says where it is
    proc = pretrain("tokenizer", "data/us-speeches.public-domain.jsonl", "--out", tmp_path / "t", cwd=tmp_path, rc=2)
    assert f"the project's copy is {ROOT / 'data' / 'us-speeches.public-domain.jsonl'}" in proc.stderr
    proc = pretrain("train", "tiny", "--world-size", "4", cwd=tmp_path, rc=2)  # was ignored: one process trained
    assert "--world-size and --gpus-per-node plan a --dry-run" in proc.stderr
    for override, needle in [
        ("data.vocab_size=-5", "data.vocab_size: must be >= 1, got -5"),
        ("data.max_seq_len=2", "data.max_seq_len: must be >= 8 tokens, got 2"),
        ("model.hidden_dropout=1.5", "model.hidden_dropout: must be within [0, 1), got 1.5"),
        ("model.attention_dropout=-0.5", "model.attention_dropout: must be within [0, 1), got -0.5"),
        ("data.docs_per_shard=0", "data.docs_per_shard: must be >= 1, got 0"),
    ]:
        proc = pretrain("config", "tiny", override, cwd=tmp_path, rc=2)
        assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    # a tokenizer built, then shards fail on a bad document: the tokenizer stays, no manifest is left
    pretrain("tokenizer", small_corpus, "--out", tmp_path / "tok", "--vocab-size", "512", cwd=tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(small_corpus.read_bytes()[:20000].rsplit(b"\n", 1)[0] + b"\n" + b'{"text": "caf\xe9 au lait"}\n')
    proc = pretrain(
        "shards",
        bad,
        "--tokenizer",
        tmp_path / "tok",
        "--out",
        tmp_path / "shards",
        "--on-bad",
        "error",
        cwd=tmp_path,
        rc=2,
    )
    assert "bad.jsonl:" in proc.stderr and "UTF-8" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert not (tmp_path / "shards" / "manifest.json").exists()


def test_help_explains_every_option(tmp_path):
    for command in ("run", "train", "tokenizer", "shards", "export"):
        proc = pretrain(command, "--help", cwd=tmp_path)
        assert "usage: pretrain" in proc.stdout
    text = pretrain("train", "--help", cwd=tmp_path).stdout
    assert "objectives" in text and "train.micro_batch_size" in text and "model.hidden_size" in text


def test_missing_inputs_fail_before_the_run_directory_is_made(tmp_path):
    """A data.corpus that is not there, or a data.sources pattern that matches nothing: the error came after the run
    directory was claimed (its .lock and marker written); now before anything is written."""
    nothing = "data.sources=[{name: a, corpus: [nothing-*.jsonl], weight: 1}]"
    for name, data in [("corpus", f"data.corpus=[{tmp_path / 'missing.jsonl'}]"), ("sources", nothing)]:
        proc = pretrain("run", "tiny", f"output_dir={tmp_path / 'runs'}", f"name={name}", data, cwd=tmp_path, rc=2)
        assert ("missing.jsonl" if name == "corpus" else "matches no corpus file") in proc.stderr
        assert not (tmp_path / "runs" / name).exists(), proc.stderr
