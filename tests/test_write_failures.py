"""A write that fails part-way (a full disk, a file-size limit) ends in one error line naming what was being written,
leaves what was done before as it was, and the same command again, once there is room, finishes the work."""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path

import pytest
from helpers import small_corpus, tsv_task

from pretrain.cli import main
from pretrain.core.outputs import claim_output, mark_output

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return small_corpus(tmp_path_factory.mktemp("corpus"), slice(0, 8))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tok"
    assert main(["tokenizer", str(corpus), "--out", str(out), "--vocab-size", "512"]) == 0
    return out


class _FillingFile:
    """A file on a disk with `room` bytes left: a write past them writes what fits, then fails with ENOSPC."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data):
        if len(data) > self.room:
            self.file.write(data[: self.room])
            self.file.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def __getattr__(self, name):
        return getattr(self.file, name)


def disk_fills_after(monkeypatch, room: int) -> None:
    """Every file opened for writing from now on (builtin open, pathlib's) meets a full disk after `room` bytes."""
    import io

    real = io.open

    def opened(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        return _FillingFile(f, room) if any(m in mode for m in "wax") else f

    monkeypatch.setattr(io, "open", opened)
    monkeypatch.setattr(builtins, "open", opened)


def one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error:"), err[-5:]
    for needle in needles:
        assert needle in err[-1], (needle, err[-1])
    return err[-1]


def test_a_marker_that_could_not_be_written_leaves_the_directory_claimable(tmp_path, monkeypatch):
    """The output marker went through a temporary file that a failed write left behind: not a name of ours, so the
    same command again, with space, refused the directory it had created itself ('files this tool did not write')."""
    out = tmp_path / "shards"

    def no_room(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", no_room)
        with pytest.raises(OSError):
            mark_output(out, "shards")
    assert list(out.iterdir()) == []
    claim_output(out, "shards")  # the same command again may write there
    mark_output(out, "shards")
    assert [p.name for p in out.iterdir()] == [".bert-pretrain.json"]


def test_shard_files_that_do_not_fit_are_one_line_and_the_build_resumes(
    corpus, tokenizer, tmp_path, capsys, monkeypatch
):
    """numpy's tofile reports a full disk as an OSError with no errno ('N requested and M written'), which the CLI
    let through as a traceback; the shard files are now written through Python's file object, which says ENOSPC."""
    import data_pipeline.shard_encode as encode

    out = tmp_path / "shards"
    args = ["shards", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out), "--workers", "0"]
    args += ["--docs-per-shard", "3"]

    def full_after_first_shard(path, mode="r", *rest, **kwargs):
        if "w" in mode and Path(path).name.startswith("shard_00001."):
            return builtins.open("/dev/full", mode, *rest, **kwargs)  # every write fails with ENOSPC
        return builtins.open(path, mode, *rest, **kwargs)

    monkeypatch.setattr(encode, "open", full_after_first_shard, raising=False)
    assert main(args) == 2
    one_error_line(capsys, "no space left on device", "shard_00001")
    assert (out / "shard_00000.done.json").is_file() and not (out / "manifest.json").exists()
    monkeypatch.undo()
    assert main(args) == 0
    from data_pipeline.shard_read import ShardSet

    assert len(ShardSet(out, verify=True).manifest["shards"]) == 3


def test_a_tokenizer_that_does_not_fit_is_one_line_and_keeps_the_previous_one(corpus, tmp_path, capsys, monkeypatch):
    """tokenizers (Rust) reports a full disk as a plain Exception ('No space left on device (os error 28)'), which the
    CLI let through as a traceback. The previous tokenizer stays, and the same command again replaces it."""
    from transformers import PreTrainedTokenizerFast

    out = tmp_path / "tok"
    args = ["tokenizer", str(corpus), "--out", str(out), "--vocab-size", "512"]
    assert main(args) == 0
    before = (out / "tokenizer.json").read_bytes()
    save = PreTrainedTokenizerFast.save_pretrained

    def onto_a_full_disk(self, directory, *rest, **kwargs):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "tokenizer.json").symlink_to("/dev/full")  # Rust's write of it fails with ENOSPC
        return save(self, directory, *rest, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", onto_a_full_disk)
    assert main([*args[:-1], "576"]) == 2
    one_error_line(capsys, "no space left on device", "free some space")
    assert (out / "tokenizer.json").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
    monkeypatch.undo()
    assert main([*args[:-1], "576"]) == 0


def test_a_copy_that_does_not_fit_names_the_file_written_not_the_one_read(tmp_path, monkeypatch):
    """shutil's copy reports a full disk naming its source first: `pretrain export` out of space while copying the
    tokenizer said 'while writing <checkpoint>/tokenizer/tokenizer.json', as if it were writing into the checkpoint."""
    import shutil

    from pretrain.core.errors import no_room

    source, copy = tmp_path / "checkpoint-tokenizer.json", tmp_path / "export" / "tokenizer.json"
    source.write_text("{}")
    copy.parent.mkdir()

    def no_room_left(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "sendfile", no_room_left)
    with pytest.raises(OSError) as caught:
        shutil.copy2(source, copy)
    message = no_room(caught.value)
    assert f"while writing {copy};" in message and str(source) not in message, message


def test_a_file_size_limit_or_a_quota_is_one_line(corpus, tokenizer, tmp_path):
    """EFBIG (a file past `ulimit -f`, or FAT32's 4 GiB) and EDQUOT (a cluster's quota) went through as tracebacks; only
    ENOSPC had its line. Here a real limit: the shard build runs with RLIMIT_FSIZE below its token file's size."""
    import resource
    import subprocess
    import sys

    from pretrain.core.errors import no_room
    from pretrain.train.distributed import single_process_env

    quota = no_room(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/scratch/me/run/metrics.jsonl"))
    assert quota.startswith("disk quota exceeded while writing /scratch/me/run/metrics.jsonl;"), quota

    out = tmp_path / "shards"
    args = ["shards", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out), "--workers", "0"]

    def limited():  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))

    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *args],
        env=single_process_env(DS_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        preexec_fn=limited,
        timeout=300,
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert err[-1].startswith("error: file too large") and "shard_00000" in err[-1] and "ulimit -f" in err[-1], err[-1]
    assert main(args) == 0  # without the limit, the same command finishes


def test_the_run_files_that_do_not_fit_are_named(tmp_path, capsys):
    """config.yaml, trainer_state.json, the integrity record, `latest` (write_atomic) and metrics.jsonl: a full disk
    while writing one said 'no space left on device' and not where; the line now names the file."""
    from pretrain.core.errors import no_room
    from pretrain.core.files import write_atomic
    from pretrain.train.metrics import MetricsLogger

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write to it fails with ENOSPC
    logger = MetricsLogger(tmp_path, {}, 10, 0, "disabled", "p")
    with pytest.raises(OSError) as caught:
        logger.log({"step": 1, "loss": 6.0})
    logger.close()
    assert no_room(caught.value).startswith(f"no space left on device while writing {tmp_path / 'metrics.jsonl'};")

    (tmp_path / "config.yaml").write_text("before")
    os.symlink("/dev/full", tmp_path / f".config.yaml.tmp-{os.getpid()}")  # where write_atomic writes first
    with pytest.raises(OSError) as caught:
        write_atomic(tmp_path / "config.yaml", "after")
    assert no_room(caught.value).startswith(f"no space left on device while writing {tmp_path / 'config.yaml'};")
    assert (tmp_path / "config.yaml").read_text() == "before"


def test_a_plot_that_does_not_fit_keeps_the_previous_one(tmp_path, monkeypatch):
    """`data inspect`'s histogram and an ablation report's plots were saved in place: a full disk left a truncated PNG
    where the previous plot was, a file that looks finished. Now each goes through a temporary file."""
    import numpy as np
    from matplotlib.figure import Figure

    from pretrain.evaluation.inspect import length_histogram
    from pretrain.evaluation.report_plots import plot_significance

    lengths = np.arange(1, 200)
    plots = [tmp_path / "doc_lengths.png", tmp_path / "significance.png"]
    length_histogram(lengths, plots[0], 64, "before")
    plot_significance([], plots[1])
    before = {p: p.read_bytes() for p in plots}
    save = Figure.savefig

    def cut_short(self, fname, *args, **kwargs):
        save(self, fname, *args, **kwargs)
        Path(fname).write_bytes(Path(fname).read_bytes()[:100])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", cut_short)
    with pytest.raises(OSError) as caught:
        length_histogram(lengths[:50], plots[0], 32, "after")
    assert caught.value.filename == str(plots[0])
    with pytest.raises(OSError):
        plot_significance([], plots[1])
    assert {p: p.read_bytes() for p in plots} == before and sorted(tmp_path.iterdir()) == sorted(plots)


def test_a_json_result_that_does_not_fit_keeps_the_previous_one(tmp_path, monkeypatch):
    """`pretrain eval/finetune --json FILE` wrote the user's file in place: a full disk left it cut short, the previous
    results lost and the file no longer JSON."""
    import json

    from pretrain.cli import write_json

    path = tmp_path / "results" / "mlm.json"
    write_json(path, {"accuracy": 0.5})
    with monkeypatch.context() as patched:
        disk_fills_after(patched, 5)
        with pytest.raises(OSError) as caught:
            write_json(path, {"accuracy": 0.625, "perplexity": 12.5})
    assert caught.value.filename == str(path)
    assert json.loads(path.read_text()) == {"accuracy": 0.5} and [p.name for p in path.parent.iterdir()] == [path.name]


def test_an_ablation_config_that_does_not_fit_is_kept(tmp_path, monkeypatch):
    """`pretrain ablate` rewrites <output_dir>/ablation.yaml in place at every invocation, and that file is the config
    its printed commands (and the user after them) run from: a full disk left the user's config cut short."""
    from pretrain.evaluation import ablate
    from pretrain.evaluation.ablation_plan import load_ablation

    class Stop(Exception):
        pass

    def stop(ab):
        raise Stop

    monkeypatch.setattr(ablate, "prepare_data", stop)  # what comes after the config is written: not needed here
    tiny = str(Path(__file__).resolve().parent.parent / "configs" / "ablation-tiny.yaml")
    ab = load_ablation(tiny, [f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]", f"output_dir={tmp_path / 'ab'}"])
    with pytest.raises(Stop):
        ablate.run_ablation(ab)
    config = tmp_path / "ab" / "ablation.yaml"
    before = config.read_text()
    assert len(before) > 200
    with monkeypatch.context() as patched:
        disk_fills_after(patched, 100)  # room for the lock file's line, not for the config
        with pytest.raises(OSError):
            ablate.run_ablation(load_ablation(str(config), []))
    assert config.read_text() == before and not list(config.parent.glob(".*tmp*"))


@pytest.mark.parametrize("command", ["tokenizer", "shards"])
def test_an_output_on_a_read_only_file_system_is_one_line(command, corpus, tokenizer, tmp_path, capsys, monkeypatch):
    """EROFS or EACCES creating an output (a read-only mount, another user's directory) went through as a traceback
    from os.mkdir; `pretrain export` alone said it in one line. (Simulated: root may write anywhere.)"""
    readonly = tmp_path / "ro"
    make = os.mkdir

    def refused(path, *args, **kwargs):
        if Path(path).is_relative_to(readonly) and Path(path) != readonly:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return make(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refused)
    readonly.mkdir()
    args = {
        "tokenizer": ["tokenizer", str(corpus), "--out", str(readonly / "tok"), "--vocab-size", "512"],
        "shards": [
            "shards",
            str(corpus),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(readonly / "sh"),
            "--workers",
            "0",
        ],
    }[command]
    assert main(args) == 2
    one_error_line(capsys, "read-only file system: ", str(readonly), "choose another path")
    assert list(readonly.iterdir()) == []


def test_the_wandb_run_id_is_kept_written_whole_and_an_empty_one_replaced(tmp_path, monkeypatch):
    """One wandb run per run directory across resumes: the id is written once, atomically (a kill while it was
    rewritten in place at every start left an empty file), and an empty file from such a kill gets a new id rather
    than wandb.init(id='')."""
    import sys
    import types

    from pretrain.train import metrics

    ids = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: ids.append(kw["id"])))
    (tmp_path / "wandb_run_id").write_text("")
    metrics._init_wandb(tmp_path, {}, "offline", "p")
    first = (tmp_path / "wandb_run_id").read_text()
    assert len(first) == 8 and ids == [first]
    before = (tmp_path / "wandb_run_id").stat().st_mtime_ns
    metrics._init_wandb(tmp_path, {}, "offline", "p")
    assert ids == [first, first] and (tmp_path / "wandb_run_id").stat().st_mtime_ns == before


def test_a_json_result_goes_through_a_link_and_into_a_pipe(tmp_path):
    """Written whole by a rename, --json replaced a link to the results (a shared file kept its old results, the
    link became a file) and a pipe or /dev/stdout (as root, /dev's link itself), where it was written in place."""
    import json
    import threading

    from pretrain.cli import write_json

    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "r.json").write_text("{}")
    (tmp_path / "link.json").symlink_to("shared/r.json")
    write_json(tmp_path / "link.json", {"a": 1})
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "shared" / "r.json").read_text()) == {
        "a": 1
    }
    os.mkfifo(tmp_path / "fifo")
    read = []
    reader = threading.Thread(target=lambda: read.append((tmp_path / "fifo").read_text()), daemon=True)
    reader.start()
    write_json(tmp_path / "fifo", {"b": 2})
    reader.join(10)
    assert read and json.loads(read[0]) == {"b": 2} and not (tmp_path / "fifo").is_file()
