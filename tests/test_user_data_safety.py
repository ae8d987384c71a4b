"""Nothing the user owns is lost, through the CLI as a user meets it: outputs are only replaced when they are ours,
inputs are never outputs, a resume that would change what the run is refuses before writing anything, one trainer
per run directory, a torn metrics line blocks nothing, a full disk says so."""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import one_line_error, requires_fp16, run_args, snapshot
from helpers import run_cli as pretrain

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "speeches.jsonl").write_text("\n".join(CORPUS.read_text().splitlines()[:20]) + "\n")
    (d / "notes.txt").write_text("the user's own notes\n")
    return d / "speeches.jsonl"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A finished tiny run (tokenizer, shards, 3 steps, checkpoint, metrics, export)."""
    tmp = tmp_path_factory.mktemp("runs")
    pretrain("run", *run_args(tmp, corpus), "--no-demo", cwd=tmp)
    return tmp, tmp / "r"


def test_export_never_replaces_what_is_not_an_export(trained, corpus, tmp_path):
    tmp, run = trained
    before = snapshot(run)
    proc = pretrain("export", run, "--out", run, cwd=tmp, rc=2)
    one_line_error(proc, "is the run directory being exported", str(run))
    proc = pretrain("export", run, "--out", run / "checkpoints", cwd=tmp, rc=2)
    one_line_error(proc, "is its checkpoints")
    proc = pretrain("export", run / "checkpoints" / "step_00000003", "--out", run, cwd=tmp, rc=2)
    one_line_error(proc, "holds the checkpoint being exported")
    assert snapshot(run) == before

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("months of work")
    proc = pretrain("export", run, "--out", foreign, cwd=tmp, rc=2)
    one_line_error(proc, str(foreign), "thesis.tex")
    assert (foreign / "thesis.tex").read_text() == "months of work" and len(list(foreign.iterdir())) == 1

    # `pretrain run` with that folder as export_dir: refused before anything is built or trained (it trained to the
    # end, then refused the export, naming a --out the user never gave)
    fresh = tmp_path / "fresh"
    proc = pretrain("run", *run_args(fresh, corpus, f"export_dir={foreign}"), "--no-demo", cwd=tmp, rc=2)
    one_line_error(proc, f"export_dir {foreign} already holds files", "thesis.tex")
    assert not fresh.exists() and len(list(foreign.iterdir())) == 1

    # inside the run's checkpoints (rotation deleted it with the checkpoint), shards or tokenizer (rebuilt), or
    # another run's export (replaced by this model, its card the only sign): refused, nothing written
    from pretrain.core.outputs import mark_output

    other = tmp_path / "other-run"
    mark_output(other, "run")
    mark_output(other / "hf", "export")
    (other / "checkpoints").mkdir()
    for out, said in (
        (run / "checkpoints" / "step_00000003" / "mine", "a run's checkpoints, which rotation deletes"),
        (run / "shards" / "hfx", "shards it rebuilds"),
        (run / "tokenizer" / "hfx", "tokenizer it rebuilds"),
        (other / "hf", "is run other-run's own export"),
    ):
        proc = pretrain("export", run, "--out", out, "--no-verify", cwd=tmp, rc=2)
        one_line_error(proc, str(out), said)
    assert snapshot(run) == before and sorted(p.name for p in (other / "hf").iterdir()) == [".bert-pretrain.json"]
    assert not any((other / "checkpoints").iterdir())

    # a directory this tool exported into is ours to replace, again and again
    out = tmp_path / "export"
    pretrain("export", run, "--out", out, cwd=tmp)
    pretrain("export", run, "--out", out, cwd=tmp)
    assert (out / "model.safetensors").is_file() and (out / ".bert-pretrain.json").is_file()
    assert not (out / "tokenizer" / ".bert-pretrain.json").exists()


def test_tokenizer_and_shards_never_replace_a_users_directory(trained, corpus, tmp_path):
    tmp, run = trained
    corpus_dir = snapshot(corpus.parent)
    proc = pretrain("tokenizer", corpus, "--out", corpus.parent, "--vocab-size", "512", cwd=tmp, rc=2)
    one_line_error(proc, "holds the corpus file")
    assert snapshot(corpus.parent) == corpus_dir

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "vocab-notes.md").write_text("mine")
    proc = pretrain("tokenizer", corpus, "--out", mine, "--vocab-size", "512", cwd=tmp, rc=2)
    one_line_error(proc, "vocab-notes.md", "did not write")
    assert snapshot(mine) == {"vocab-notes.md": b"mine"}

    # a run's own tokenizer/ and shards/, which its checkpoints trained on: replaced, the run could not resume
    before = snapshot(run)
    for command in (["tokenizer", corpus, "--vocab-size", "512"], ["shards", corpus, "--tokenizer", run / "tokenizer"]):
        out = run / ("tokenizer" if command[0] == "tokenizer" else "shards")
        proc = pretrain(*command, "--out", out, cwd=tmp, rc=2)
        one_line_error(proc, f"is the {out.name} of the run", "whose checkpoints trained on it")
    assert snapshot(run) == before
    # held-out shards of the run's tokenizer kept beside it: a new directory, not the run's own
    pretrain("shards", corpus, "--tokenizer", run / "tokenizer", "--out", run / "valid-shards", cwd=tmp)
    assert (run / "valid-shards" / "manifest.json").is_file()
    shutil.rmtree(run / "valid-shards")

    # a run directory given as the tokenizer directory is neither trained over nor deleted
    proc = pretrain("run", *run_args(tmp, corpus, "name=other", f"data.tokenizer={run}"), cwd=tmp, rc=2)
    one_line_error(proc, "is a run directory of this tool, not a tokenizer directory")
    assert snapshot(run) == before

    users = tmp_path / "users-shards"
    users.mkdir()
    (users / "manifest.json").write_text('{"my": "inventory"}')
    (users / "build.json").write_text('{"my": "build"}')
    proc = pretrain("shards", corpus, "--tokenizer", run / "tokenizer", "--out", users, "--workers", "0", cwd=tmp, rc=2)
    one_line_error(proc, str(users))
    assert snapshot(users) == {"build.json": b'{"my": "build"}', "manifest.json": b'{"my": "inventory"}'}


def test_run_never_builds_over_shards_the_config_names(trained, corpus, tmp_path):
    """`pretrain run` with data.shards naming shards built from other files than data.corpus (a preset's demo corpus
    left there) rebuilt them in place and trained on the wrong text; now it refuses, and data.corpus=[] trains on
    them as they are."""
    tmp, run = trained
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(CORPUS.read_text().splitlines()[40:60]) + "\n")
    named = [f"data.tokenizer={run / 'tokenizer'}", f"data.shards={run / 'shards'}"]
    before = snapshot(run / "shards")
    proc = pretrain("run", *run_args(tmp_path, other, "name=elsewhere", *named), "--no-demo", cwd=tmp, rc=2)
    one_line_error(proc, f"data.shards={run / 'shards'} holds the shards of {corpus}", "data.corpus=[]")
    assert snapshot(run / "shards") == before
    proc = pretrain("run", *run_args(tmp_path, other, "name=as-built", *named, "data.corpus=[]"), "--no-demo", cwd=tmp)
    assert "used as they are" in proc.stderr and snapshot(run / "shards") == before
    assert (tmp_path / "as-built" / "hf" / "config.json").is_file()
    # a datasets directory is its arrow files in the manifest: the same corpus, shards reused (not refused)
    import datasets

    ds = tmp_path / "ds"
    datasets.Dataset.from_dict(
        {"text": [json.loads(line)["text"] for line in other.read_text().splitlines()]}
    ).save_to_disk(str(ds))
    built = tmp_path / "ds-shards"
    pretrain("shards", ds, "--tokenizer", run / "tokenizer", "--out", built, "--workers", "0", cwd=tmp)
    named = [f"data.tokenizer={run / 'tokenizer'}", f"data.shards={built}"]
    pretrain("run", *run_args(tmp_path, ds, "name=from-ds", *named), "--no-demo", cwd=tmp)


def test_resume_refuses_changed_fixed_settings_and_allows_the_rest(trained, corpus, tmp_path):
    tmp, run = trained
    config_before = (run / "config.yaml").read_bytes()
    before = snapshot(run)
    # another tokenizer of the same padded size, trained on other text
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(CORPUS.read_text().splitlines()[40:60]) + "\n")
    pretrain("tokenizer", other, "--out", tmp_path / "tok2", "--vocab-size", "512", cwd=tmp)
    changed = [
        "model.num_heads=2",
        "train.micro_batch_size=4",
        "data.max_seq_len=32",
        "train.seed=7",
        "objectives.mlm.mask_prob=0.2",
        f"data.tokenizer={tmp_path / 'tok2'}",
        f"data.shards={tmp_path / 'sh2'}",
        "train.max_steps=5",
    ]
    pretrain("shards", other, "--tokenizer", tmp_path / "tok2", "--out", tmp_path / "sh2", "--workers", "0", cwd=tmp)
    proc = pretrain("train", *run_args(tmp, corpus, *changed), cwd=tmp, rc=2)
    one_line_error(
        proc,
        "cannot resume",
        "model.num_heads: 4 in the checkpoint, 2 now",
        "train.global_batch",
        "data.max_seq_len: 64 in the checkpoint, 32 now",
        "train.seed: 1234 in the checkpoint, 7 now",
        "objectives.mlm.mask_prob: 0.15 in the checkpoint, 0.2 now",
        "tokenizer (sha256",
        "data (content of the shards)",
        "train.allow_changes=[",
    )
    assert (run / "config.yaml").read_bytes() == config_before and snapshot(run) == before

    # what may change: the length of the run and its schedule, cadence, the split of the same global batch
    proc = pretrain(
        "train",
        *run_args(
            tmp,
            corpus,
            "train.max_steps=5",
            "train.lr=2e-3",
            "train.log_every=2",
            "train.save_every=0",
            "train.micro_batch_size=4",
            "train.grad_accum_steps=2",
        ),
        cwd=tmp,
    )
    assert "resumed from" in proc.stderr and "train.lr: 0.001 -> 0.002" in proc.stderr
    assert json.loads((run / "checkpoints" / "step_00000005" / "trainer_state.json").read_text())["step"] == 5
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]

    # on purpose, with the override: the seed changes and the run goes on
    pretrain(
        "train",
        *run_args(tmp, corpus, "train.max_steps=6", "train.seed=7", "train.allow_changes=[train.seed]"),
        cwd=tmp,
    )
    assert (
        json.loads((run / "checkpoints" / "latest").parent.joinpath("step_00000006", "trainer_state.json").read_text())[
            "fingerprint"
        ]["train.seed"]
        == 7
    )


def test_one_trainer_per_run_directory(corpus, tmp_path):
    pretrain("tokenizer", corpus, "--out", tmp_path / "tok", "--vocab-size", "512", cwd=tmp_path)
    pretrain(
        "shards", corpus, "--tokenizer", tmp_path / "tok", "--out", tmp_path / "sh", "--workers", "0", cwd=tmp_path
    )
    args = run_args(
        tmp_path,
        corpus,
        f"data.tokenizer={tmp_path / 'tok'}",
        f"data.shards={tmp_path / 'sh'}",
        "train.max_steps=100000",
        "train.save_every=0",
    )
    first = pretrain("train", *args, cwd=tmp_path, wait=False)
    try:
        lock = tmp_path / "r" / ".lock"
        deadline = time.time() + 120
        while not (lock.is_file() and "pid" in lock.read_text()) and time.time() < deadline:
            assert first.poll() is None, first.communicate()[1][-3000:]
            time.sleep(0.2)
        proc = pretrain("train", *args, cwd=tmp_path, rc=2)
        one_line_error(proc, "another process is training", f"pid {first.pid}")
    finally:
        first.terminate()  # SIGTERM: the first trainer saves and exits 75
        _, err = first.communicate(timeout=300)
    assert first.returncode == 75, err[-3000:]
    records = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert records == sorted(set(records))  # one writer: no step logged twice
    # the lock went with the process: the run resumes
    pretrain("train", *args[:-2], "train.max_steps=" + str(records[-1] + 1), cwd=tmp_path)


def test_a_torn_metrics_line_blocks_nothing(trained, tmp_path):
    tmp, run = trained
    metrics = run / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good + '{"step": 4, "loss": 6.2, "mlm/lo')  # the disk filled up mid-line
    proc = pretrain("export", run, "--out", tmp_path / "hf", cwd=tmp)
    assert "max |logit diff|" in proc.stderr
    from pretrain.train.metrics import read_metrics

    assert [r["step"] for r in read_metrics(run)] == [json.loads(line)["step"] for line in good.splitlines()]


def test_a_resume_trims_a_metrics_file_holding_bytes_that_are_not_utf8(tmp_path):
    """A resume drops the lines after its checkpoint; a line of corrupt bytes (a damaged disk) was a
    UnicodeDecodeError that stopped the resume, where a torn line was dropped."""
    from pretrain.train.trainer import _trim_metrics

    lines = [json.dumps({"step": s, "loss": 7.0 - s}) + "\n" for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_bytes("".join(lines).encode() + b'{"step": 7, "lo\xc3')
    assert _trim_metrics(tmp_path, 2) == [3]  # what a resume says wandb keeps (`wandb_keeps_note`)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:2])


def test_save_every_zero_saves_only_at_the_end(corpus, tmp_path):
    pretrain("run", *run_args(tmp_path, corpus, "train.save_every=0"), "--no-demo", cwd=tmp_path)
    assert [p.name for p in sorted((tmp_path / "r" / "checkpoints").glob("step_*"))] == ["step_00000003"]


def test_a_damaged_checkpoint_names_the_intact_previous_one(corpus, tmp_path):
    args = run_args(tmp_path, corpus, "train.save_every=1", "train.keep_checkpoints=3")
    pretrain("run", *args, "--no-demo", cwd=tmp_path)
    latest = tmp_path / "r" / "checkpoints" / "step_00000003"
    victim = next(latest.glob("*model_states.pt"))
    victim.write_bytes(victim.read_bytes()[:-10] + b"0123456789")
    proc = pretrain("train", *args[:-3], "train.max_steps=4", cwd=tmp_path, rc=2)
    aside = tmp_path / "r" / "checkpoints" / "damaged-step_00000003"
    one_line_error(proc, "is corrupt", "step_00000002 is intact", f"mv {latest} {aside}")
    proc = pretrain("export", tmp_path / "r", "--out", tmp_path / "hf", cwd=tmp_path, rc=2)
    one_line_error(proc, "step_00000002 is intact")
    record = (latest / "integrity.json").read_bytes()
    for torn in (record[:20], b"[1, 2]"):  # its record torn, or not one of ours: a JSONDecodeError, an AttributeError
        (latest / "integrity.json").write_bytes(torn)
        proc = pretrain("export", tmp_path / "r", "--out", tmp_path / "hf", cwd=tmp_path, rc=2)
        one_line_error(proc, "integrity.json is damaged", "step_00000002 is intact")
    latest.rename(aside)  # as the message says: the run continues from step 2
    proc = pretrain("train", *args[:-3], "train.max_steps=4", cwd=tmp_path)
    assert "continuing from step_00000002" in proc.stderr and "step 2" in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs to fill the disk needs root")
def test_a_full_disk_says_so_and_keeps_the_last_checkpoint(corpus, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)]).returncode:
        pytest.skip("this machine does not let root mount a tmpfs")
    try:
        pretrain("tokenizer", corpus, "--out", tmp_path / "tok", "--vocab-size", "512", cwd=tmp_path)
        pretrain(
            "shards", corpus, "--tokenizer", tmp_path / "tok", "--out", tmp_path / "sh", "--workers", "0", cwd=tmp_path
        )
        args = [
            "tiny",
            f"output_dir={disk}",
            "name=r",
            f"data.tokenizer={tmp_path / 'tok'}",
            f"data.shards={tmp_path / 'sh'}",
            "model.num_layers=1",
            "train.log_every=1",
            "train.warmup_steps=1",
            "train.save_every=1",
            "train.keep_checkpoints=50",
            "train.max_steps=50",
        ]
        proc = pretrain("train", *args, cwd=tmp_path, rc=2)
        one_line_error(proc, "no space left on device", "stays the latest checkpoint")
        latest = (disk / "r" / "checkpoints" / "latest").read_text().strip()
        from pretrain.train.checkpoint import verify_integrity

        verify_integrity(disk / "r" / "checkpoints" / latest)
        assert (
            sorted(p.name for p in (disk / "r" / "checkpoints").iterdir() if p.name.startswith("step_"))[-1] == latest
        )
    finally:
        subprocess.run(["umount", str(disk)])


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory, corpus):
    """A real transformers checkpoint (random weights, random biases) with our tokenizer, and shards for it."""
    import torch
    import transformers

    d = tmp_path_factory.mktemp("init")
    pretrain("tokenizer", corpus, "--out", d / "tok", "--vocab-size", "512", cwd=d)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(d / "tok"))
    config = transformers.BertConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    model = transformers.BertForMaskedLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(d / "hf"))
    tok.save_pretrained(str(d / "hf"))
    pretrain("shards", corpus, "--tokenizer", d / "hf", "--out", d / "shards", "--workers", "0", cwd=d)
    return d


@pytest.mark.parametrize(
    "precision,zero",
    [
        ("bf16", 0),
        ("bf16", 3),
        ("fp32", 0),
        pytest.param("fp16", 0, marks=requires_fp16),
        pytest.param("fp16", 3, marks=requires_fp16),
    ],
)
def test_exports_keep_full_precision(hf_checkpoint, tmp_path, precision, zero):
    """One step at lr 0 from a real checkpoint, then an export: every weight is the original, whatever the training
    precision and ZeRO stage (bf16/fp16 runs used to export their rounded copy: 9e-2 off in hidden states)."""
    import torch
    from safetensors.torch import load_file
    from transformers import BertForMaskedLM

    d = hf_checkpoint
    pretrain(
        "train",
        "tiny",
        f"output_dir={tmp_path}",
        "name=r",
        f"model.init_from={d / 'hf'}",
        f"data.shards={d / 'shards'}",
        "train.lr=0",
        "train.max_steps=1",
        f"train.precision={precision}",
        f"train.zero_stage={zero}",
        "model.hidden_dropout=0",
        "model.attention_dropout=0",
        cwd=tmp_path,
    )
    pretrain("export", tmp_path / "r", "--out", tmp_path / "hf", cwd=tmp_path)
    original, exported = load_file(d / "hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(exported) <= set(original) and len(exported) >= len(original) - 1  # the tied decoder is left out
    worst = max((exported[k] - original[k]).abs().max().item() for k in exported)
    assert worst <= 1e-6, worst
    ids = torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = BertForMaskedLM.from_pretrained(str(d / "hf")).eval()(ids, output_hidden_states=True)
        b = BertForMaskedLM.from_pretrained(str(tmp_path / "hf")).eval()(ids, output_hidden_states=True)
    assert (a.hidden_states[-1] - b.hidden_states[-1]).abs().max().item() <= 1e-6


def test_a_file_system_without_flock_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    """On a file system without flock (Lustre mounted without -o flock) the run directory's lock raised ENOSYS:
    `pretrain train` could not start at all, with a traceback. It goes on unlocked, and says so."""
    import errno

    from pretrain.core import outputs

    def no_flock(f, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(outputs.fcntl, "flock", no_flock)
    with outputs.exclusive(tmp_path / "run", "training"):
        assert "pid" in (tmp_path / "run" / ".lock").read_text()
    err = capsys.readouterr().err
    assert "cannot be locked (Function not implemented; a file system without flock)" in err
    assert "mount it with flock" in err
